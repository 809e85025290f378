"""SQLGym (AgentGym): recorded trajectories; run by an AgentGym server.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.grammar import Breach, Context, Grammar

# --- SQLGym (AgentGym): the action is one SQL block -------------------------------------------
_SQL_BLOCK = re.compile(r"```sql\s*\n.*\S.*```\s*", re.S | re.I)


def _sqlgym_check(action: str, context: Context) -> Breach | None:
    return None if _SQL_BLOCK.fullmatch(action.strip()) else Breach(
        "sqlgym.sql_block", f"{action[:120]!r} is not one ```sql code block")


def _sqlgym_breaks(action: str, context: Context) -> dict[str, str]:
    return {"sqlgym.sql_block": re.sub(r"```(?:sql)?", "", action).strip()}


SPECS = [EnvSpec("sqlgym", grammar=Grammar("sqlgym", "AgentGym SQLGym: one ```sql block per turn",
                                          {"sqlgym.sql_block": "one ```sql code block"},
                                          _sqlgym_check, _sqlgym_breaks))]
