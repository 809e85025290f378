"""Environments by name: `make_env(name, **config)` for every env whose spec (pipeline/envs) has a runtime.

Every environment implements `pipeline.synth.envs.base.Environment`: `reset(task) -> first observation`
(task: a `pipeline.envs.tasks.Task`, its `as_dict()`, or a bare task record), `step(action_text) ->
StepResult`, `close()` (idempotent; also a context manager). `StepResult.info` always holds
`valid` (the action parsed and ran); the step that ends an episode also holds `score` (0.0-1.0,
or None when the task has no known answer) and `success`.

A spec names its runtime by import path, so that importing this package does not import every
environment's dependencies.
"""
from __future__ import annotations

from typing import Any

from trajforge.pipeline.envs import runtimes
from trajforge.pipeline.synth.envs.base import EnvFailure, Environment, StepResult


def env_class(name: str) -> type:
    return runtimes()[name].env_class()


def make_env(name: str, **config: Any) -> Environment:
    """A new environment instance; `config` goes to its constructor (timeouts, limits, URLs)."""
    return env_class(name)(**config)


__all__ = ["EnvFailure", "Environment", "StepResult", "env_class", "make_env"]
