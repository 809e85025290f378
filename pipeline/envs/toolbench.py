"""ToolBench / Agent-FLAN function calls: recorded trajectories only.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.grammar import Replies, tool_call, tool_grammar

# ToolBench's API replies carry a non-empty `error` field.
TOOLBENCH_REPLIES = Replies({"tool.api_error": re.compile(r"""^\s*\{\s*["']error["']\s*:\s*["'](?!["'])""")})


def _finish(action: str) -> bool:
    name = tool_call(action, None)[0] or action.strip().split("\n", 1)[0].strip()
    return name == "Finish"


SPECS = [EnvSpec("toolbench", grammar=tool_grammar(
    "toolbench", "ToolBench / Agent-FLAN: the functions the prompt lists (and `Finish`), arguments "
    "that parse; a single-call instruction row may end on its call", _finish,
    "with `Finish` or a final reply in prose", TOOLBENCH_REPLIES, tool_replies=True))]
