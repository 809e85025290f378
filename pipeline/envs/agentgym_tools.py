"""AgentGym's tool envs (agentenv-tool: movie, todo, weather, academia, sheet): recorded trajectories;
run by an AgentGym server. One grammar for all five: the tools each prompt lists.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.grammar import Replies, starts, tool_grammar

# agentenv-tool: a turn it cannot parse gets `Format error, please response in the format of ...`, a
# call that raises `ERROR | <exception>`.
AGENTGYM_TOOL_REPLIES = Replies({"tool.format_error": starts(r"Format error, please response in the format"),
                                 "tool.error": starts(r"ERROR \| ")})


def _finish(action: str) -> bool:
    return action.strip().startswith("finish with Action Input:")


_SOURCE = ("AgentGym tool envs (agentenv-tool): `Action: <name> with Action Input: {...}`, the "
           "tools the prompt lists as `Name: f(params)`, ending with `finish`")
# The goal the tool envs' first observation states.
_GOAL = re.compile(r"goal:\s*(.+?)(?:\nGive me one action\.|$)", re.S)


def _spec(name: str, task_pattern: re.Pattern | None) -> EnvSpec:
    return EnvSpec(name, grammar=tool_grammar(name, _SOURCE, _finish, "with `finish with Action Input: {...}`",
                                              AGENTGYM_TOOL_REPLIES), task_pattern=task_pattern)


SPECS = [_spec("movie", _GOAL), _spec("todo", _GOAL), _spec("weather", _GOAL), _spec("academia", None),
         _spec("sheet", None)]
