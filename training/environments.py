"""Our environments as TRL environments for `GRPOTrainer(environment_factory=...)`.

TRL's contract (trl 1.16, GRPOTrainer): a factory makes instances; each rollout gets one and
calls `reset(**row)` with the dataset row, whose string result is appended to the last user
message; every other public method is a tool the model calls (its name, type hints and
Google-style docstring are the tool schema); `get_reward()` is called once per finished rollout
and is the environment's own score. TRL pools the instances and resets them for later batches;
it never closes them.

So the adapters own the sandbox's lifetime: `reset` opens one sandbox (SQLite database, OS
sandbox, AgentGym server instance) for the rollout, after closing any previous one; `get_reward`
scores the episode and closes it; `EnvironmentFactory.close_all()` (the launcher calls it when
training ends, however it ends) closes whatever an interrupted rollout left open. A factory
allows at most `max_concurrent` open sandboxes: more is a clear error, not an exhausted machine.

An env's adapter is made from its spec's `tools` (pipeline/envs): one method per tool, whose call
becomes the ReAct action text the tool derives, the same map the SFT `tools` rendering uses
(pipeline/envs/tool_calls.py), so SFT and RL share one action format.
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
from typing import Any

from trajforge.pipeline.envs import Tool, runtimes, spec
from trajforge.pipeline.envs.tasks import coerce_task
from trajforge.pipeline.registry import Registry
from trajforge.pipeline.synth.envs import make_env

logger = logging.getLogger(__name__)

EPISODE_OVER = "The episode is over; no more actions are taken."


class ToolEnvironment:
    """One rollout's episode in one of our environments. Subclasses add the tools."""

    environment = ""

    def __init__(self, slots: threading.BoundedSemaphore | None = None, max_turns: int | None = None,
                 **config: Any) -> None:
        self._config = config
        self._slots = slots
        self._max_turns = max_turns
        self._env = None
        self._holds_slot = False
        self._reset_state()

    def _reset_state(self) -> None:
        self._turns = 0
        self._done = False
        self._score: float | None = None
        # What reached the environment and what it answered, in order (for logs and tests).
        self.actions: list[str] = []
        self.observations: list[str] = []

    def reset(self, **row: Any) -> str | None:
        """Open this rollout's sandbox on the row's `env_task`; return the first observation,
        unless the row's prompt already ends with it (task files fix it at build time)."""
        self._close()
        self._reset_state()
        task = row["env_task"]
        task = coerce_task(json.loads(task) if isinstance(task, str) else task)
        if task.env != self.environment:
            raise ValueError(f"task {task.id} is for environment {task.env!r}, not {self.environment!r}")
        if self._slots is not None:
            if not self._slots.acquire(blocking=False):
                raise RuntimeError(f"more than max_concurrent_envs {self.environment} sandboxes open at once; "
                                   "raise max_concurrent_envs or lower the generation batch")
            self._holds_slot = True
        try:
            self._env = make_env(self.environment, **self._config)
            observation = self._env.reset(task)
        except BaseException:
            self._close()
            raise
        prompt = row.get("prompt") or []
        if prompt and prompt[-1].get("content", "").rstrip().endswith(observation.rstrip()):
            return None
        return observation

    def _act(self, name: str, **arguments: Any) -> str:
        if self._env is None or self._done:
            return EPISODE_OVER
        if self._max_turns is not None and self._turns >= self._max_turns:
            self._done = True
            return f"No turns left (max_turns={self._max_turns}); the episode is over."
        self._turns += 1
        action = spec(self.environment).action_text(name, arguments)
        self.actions.append(action)
        result = self._env.step(action)
        if result.done:
            self._done = True
            self._score = result.info.get("score", result.reward)
        observation = result.observation or ("Episode finished." if result.done else "(no output)")
        self.observations.append(observation)
        return observation

    def get_reward(self) -> float:
        """The environment's own score of the episode (0.0 when it never finished), then the
        sandbox is closed: TRL calls this once, when the rollout is over."""
        score = self._score if self._done and self._score is not None else 0.0
        self._close()
        return float(score)

    def _close(self) -> None:
        try:
            if self._env is not None:
                self._env.close()
        finally:
            self._env = None
            if self._holds_slot:
                self._holds_slot = False
                self._slots.release()

    @property
    def _is_open(self) -> bool:
        return self._env is not None


def _tool_method(tool: Tool):
    """A method for one tool of an env spec: its name, signature (string arguments) and Google-style
    docstring are the tool schema TRL renders."""
    signature = inspect.Signature(
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
         *(inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str) for a in tool.arguments)],
        return_annotation=str)

    def method(self, *args: Any, **kwargs: Any) -> str:
        arguments = signature.bind(self, *args, **kwargs).arguments
        arguments.pop("self")
        return self._act(tool.name, **arguments)

    method.__name__ = method.__qualname__ = tool.name
    method.__doc__ = tool.docstring()
    method.__signature__ = signature
    method.__annotations__ = {**{a.name: str for a in tool.arguments}, "return": str}
    return method


def adapter(environment: str) -> type[ToolEnvironment]:
    """The TRL environment class of an env: `ToolEnvironment` with one method per tool of its spec."""
    tools = spec(environment).tools
    if not tools:
        raise ValueError(f"env {environment!r} has no tools")
    name = "".join(part.capitalize() for part in environment.split("_")) + "Environment"
    return type(name, (ToolEnvironment,), {"environment": environment, **{t.name: _tool_method(t) for t in tools}})


@functools.cache
def adapters() -> Registry[type[ToolEnvironment]]:
    """The adapter of every env that runs and has tools, by name."""
    return Registry("environment", {name: adapter(name) for name, env in runtimes().items() if env.tools})


def tool_schemas(environment: str) -> list[dict]:
    """The JSON schemas of an environment's tools, as TRL renders them into the prompt (from the
    adapter's methods: name, type hints, docstring), for SFT examples in the same format."""
    from transformers.utils import get_json_schema

    instance = adapters()[environment]()
    return [get_json_schema(getattr(instance, name)) for name in sorted(t.name for t in spec(environment).tools)]


class EnvironmentFactory:
    """TRL's `environment_factory` for one environment: makes adapters that share a bound on open
    sandboxes, and remembers them so that `close_all` can close every one."""

    def __init__(self, environment: str, max_concurrent: int | None = None, max_turns: int | None = None,
                 **config: Any) -> None:
        adapters().check([environment])
        self.environment = environment
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None
        self._max_turns = max_turns
        self._config = config
        self.instances: list[ToolEnvironment] = []

    def __call__(self) -> ToolEnvironment:
        instance = adapters()[self.environment](self._slots, self._max_turns, **self._config)
        self.instances.append(instance)
        return instance

    def open_count(self) -> int:
        return sum(instance._is_open for instance in self.instances)

    def close_all(self) -> None:
        for instance in self.instances:
            try:
                instance._close()
            except Exception:  # one failed close must not leave the others open
                logger.exception("closing a %s environment failed", self.environment)


def make_factories(environments: list[str], settings: dict[str, dict] | None = None,
                   max_concurrent: int | None = None, max_turns: int | None = None) -> dict[str, EnvironmentFactory]:
    """One factory per environment name (TRL routes each row by its `environment` column);
    `settings` holds each environment's constructor settings (timeouts, AgentGym `base_url`)."""
    settings = settings or {}
    unknown = set(settings) - set(environments)
    if unknown:
        raise ValueError(f"env_settings for environments not in `environments`: {sorted(unknown)}")
    return {name: EnvironmentFactory(name, max_concurrent=max_concurrent, max_turns=max_turns,
                                     **settings.get(name, {}))
            for name in environments}
