"""ScienceWorld (AgentGym): in-process on `scienceworld` (pipeline/synth/envs/sciworld.py), or an
AgentGym server."""
from __future__ import annotations

import re

from trajforge.pipeline.envs.agentgym import ServerProfile, in_process, needs
from trajforge.pipeline.envs.grammar import (
    Breach,
    Context,
    Grammar,
    Replies,
    break_commands,
    check_commands,
    command_grammar,
    starts,
    templates,
)

INSTRUCTIONS = (
    "You are an agent for science world. Every round I will give you an observation, you have to respond an action "
    "based on the observation to finish the given task. Here are the actions you may take: [{\"action\": "
    "\"open/close OBJ\", \"description\": \"open/close a container\"}, {\"action\": \"de/activate OBJ\", "
    "\"description\": \"activate/deactivate a device\"}, {\"action\": \"connect OBJ to OBJ\", \"description\": "
    "\"connect electrical components\"}, {\"action\": \"disconnect OBJ\", \"description\": \"disconnect electrical "
    "components\"}, {\"action\": \"use OBJ [on OBJ]\", \"description\": \"use a device/item\"}, {\"action\": "
    "\"look around\", \"description\": \"describe the current room\"}, {\"action\": \"look at OBJ\", "
    "\"description\": \"describe an object in detail\"}, {\"action\": \"look in OBJ\", \"description\": "
    "\"describe a container's contents\"}, {\"action\": \"read OBJ\", \"description\": \"read a note or book\"}, "
    "{\"action\": \"move OBJ to OBJ\", \"description\": \"move an object to a container\"}, {\"action\": "
    "\"pick up OBJ\", \"description\": \"move an object to the inventory\"}, {\"action\": \"put down OBJ\", "
    "\"description\": \"drop an inventory item\"}, {\"action\": \"pour OBJ into OBJ\", \"description\": "
    "\"pour a liquid into a container\"}, {\"action\": \"dunk OBJ into OBJ\", \"description\": \"dunk a container "
    "into a liquid\"}, {\"action\": \"mix OBJ\", \"description\": \"chemically mix a container\"}, {\"action\": "
    "\"go to LOC\", \"description\": \"move to a new location\"}, {\"action\": \"eat OBJ\", \"description\": "
    "\"eat a food\"}, {\"action\": \"flush OBJ\", \"description\": \"flush a toilet\"}, {\"action\": "
    "\"focus on OBJ\", \"description\": \"signal intent on a task object\"}, {\"action\": \"wait\", "
    "\"description\": \"take no action for 10 iterations\"}, {\"action\": \"wait1\", \"description\": \"take no "
    "action for 1 iteration\"}, {\"action\": \"task\", \"description\": \"describe current task\"}, {\"action\": "
    "\"inventory\", \"description\": \"list your inventory\"}]\nYour response should use the following format:\n"
    "Thought:\nyour thoughts.\n\nAction:\nyour next action")

# ScienceWorld: the action list in the AgentGym prompt; `drop` is accepted by the env too (an
# upstream row drops an object and the env moves it), and a number answers its "Ambiguous request"
# question.
_SCI_THING = r"\S.*"
SCIWORLD = templates(
    {"obj": _SCI_THING, "loc": _SCI_THING},
    "open {obj}", "close {obj}", "activate {obj}", "deactivate {obj}", "connect {obj} to {obj}",
    "disconnect {obj}", "use {obj}", "use {obj} on {obj}", "look around", "look at {obj}", "look in {obj}",
    "read {obj}", "move {obj} to {obj}", "pick up {obj}", "put down {obj}", "drop {obj}",
    "pour {obj} into {obj}", "dunk {obj} into {obj}", "mix {obj}", "go to {loc}", "eat {obj}", "flush {obj}",
    "focus on {obj}", "wait", "wait1", "task", "inventory")
# ScienceWorld's parser: `No known action matches that input.`; a done thing: `The door is already open.`
SCIWORLD_REPLIES = Replies({"sciworld.no_known_action": starts(r"No known action matches that input",
                                                                r"Unknown action\.")},
                           no_op=starts(r"The .+ is already (?:open|closed|activated|deactivated)\."))


def _sciworld_check(action: str, context: Context) -> Breach | None:
    if action.strip().isdigit() and "Ambiguous" in context.observation:
        return None
    return check_commands("sciworld", SCIWORLD, action)


SPECS = [in_process(
    "sciworld", "trajforge.pipeline.synth.envs.sciworld:SciWorldEnv", INSTRUCTIONS,
    Grammar("sciworld", "the AgentGym SciWorld prompt's action list, plus the env's `drop` and numbered choices",
            command_grammar("sciworld", "", SCIWORLD).rules, _sciworld_check,
            lambda action, context: break_commands("sciworld", SCIWORLD, action), replies=SCIWORLD_REPLIES),
    server=ServerProfile(reward_key="score"), task_pattern=re.compile(r"^(Your task is to.+?)(?:\n|$)", re.S),
    unavailable=needs("scienceworld", java=True), moves=("look around", "inventory", "wait1"))]
