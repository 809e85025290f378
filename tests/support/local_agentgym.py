"""Shared by the tests of AgentGym's environments run in-process: the AgentTraj-L rows of an env as
(first observation, [(assistant turn, observation after it)]), with AgentGym's "Instruction:\\n"
framing of TextCraft's observations taken off (the collector added it; the server does not say it)."""
from __future__ import annotations

import json

from tests.conftest import RAW


def agenttraj_rows(env: str) -> list[dict]:
    return json.loads((RAW / "agenttraj_l" / f"{env}_train.json").read_text())


def episode(row: dict) -> tuple[str, list[tuple[str, str | None]]]:
    turns = [t["value"].removeprefix("Instruction:\n") for t in row["conversations"][2:]]
    replies = turns[1::2]
    observations = turns[2::2] + [None] * (len(replies) - len(turns[2::2]))
    return turns[0], list(zip(replies, observations))
