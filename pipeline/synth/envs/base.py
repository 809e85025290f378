"""The environment protocol every synthesis environment implements.

reset(task) -> first observation; step(action) -> StepResult; close() frees everything
(processes, mounts, files, connections) and is safe to call twice. Optionally, snapshot() -> state and
restore(state) let tree search (`pipeline.synth.search`) branch from a state without replaying it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class EnvFailure(RuntimeError):
    """A declared failure of the environment's world, not of its code: the sandbox cannot be built,
    the server is down, a task's setup failed. The agent loop makes it an `env_error` quietly; any
    other exception from environment code is a bug, whose traceback it logs."""


@dataclass
class StepResult:
    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    name: str

    def reset(self, task: dict) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


class ClosingEnvironment:
    """`with make_env(...) as env:` closes the environment however the block ends."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
