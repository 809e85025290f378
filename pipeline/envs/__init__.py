"""Environment specs: what every stage asks of an environment, in one module per environment.

Synthesis, salvage, validation, derived sets, negatives and training ask the same questions of an
environment: which task records it reads and how its first prompt reads, its ReAct instructions and
its tools (one list for both action formats: the ReAct action text of a tool call is derived from
the tool), the grammar of its actions with its refusal/progress replies and its terminal rule, the
reference answer of a task, whether a recorded prefix can be replayed, which environment runs a
trajectory recorded under its name, and for evaluation its held-out split, the oracle's reference
steps and the random policy's moves. An `EnvSpec` answers them; each module of this package defines
`SPECS`, the specs of the envs it is the home of, and `specs()` finds them (so adding an
environment is adding one module here, plus its runtime module if it runs in-process). Nothing
outside an env's own modules names it (tests/envs/test_env_specs.py checks that).

Envs come in two kinds: those that run (a `runtime` class with reset/step/close, in
`pipeline/synth/envs/`), and those only recorded (AgentInstruct/AgentGym trajectories: a grammar and
the task pattern of their prompt). A recorded trajectory runs in its own env when that env says
`recorded_here`, else in the env that `hosts_recorded` (an AgentGym server hosts every AgentGym env).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trajforge.pipeline.registry import Registry

if TYPE_CHECKING:
    from trajforge.pipeline.envs.grammar import Grammar
    from trajforge.pipeline.envs.tasks import Task


@dataclass(frozen=True)
class Argument:
    name: str
    description: str


@dataclass(frozen=True)
class Tool:
    """One action of an environment as a named tool with string arguments. The TRL adapter's method
    (its name, signature and Google-style docstring, hence the tool schema) and the ReAct action
    text `step` parses are both made from it."""
    name: str
    description: str
    arguments: tuple[Argument, ...]
    returns: str
    action: Callable[..., str]   # the argument values, in order -> the ReAct action text

    def action_text(self, arguments: dict[str, Any]) -> str:
        missing = [a.name for a in self.arguments if a.name not in arguments]
        if missing:
            raise ValueError(f"{self.name}: missing argument(s) {', '.join(missing)}")
        return self.action(*(str(arguments[a.name]) for a in self.arguments))

    def docstring(self) -> str:
        """Google style, as transformers' `get_json_schema` reads it."""
        lines = [self.description, ""]
        if self.arguments:
            lines += ["Args:", *(f"    {a.name}: {a.description}" for a in self.arguments), ""]
        return "\n".join([*lines, "Returns:", f"    {self.returns}"])


def _no_answer(task: Task) -> str | None:
    return None


def _task_env(task: Task) -> str:
    return task.env


@dataclass(frozen=True)
class EnvSpec:
    name: str
    # --- recorded trajectories ---------------------------------------------------------------
    grammar: Grammar | None = None
    # The user turn that states the real task after an upstream demonstration, and the pattern
    # that pulls the task out of the task turn (pipeline/ingest/normalize.py).
    task_start: re.Pattern | None = None
    task_pattern: re.Pattern | None = None
    # A trajectory recorded under this name runs in this env (else in the env that hosts_recorded).
    recorded_here: bool = False
    # The AgentGym server profile of this env name (`pipeline.envs.agentgym.ServerProfile`).
    server: Any = None
    # --- running ----------------------------------------------------------------------------
    runtime: str | None = None            # "module:Class" with reset/step/close
    task_format: Callable[[dict, str, str], Task] | None = None   # (record, id, source file) -> Task
    recognizes: Callable[[dict], bool] | None = None  # a record without `env` in this env's upstream shape
    first_prompt: Callable[[Task], str] | None = None  # the first user message, when the task fixes it
    instructions: str | None = None       # ReAct instructions, in the benchmark's own action syntax
    tool_instructions: str | None = None  # the same actions as tool calls
    tools: tuple[Tool, ...] = ()
    tool_call: Callable[[str], dict | None] | None = None  # ReAct action -> {"name", "arguments"} | None
    reference_answer: Callable[[Task], str | None] = _no_answer
    replayable: bool = False              # a fresh instance replays a recorded prefix the same way
    hosts_recorded: bool = False          # runs the recorded tasks of the envs that run nowhere else
    # The task an environment can reset to for a recorded trajectory (AgentTraj-L items), or None.
    recorded_task: Callable[[dict], Task | None] | None = None
    record_env: Callable[[Task], str] = _task_env   # the `env` a trajectory of the task is recorded as
    # --- evaluation (pipeline/evaluation) -----------------------------------------------------
    unavailable: Callable[[dict], str | None] | None = None  # why it cannot run here (given its settings), or None
    # The declared held-out split: `name`, `files` (under the eval task folder), `held_out_by`
    # (`text` | `item`), `about`.
    eval_split: dict[str, Any] | None = None
    # The oracle's replies for a task (text, or a function of the last observation), None without a reference.
    reference_steps: Callable[[Task], list | None] | None = None
    random_moves: tuple[str, ...] = ()    # replies the `random` policy draws from: moves the env accepts

    # --- derived ----------------------------------------------------------------------------
    def env_class(self) -> type:
        if self.runtime is None:
            raise KeyError(f"env {self.name!r} has no runtime: it is only recorded")
        module, attr = self.runtime.split(":")
        return getattr(importlib.import_module(module), attr)

    def task_prompt(self, task: Task) -> str:
        """The first user message as upstream words it (the environment's reset returns this)."""
        return self.first_prompt(task) if self.first_prompt else task.description

    def tool(self, name: str) -> Tool:
        found = next((t for t in self.tools if t.name == name), None)
        if found is None:
            raise ValueError(f"unknown tool {name!r}; the tools are {', '.join(t.name for t in self.tools)}")
        return found

    def action_text(self, name: str, arguments: dict[str, Any]) -> str:
        """The ReAct action text `step` parses, for one tool call. Unknown tools raise ValueError
        (TRL turns the error into the tool's answer, so the model sees what went wrong)."""
        return self.tool(name).action_text(arguments)

    def can_snapshot(self) -> bool:
        """The runtime can restore a state it saved (`snapshot()` / `restore(state)`)."""
        cls = self.env_class()
        return callable(getattr(cls, "snapshot", None)) and callable(getattr(cls, "restore", None))


@functools.cache
def specs() -> Registry[EnvSpec]:
    """Every env spec, by name: the `SPECS` of each module of this package."""
    found: dict[str, EnvSpec] = {}
    for module in pkgutil.iter_modules(__path__):
        for spec in getattr(importlib.import_module(f"{__name__}.{module.name}"), "SPECS", ()):
            if spec.name in found:
                raise ValueError(f"env {spec.name!r} has two specs")
            found[spec.name] = spec
    return Registry("environment", dict(sorted(found.items())))


def spec(name: str) -> EnvSpec:
    return specs()[name]


def runtimes() -> Registry[EnvSpec]:
    """The specs of the envs that run (a runtime class), by name."""
    return Registry("environment", {name: s for name, s in specs().items() if s.runtime})


def host() -> EnvSpec:
    return next(s for s in specs().values() if s.hosts_recorded)


def recorded_in(env: str) -> EnvSpec:
    """The spec of the environment a trajectory recorded as `env` runs in (its tools, its tasks)."""
    own = specs().get(env)
    return own if own is not None and own.recorded_here else host()


__all__ = ["Argument", "EnvSpec", "Tool", "host", "recorded_in", "runtimes", "spec", "specs"]
