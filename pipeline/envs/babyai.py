"""BabyAI (AgentGym): in-process on minigrid (pipeline/synth/envs/babyai.py), or an AgentGym server."""
from __future__ import annotations

from trajforge.pipeline.envs.agentgym import ServerProfile, in_process, needs
from trajforge.pipeline.envs.grammar import Replies, command_grammar, starts, templates

# The agent's instructions, as AgentGym's BabyAI client words them.
INSTRUCTIONS = (
    "You are an exploration master that wants to finish every goal you are given. Every round I will give you an "
    "observation, and you have to respond an action and your thought based on the observation to finish the given "
    "task. You are placed in a room and you need to accomplish the given goal with actions.\n\nYou can use the "
    "following actions: \n\n- turn right \n\n- turn left \n\n- move forward \n\n- go to <obj> <id> \n\n"
    "- pick up <obj> <id> \n\n- go through <door> <id>: <door> must be an open door. \n\n- toggle and go through "
    "<door> <id>: <door> can be a closed door or a locked door. If you want to open a locked door, you need to "
    "carry a key that is of the same color as the locked door. \n\n- toggle: there is a closed or locked door right "
    "in front of you and you can toggle it.\nYour response should use the following format:\nThought:\n"
    "<Your Thought>\n\nAction:\n<Your Action>")

# BabyAI: the action space agentenv-babyai builds from the room (`turn left`, `pickup grey key 1`,
# `toggle and go through red locked door 1`, ...), plus its `check available actions`.
_COLOR = "red|green|blue|purple|yellow|grey"
BABYAI = templates(
    {"obj": rf"(?:{_COLOR}) (?:ball|box|key) \d+", "door": rf"(?:{_COLOR}) (?:open|closed|locked) door \d+",
     "opendoor": rf"(?:{_COLOR}) open door \d+", "shutdoor": rf"(?:{_COLOR}) (?:closed|locked) door \d+"},
    "turn left", "turn right", "move forward", "drop", "toggle", "go to goal", "check available actions",
    "go to {obj}", "go to {door}", "pickup {obj}", "go through {opendoor}", "toggle and go through {shutdoor}")
# agentenv-babyai (check_action_is_valid, postprocess_obs): an action outside the room's action space
# is `not recognized`, one the room rules out is `You cannot ...` / `... you can't move forward.`;
# an action with nothing to do answers `No change in state.`
BABYAI_REPLIES = Replies({"babyai.not_recognized": starts(r"The action is not recognized"),
                          "babyai.cannot": starts(r"You cannot ", r"There is a barrier in front of you")},
                         no_op=starts(r"No change in state\."))

SPECS = [in_process("babyai", "trajforge.pipeline.synth.envs.babyai:BabyAIEnv", INSTRUCTIONS,
                    command_grammar("babyai", "agentenv-babyai's action space (environment.py postprocess_obs)", BABYAI,
                                    replies=BABYAI_REPLIES),
                    server=ServerProfile(reward_key="score"),
                    unavailable=needs("minigrid"), moves=("turn left", "turn right", "move forward"),
                    eval_split={"name": "agentgym-babyai-heldout",
                                "files": ("agentgym/babyai_heldout.jsonl",), "held_out_by": "item",
                                "about": "BabyAI levels at seed 5000 (items 200000+), beyond AgentTraj-L's items"})]
