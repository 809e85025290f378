"""Environments by name: `make_env("os" | "db" | "agentgym" | "babyai" | "textcraft" | "sciworld", **config)`.

Every environment implements `pipeline.envs.base.Environment`: `reset(task) -> first observation`
(task: a `pipeline.tasks.Task`, its `as_dict()`, or a bare task record), `step(action_text) ->
StepResult`, `close()` (idempotent; also a context manager). `StepResult.info` always holds
`valid` (the action parsed and ran); the step that ends an episode also holds `score` (0.0-1.0,
or None when the task has no known answer) and `success`.

The registry maps names to import paths so that importing this package does not import every
environment's dependencies.
"""
from __future__ import annotations

import importlib
from typing import Any

from trajforge.pipeline.registry import Registry
from trajforge.pipeline.synth.envs.base import EnvFailure, Environment, StepResult

# AgentGym's environments in-process (no server): their tasks are AgentGym items like the
# `agentgym` client's, and their action is AgentGym's action string (the `act` tool).
LOCAL_AGENTGYM: Registry[str] = Registry("local AgentGym environment", {
    "babyai": "trajforge.pipeline.synth.envs.babyai:BabyAIEnv",
    "textcraft": "trajforge.pipeline.synth.envs.textcraft:TextCraftEnv",
    "sciworld": "trajforge.pipeline.synth.envs.sciworld:SciWorldEnv",
})

REGISTRY: Registry[str] = Registry("environment", {
    "os": "trajforge.pipeline.synth.envs.os_sandbox:OsSandboxEnv",
    "db": "trajforge.pipeline.synth.envs.db:DbEnv",
    "agentgym": "trajforge.pipeline.synth.envs.agentgym:AgentGymEnv",
    **LOCAL_AGENTGYM,
})


def env_class(name: str) -> type:
    module, attr = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), attr)


def make_env(name: str, **config: Any) -> Environment:
    """A new environment instance; `config` goes to its constructor (timeouts, limits, URLs)."""
    return env_class(name)(**config)


__all__ = ["EnvFailure", "Environment", "StepResult", "LOCAL_AGENTGYM", "REGISTRY", "env_class", "make_env"]
