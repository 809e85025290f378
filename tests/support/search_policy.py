"""A scripted agent that errs at a set rate, for the tree-search tests and bench (the truth is known).

`NoisyPolicy` follows a task's reference solution (DBBench fixture tasks: `FixturePolicy`'s reference
SQL and commit; TextCraft: a plan read off the crafting commands), but at every step, with
probability `error_rate`, takes a wrong step instead (a detour query, getting an item no recipe
uses). After a wrong step it is lost: on DB it commits a wrong answer, on TextCraft it keeps getting
wrong items until the turn limit. So one rollout of an L-step task succeeds with probability
(1 - error_rate)^L, and a search that branches at the wrong step can still succeed.

Asked as the value model's judge, it rates a transcript 0 when it took a wrong step, else 9.

Its draw depends on the conversation, the request's seed (the agent sends seed + sample index, so
every proposal of a search gets its own draw) and `salt` (another trial of the same task).
`SeededServer` is the loopback server that hands the request's seed to the policy.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.openai_server import FixturePolicy, Reply, Server, fixture_policy

DETOUR_DB = "Operation\n```sql\nSELECT 'detour';\n```"
WRONG_ANSWER_DB = "Answer\nFinal Answer: [\"no idea\"]"
WRONG_ITEM = "get 1 bedrock"
LOST_THOUGHT = "I took a wrong turn somewhere"


def textcraft_plan(prompt: str) -> list[str]:
    """The get/craft commands that make the goal of a TextCraft task, ingredients first."""
    commands = re.search(r"Crafting commands:\n(.*?)\n\nGoal: craft (.*?)\.?\s*$", prompt, re.S)
    recipes: dict[str, tuple[int, list[tuple[str, int]]]] = {}
    for line in commands.group(1).splitlines():
        found = re.fullmatch(r"craft (\d+) (.+?) using (.+)", line.strip())
        inputs = [(m.group(2), int(m.group(1))) for m in (re.fullmatch(r"(\d+) (.+)", p.strip())
                                                          for p in found.group(3).split(","))]
        recipes.setdefault(found.group(2), (int(found.group(1)), inputs))
    plan: list[str] = []

    def make(item: str, count: int) -> None:
        if item not in recipes:
            plan.append(f"get {count} {item}")
            return
        makes, inputs = recipes[item]
        times = math.ceil(count / makes)
        for name, n in inputs:
            make(name, n * times)
        for _ in range(times):
            plan.append(f"craft {makes} {item} using " + ", ".join(f"{n} {name}" for name, n in inputs))
    make(commands.group(2).strip(), 1)
    return plan


@dataclass
class NoisyPolicy:
    error_rate: float
    db: FixturePolicy = field(default_factory=FixturePolicy)
    salt: int = 0
    seed: int | None = None   # the current request's (SeededServer sets it)
    calls: int = 0

    def draw(self, messages: list[dict]) -> float:
        key = json.dumps([messages, self.seed, self.salt], sort_keys=True)
        return int(hashlib.sha256(key.encode()).hexdigest()[:12], 16) / 16 ** 12

    def __call__(self, messages: list[dict]) -> Reply:
        self.calls += 1
        prompt = next((m["content"] for m in messages if m["role"] == "user"), "")
        if "rate how likely" in prompt:  # the value model's judge prompt: a judge that knows when it is lost
            return Reply("I read the steps.", "0" if LOST_THOUGHT in prompt else "9")
        textcraft = "Crafting commands:" in prompt
        lost = any(LOST_THOUGHT in m["content"] for m in messages if m["role"] == "assistant")
        wrong = lost or self.draw(messages) < self.error_rate
        if not textcraft:
            if not wrong:
                return self.db(messages)
            action = WRONG_ANSWER_DB if lost else DETOUR_DB
            return Reply("I will guess.", f"{LOST_THOUGHT}.\nAction: {action}")
        if wrong:
            return Reply("I will guess.", f"Thought:\n{LOST_THOUGHT}.\n\nAction:\n{WRONG_ITEM}")
        plan = textcraft_plan(prompt)
        done = sum(1 for m in messages if m["role"] == "assistant")
        return Reply("I follow the recipe tree.", f"Thought:\nNext on my plan.\n\nAction:\n{plan[min(done, len(plan) - 1)]}")


def noisy_policy(error_rate: float, db_files: list[Path] = (), salt: int = 0) -> NoisyPolicy:
    return NoisyPolicy(error_rate, fixture_policy(db_files=list(db_files)), salt)


class SeededServer(Server):
    """The loopback server, with each request's seed handed to the policy before it answers."""

    def completion(self, body: dict, kind: str | None = None) -> dict:
        self.policy.seed = body.get("seed")
        return super().completion(body, kind)
