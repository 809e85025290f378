"""Shared by the tests of AgentGym's environments run in-process: the AgentTraj-L rows of an env as
(first observation, [(assistant turn, observation after it)]), with AgentGym's "Instruction:\\n"
framing of TextCraft's observations taken off (the collector added it; the server does not say it);
and a scripted policy that reaches (or, stuck, misses) the goals of the AgentGym fixture tasks."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tests.support.openai_server import Reply
from tests.support.paths import RAW


def agenttraj_rows(env: str) -> list[dict]:
    return json.loads((RAW / "agenttraj_l" / f"{env}_train.json").read_text())


def episode(row: dict) -> tuple[str, list[tuple[str, str | None]]]:
    turns = [t["value"].removeprefix("Instruction:\n") for t in row["conversations"][2:]]
    replies = turns[1::2]
    observations = turns[2::2] + [None] * (len(replies) - len(turns[2::2]))
    return turns[0], list(zip(replies, observations))


# The plans that reach each goal; a step is chosen from the last observation where the way depends on it.
PLANS = {
    "go to the blue ball": lambda obs: "go to blue ball 1" if "blue ball 1" in obs else "turn right",
    "go to the red ball": lambda obs: "go to red ball 1" if "red ball 1" in obs else "turn left",
    "Goal: craft leather.": ["get 4 rabbit hide", "craft 1 leather using 4 rabbit hide"],
    "Goal: craft yellow terracotta.": ["get 8 terracotta", "get 1 dandelion", "craft 1 yellow dye using 1 dandelion",
                                       "craft 8 yellow terracotta using 8 terracotta, 1 yellow dye"],
}
# What the failing policy does instead, at its n-th action: it turns in place, or gathers and never crafts.
STUCK = {"go to the red ball": lambda n: "turn left", "Goal: craft yellow terracotta.": lambda n: f"get {n + 1} terracotta"}


@dataclass
class GoalPolicy:
    """Replies in AgentGym's format (Thought + Action) with the next step of the task's plan; with
    `stuck`, the tasks in STUCK repeat one useless action."""
    stuck: bool = False

    def __call__(self, messages: list[dict]) -> Reply:
        prompt = "\n".join(m["content"] for m in messages if m["role"] == "user")
        goal = next(g for g in PLANS if g in prompt)
        sent = [re.split(r"Action:\s*", m["content"])[-1].strip() for m in messages if m["role"] == "assistant"]
        plan = PLANS[goal]
        if self.stuck and goal in STUCK:
            action = STUCK[goal](len(sent))
        elif callable(plan):
            action = plan(messages[-1]["content"])
        else:
            # The plan's first step not sent yet (a salvaged prefix may have sent some already).
            action = next((step for step in plan if step not in sent), plan[-1])
        return Reply(f"The goal is {goal!r}; next I {action}.", f"Thought:\nI will {action}.\n\nAction:\n{action}")
