"""ALFWorld (AgentInstruct, AgentGym): recorded trajectories; run by an AgentGym server.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.agentgym import ServerProfile
from trajforge.pipeline.envs.grammar import Breach, Context, Replies, command_grammar, starts, templates

# --- ALFWorld ---------------------------------------------------------------------------------
# Objects and receptacles are a lowercase name and an instance number (`spraybottle 1`).
_ALF_THING = r"[a-z]+ \d+"
ALFWORLD = templates(
    {"obj": _ALF_THING, "recep": _ALF_THING},
    "go to {recep}", "open {recep}", "close {recep}", "take {obj} from {recep}", "put {obj} in/on {recep}",
    "toggle {obj}", "use {obj}", "clean {obj} with {recep}", "heat {obj} with {recep}",
    "cool {obj} with {recep}", "examine {obj}", "look", "inventory")
_AVAILABLE = re.compile(r"AVAILABLE ACTIONS:\s*(.+)\s*$", re.S)
# TextWorld answers a command it cannot carry out (unknown, or impossible here) with `Nothing happens.`
ALFWORLD_REPLIES = Replies({"alfworld.nothing_happens": starts(r"Nothing happens\.")})


def _alfworld_available(action: str, context: Context) -> Breach | None:
    """AgentGym's ALFWorld lists the admissible commands after each observation; the AgentInstruct
    prompt says an action outside the given list is illegal."""
    m = _AVAILABLE.search(context.observation)
    if not m:
        return None
    available = {a.strip() for a in m.group(1).split(",")}
    if action not in available:
        return Breach("alfworld.available", f"{action[:120]!r} is not among the {len(available)} AVAILABLE ACTIONS")
    return None


def _alfworld_breaks(action: str, context: Context) -> dict[str, str]:
    if not _AVAILABLE.search(context.observation) or not re.fullmatch(rf"go to {_ALF_THING}", action):
        return {}
    return {"alfworld.available": re.sub(r"\d+$", "99", action)}


SPECS = [EnvSpec(
    "alfworld",
    grammar=command_grammar("alfworld", "ALFWorld admissible commands (TextWorld ALFRED grammar) as AgentInstruct/"
                            "AgentGym prompts use them; AgentGym's AVAILABLE ACTIONS list", ALFWORLD,
                            extra=_alfworld_available, extra_breaks=_alfworld_breaks,
                            extra_rules={"alfworld.available":
                                         "when the observation lists AVAILABLE ACTIONS, the action is one of them"},
                            replies=ALFWORLD_REPLIES),
    task_pattern=re.compile(r"Your task is to:\s*(.+?)(?:\nAVAILABLE ACTIONS|$)", re.S),
    server=ServerProfile(reset_args=lambda idx: {"game": idx, "world_type": "Text"}))]
