"""The LMRL-Gym wordle (AgentGym): recorded trajectories; run by an AgentGym server.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.grammar import Breach, Context, Grammar, Replies, starts

# --- the LMRL-Gym wordle: a guess is five letters separated by spaces ---------------------------
_WORDLE = re.compile(r"[a-z]( [a-z]){4}")
# agentenv-lmrlgym answers a guess the game does not take with `invalid word`.
WORDLE_REPLIES = Replies({"wordle.invalid_word": starts(r"invalid word\s*$")})


def _wordle_check(action: str, context: Context) -> Breach | None:
    return None if _WORDLE.fullmatch(action.strip()) else Breach(
        "wordle.guess", f"{action[:60]!r} is not five lowercase letters separated by spaces")


def _wordle_breaks(action: str, context: Context) -> dict[str, str]:
    return {"wordle.guess": action.replace(" ", "")}


SPECS = [EnvSpec("wordle", grammar=Grammar(
    "wordle", "the AgentGym LMRL-Gym wordle prompt: a 5-letter guess as space-separated letters",
    {"wordle.guess": "five lowercase letters separated by spaces"}, _wordle_check, _wordle_breaks,
    replies=WORDLE_REPLIES))]
