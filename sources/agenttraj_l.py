"""AgentGym/AgentTraj-L: one JSON array per env (<env>_train.json), rows {conversations[...], item_id}."""
from __future__ import annotations

import re
from pathlib import Path

from trajforge.sources.base import KeepRank, Source, file_stem, row_ids

ENVS = {
    "alfworld": ("household", "alfworld"),
    "babyai": ("game", "babyai"),
    "lmrlgym_maze": ("game", "maze"),
    "lmrlgym_wordle": ("game", "wordle"),
    "maze": ("game", "maze"),
    "wordle": ("game", "wordle"),
    "sciworld": ("science", "sciworld"),
    "sqlgym": ("db", "sqlgym"),
    "textcraft": ("game", "textcraft"),
    "tool_movie": ("tool", "movie"),
    "tool_todo": ("tool", "todo"),
    "tool_weather": ("tool", "weather"),
    "movie": ("tool", "movie"),
    "todo": ("tool", "todo"),
    "weather": ("tool", "weather"),
    "webshop": ("ecommerce", "webshop"),
}

# ALFWorld item ids are game names, not alfworld_N.
ALFWORLD_GAME = re.compile(r"^(pick_|look_at_|pick_and_place|pick_clean|pick_heat|pick_cool|pick_two)")


def env_from_item_id(item_id: str) -> tuple[str, str] | None:
    if ALFWORLD_GAME.match(item_id):
        return ENVS["alfworld"]
    prefix = item_id.rsplit("_", 1)[0]
    return ENVS.get(prefix)


class AgentTrajL(Source):
    name = "agenttraj_l"
    hub_repo = "AgentGym/AgentTraj-L"
    # No license on the HF page; the AgentGym code repository is MIT.
    license = "unknown (AgentGym code: mit)"
    hub_patterns = ("*.json", "data/*")
    keep_rank = KeepRank.ORIGINAL

    def split_of(self, path: Path) -> str:
        return file_stem(path).removesuffix("_train").split("-")[0]

    def domain_env(self, split, source_id, prompt=""):
        return ENVS.get(split) or env_from_item_id(source_id)

    def recognizes(self, path, rows):
        stem = file_stem(path)
        ids = row_ids(rows, "item_id")
        if stem.endswith("_train") and stem.removesuffix("_train") in ENVS and ids:
            return f"a file named `{stem}`, rows keyed `item_id` (`{ids[0]}`)"
        return None
