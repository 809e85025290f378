"""Scripted policies that calibrate an evaluation: the ceiling and the floor of every env.

Both speak the `ChatBackend` protocol (pipeline/synth/llm.py), so their episodes run through the
very agent loop, parser and environments a model's do, and any difference in score is the
policy's. One backend per episode: it knows its task.

- `oracle`: the task's reference solution from its task file. AgentBench OS: run
  `evaluation.example` (or the top-level `example`) in the shell, then answer the expected `match`
  string, or, for a check task, the last line the reference printed (`finish` when it printed
  nothing). DBBench: run the reference statement of an INSERT/UPDATE/DELETE task and commit;
  commit the `label` of a question. AgentGym items: the actions of the task's `reference` list.
  A task without a reference is not run by the oracle (counted as `no_reference`). An env where
  the oracle does not score ~1.0 has a broken task file, scorer or environment.
- `random`: a uniformly random move from a few the env accepts, including giving up (`finish`, an
  empty answer), seeded by task and sample. What an agent that does nothing useful scores.
"""
from __future__ import annotations

import json
import random
import re
from typing import Any

from trajforge.pipeline.registry import Registry
from trajforge.pipeline.synth.llm import CallStats, ChatResult, Choice, LLMConfig
from trajforge.pipeline.synth.tasks import Task

AGENTGYM_FORMAT = "Thought:\n{thought}\n\nAction:\n{action}"
_OS_OUTPUT = re.compile(r"^The output of the OS:\s*", re.S)


def _bash(code: str, language: str = "bash") -> str:
    if language == "python":
        code = f"python3 - <<'TRAJFORGE_EOF'\n{code}\nTRAJFORGE_EOF"
    return f"Think: I run the reference solution.\n\nAct: bash\n\n```bash\n{code}\n```"


def _last_line(observation: str) -> str | None:
    text = _OS_OUTPUT.sub("", observation.strip())
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("[truncated")]
    return lines[-1].strip() if lines else None


def os_reference(task: Task) -> list | None:
    """Steps (text, or a function of the last observation -> text) of an OS task's reference solution."""
    ev = task.data.get("evaluation") or {}
    example = ev.get("example") or task.data.get("example")
    match = ev.get("match")
    expected = match if isinstance(match, str) else match.get("answer") if isinstance(match, dict) else None
    if example is None and expected is None:
        return None
    steps: list = [_bash(example["code"], example["language"])] if example else []
    if expected is not None:
        steps.append(f"Think: The reference answer.\n\nAct: answer({expected})")
    else:
        steps.append(lambda obs: (f"Think: The reference printed it.\n\nAct: answer({line})"
                                  if (line := _last_line(obs)) else "Think: Done.\n\nAct: finish"))
    return steps


def db_reference(task: Task) -> list | None:
    label = task.data.get("label") or []
    if task.data.get("kind") == "modify":
        if not label or not isinstance(label[0], str):
            return None
        return [f"I apply the reference statement.\nAction: Operation\n```sql\n{label[0]}\n```",
                "The table is changed.\nAction: Answer\nFinal Answer: []"]
    return [f"The reference answer.\nAction: Answer\nFinal Answer: {json.dumps([str(v) for v in label], ensure_ascii=False)}"]


def agentgym_reference(task: Task) -> list | None:
    actions = task.data.get("reference")
    if not isinstance(actions, list) or not actions:
        return None
    return [AGENTGYM_FORMAT.format(thought="The reference solution's next step.", action=a) for a in actions]


REFERENCES: Registry = Registry("env with reference solutions", {"os": os_reference, "db": db_reference})


def reference_steps(task: Task) -> list | None:
    make = REFERENCES[task.env] if task.env in REFERENCES else agentgym_reference
    return make(task)


# A few moves each env accepts; `random` draws one per turn.
RANDOM_MOVES: Registry[tuple[str, ...]] = Registry("env with random moves", {
    "os": ("Think: I give up.\n\nAct: finish", "Think: Look around.\n\nAct: bash\n\n```bash\nls\n```"),
    "db": ("I give up.\nAction: Answer\nFinal Answer: []",
           "I look at the tables.\nAction: Operation\n```sql\nSELECT name FROM sqlite_master;\n```"),
    "babyai": tuple(AGENTGYM_FORMAT.format(thought="A random move.", action=a)
                    for a in ("turn left", "turn right", "move forward")),
    "textcraft": tuple(AGENTGYM_FORMAT.format(thought="A random move.", action=a)
                       for a in ("inventory", "get 1 stick", "craft 1 stick using 2 planks")),
    "sciworld": tuple(AGENTGYM_FORMAT.format(thought="A random move.", action=a)
                      for a in ("look around", "inventory", "wait1")),
})


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
        self.moves = RANDOM_MOVES[task.env]
        self.rng = random.Random(f"{task.id}~{sample}")

    def reply(self, messages: list[dict]) -> str:
        return self.rng.choice(self.moves)


POLICIES: Registry[type[PolicyBackend]] = Registry("calibration policy", {"oracle": OraclePolicy,
                                                                          "random": RandomPolicy})


def can_play(policy: str, task: Task) -> str | None:
    """None when `policy` can play `task`, else why not (a reason code)."""
    if policy == "oracle" and reference_steps(task) is None:
        return "no_reference"
    if policy == "random" and task.env not in RANDOM_MOVES:
        return "no_random_moves"
    return None
