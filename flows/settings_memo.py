"""Prefect's settings, passed to the `processes` runner's workers once a run rather than once a task.

A process pool task runner sends each task its run's context (`prefect.context.serialize_context`
at every `submit`), and the worker builds it again around the task run (`hydrated_context`). Nearly
all of that is the settings: dumping Prefect's settings model (~18 ms of CPU in the flow's process)
and validating it again into a `Settings` (~28 ms in the worker), for the same settings at every
task of a run; ~1 s of CPU in a 100k build's 23 task runs. `remember_settings_context` makes both
remember their last result: the same dict for the same settings objects, the same `Settings` for
the same dict. What a task sees is unchanged.

Prefect replaces a settings object rather than change it (`temporary_settings` enters a new context
with a copy), and its runner already keys the task's environment on that object's identity
(`ProcessPoolTaskRunner.submit`, `_cached_env_settings`); the dump is remembered the same way.
"""
from __future__ import annotations

import pickle

import prefect.context
from prefect.context import SettingsContext

_serialize = SettingsContext.serialize
_hydrated_context = prefect.context.hydrated_context
# (settings, profile, include_secrets, their dump) and (a dump pickled, the SettingsContext made of
# it): the last of each, which every task of a run shares.
_last_serialized: tuple | None = None
_last_hydrated: tuple[bytes, SettingsContext] | None = None


def _serialize_once(self: SettingsContext, include_secrets: bool = True) -> dict:
    """`SettingsContext.serialize`, dumped again only for other settings or profile objects. Its
    callers pickle the dict (or read it), none changes it."""
    global _last_serialized
    last = _last_serialized
    if last is None or last[0] is not self.settings or last[1] is not self.profile or last[2] != include_secrets:
        last = _last_serialized = (self.settings, self.profile, include_secrets,
                                   _serialize(self, include_secrets=include_secrets))
    return last[3]


def _hydrated_once(serialized_context: dict | None = None, client=None):
    """`prefect.context.hydrated_context`, with the settings validated again only when their dump
    differs from the last task's: the context gets the `Settings` and `Profile` made of it before,
    which `SettingsContext` takes as they are."""
    global _last_hydrated
    dumped = (serialized_context or {}).get("settings_context")
    if dumped:
        key = pickle.dumps(dumped, protocol=pickle.HIGHEST_PROTOCOL)
        last = _last_hydrated
        if last is None or last[0] != key:
            last = _last_hydrated = (key, SettingsContext(**dumped))
        made = last[1]
        serialized_context = {**serialized_context,
                              "settings_context": {"profile": made.profile, "settings": made.settings}}
    return _hydrated_context(serialized_context, client)


def remember_settings_context() -> None:
    """Both, in this process (idempotent): the flow's process serializes, a worker hydrates (Prefect's
    worker looks `hydrated_context` up in its module at each task)."""
    SettingsContext.serialize = _serialize_once
    prefect.context.hydrated_context = _hydrated_once
