"""Scripted policies that calibrate an evaluation: the ceiling and the floor of every env.

Both speak the `ChatBackend` protocol (pipeline/llm/client.py), so their episodes run through the
very agent loop, parser and environments a model's do, and any difference in score is the
policy's. One backend per episode: it knows its task.

- `oracle`: the task's reference solution from its task file, as its env spec reads it
  (`reference_steps`; AgentBench OS runs `evaluation.example` and answers the `match` string or
  what the reference printed, DBBench runs the reference statement or commits the `label`, AgentGym
  items take the actions of their `reference` list). A task without a reference is not run by the
  oracle (counted as `no_reference`). An env where the oracle does not score ~1.0 has a broken task
  file, scorer or environment.
- `random`: a uniformly random move from a few the env accepts (its spec's `random_moves`),
  including giving up (`finish`, an empty answer), seeded by task and sample. What an agent that
  does nothing useful scores.
"""
from __future__ import annotations

import random
from typing import Any

from trajforge.pipeline.envs import spec
from trajforge.pipeline.envs.tasks import Task
from trajforge.pipeline.llm.client import CallStats, ChatResult, Choice, LLMConfig
from trajforge.pipeline.registry import Registry


def reference_steps(task: Task) -> list | None:
    """The oracle's replies for `task`, from its env spec; None when the task has no reference."""
    make = spec(task.env).reference_steps
    return make(task) if make else None


class PolicyBackend:
    """A ChatBackend whose replies come from a script, not a server (no calls, no tokens)."""

    def __init__(self, name: str, task: Task, sample: int):
        self.model = f"policy/{name}"
        self.params: dict[str, Any] = {}
        self.config = LLMConfig(model=self.model)
        self.stats = CallStats()
        self.unreachable: str | None = None
        self.dropped: list[str] = []
        self.task, self.sample = task, sample

    def redact(self, text: str | None) -> str | None:
        return text

    def reply(self, messages: list[dict]) -> str:
        raise NotImplementedError

    async def chat(self, messages: list[dict], sample: int = 0, **overrides: Any) -> ChatResult:
        return ChatResult([Choice(self.reply(messages), None, "stop")], {}, self.model, cached=False)

    async def aclose(self) -> None:
        return None


class OraclePolicy(PolicyBackend):
    def __init__(self, task: Task, sample: int):
        super().__init__("oracle", task, sample)
        self.steps = reference_steps(task)

    def reply(self, messages: list[dict]) -> str:
        done = sum(1 for m in messages if m["role"] == "assistant")
        step = self.steps[min(done, len(self.steps) - 1)]
        return step(messages[-1]["content"]) if callable(step) else step


class RandomPolicy(PolicyBackend):
    def __init__(self, task: Task, sample: int):
        super().__init__("random", task, sample)
        self.moves = spec(task.env).random_moves
        self.rng = random.Random(f"{task.id}~{sample}")

    def reply(self, messages: list[dict]) -> str:
        return self.rng.choice(self.moves)


POLICIES: Registry[type[PolicyBackend]] = Registry("calibration policy", {"oracle": OraclePolicy,
                                                                          "random": RandomPolicy})


def can_play(policy: str, task: Task) -> str | None:
    """None when `policy` can play `task`, else why not (a reason code)."""
    if policy == "oracle" and reference_steps(task) is None:
        return "no_reference"
    if policy == "random" and not spec(task.env).random_moves:
        return "no_random_moves"
    return None
