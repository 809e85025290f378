"""TextCraft (AgentGym): in-process over the real Minecraft recipes (pipeline/synth/envs/textcraft.py),
or an AgentGym server."""
from __future__ import annotations

from trajforge.pipeline.envs.agentgym import ServerProfile, in_process, needs
from trajforge.pipeline.envs.grammar import Replies, command_grammar, starts, templates

INSTRUCTIONS = (
    "You are given few useful crafting recipes to craft items in Minecraft. Crafting commands are of the format "
    "\"craft [target object] using [input ingredients]\".\nEvery round I will give you an observation, you have to "
    "respond an action based on the state and instruction. You can \"get\" an object (ingredients) from the "
    "inventory or the environment, look-up the game inventory by \"inventory\", or \"craft\" (target) using any of "
    "the crafting commands.\nYour output must strictly follow this format:\"Thought:\nyour thoughts.\n\nAction:\n"
    "your next action\"\n\nReminder: \n1. Always specify the quantity when using \"get\" and \"craft\" commands. - "
    "Example of get: get 1 lapis lazuli - Example1 of craft: craft 1 blue dye using 1 lapis lazuli - Example2 of "
    "craft: craft 1 golden carrot using 8 gold nugget, 1 carrot\n2. When using \"get\" command, do not specify "
    "whether the item comes from the inventory or the environment.\n3. You can use ONLY crafting commands "
    "provided, do not use your own crafting commands. However, if the crafting command uses a generic ingredient "
    "like \"planks\", you can use special types of the same ingredient e.g. \"dark oak planks\" in the command "
    "instead.\n\n")

# TextCraft: agentenv-textcraft's action regexes (`get N item`, `craft X using N a, M b`, `inventory`).
TEXTCRAFT = templates({"n_item": r"\d+ \S.*", "target": r"\S.*", "ingredients": r"\d+ [^,]+(?:, *\d+ [^,]+)*"},
                      "get {n_item}", "craft {target} using {ingredients}", "inventory")
# agentenv-textcraft's ActionFailed messages; `Crafted N x` / `Got N x` add to the inventory each time,
# so the same action met with the same words is progress there, not a loop.
TEXTCRAFT_REPLIES = Replies({"textcraft.could_not_execute": starts(r"Could not execute "),
                             "textcraft.failed": starts(r"Could not find ", r"Could not extract recipe ",
                                                         r"Wrong item format: ")},
                            progress=starts(r"Crafted \d+ ", r"Got \d+ "))

SPECS = [in_process("textcraft", "trajforge.pipeline.synth.envs.textcraft:TextCraftEnv", INSTRUCTIONS,
                    command_grammar("textcraft", "agentenv-textcraft's action regexes (environment.py)", TEXTCRAFT,
                                    replies=TEXTCRAFT_REPLIES),
                    server=ServerProfile(),
                    unavailable=needs("trajforge.pipeline.synth.envs.textcraft"),
                    moves=("inventory", "get 1 stick", "craft 1 stick using 2 planks"))]
