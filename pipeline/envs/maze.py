"""The LMRL-Gym maze (AgentGym): recorded trajectories; run by an AgentGym server.
"""
from __future__ import annotations

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.grammar import command_grammar, templates

# The maze has no refusal text: a move into a wall leaves the position the reply states unchanged.
MAZE = templates({}, "move up", "move down", "move left", "move right")


SPECS = [EnvSpec("maze", grammar=command_grammar("maze", "the AgentGym LMRL-Gym maze prompt: move up/down/left/right",
                                                MAZE))]
