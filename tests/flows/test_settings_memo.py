"""Prefect's settings context, dumped once a run and validated once a worker (flows/settings_memo.py):
what a task gets is what Prefect's own functions make, for whatever settings are current."""
from __future__ import annotations

from prefect.context import SettingsContext
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

from trajforge.flows import settings_memo


def test_the_settings_are_dumped_again_only_for_other_settings():
    settings_memo.remember_settings_context()
    first = SettingsContext.get().serialize()
    assert first == settings_memo._serialize(SettingsContext.get())
    assert SettingsContext.get().serialize() is first
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        changed = SettingsContext.get().serialize()
        assert changed == settings_memo._serialize(SettingsContext.get())
    assert changed["settings"]["api"]["url"] == "http://127.0.0.1:9/api"
    assert first["settings"].get("api", {}).get("url") != "http://127.0.0.1:9/api"
    assert SettingsContext.get().serialize() == first


def test_a_task_context_gets_the_settings_of_its_own_dump():
    settings_memo.remember_settings_context()
    dumps = []
    for url in ("http://127.0.0.1:9/api", "http://127.0.0.1:10/api", "http://127.0.0.1:9/api"):
        with temporary_settings(updates={PREFECT_API_URL: url}):
            dumps.append({"settings_context": SettingsContext.get().serialize()})
    seen = []
    for dumped in dumps:
        with settings_memo._hydrated_once(dumped):
            seen.append((get_current_settings().api.url, id(get_current_settings())))
    assert [url for url, _ in seen] == ["http://127.0.0.1:9/api", "http://127.0.0.1:10/api", "http://127.0.0.1:9/api"]
    with settings_memo._hydrated_once(dumps[2]):
        assert id(get_current_settings()) == seen[2][1]  # the same dump: the Settings made of it before
