"""THUDM/AgentInstruct: one parquet file per split, rows {conversations[{from, loss, value}], id}."""
from __future__ import annotations

import re

from trajforge.sources.base import KeepRank, Source, row_ids

SPLITS = {
    "os": ("os", "os"),
    "db": ("db", "db"),
    "alfworld": ("household", "alfworld"),
    "webshop": ("ecommerce", "webshop"),
    "kg": ("kg", "kg"),
    "mind2web": ("web", "mind2web"),
}


# Rewrites of AgentInstruct (Agent-FLAN) do not always keep the split in the id; the instruction
# turn of each AgentBench task family names its world unmistakably.
PROMPT_SIGNATURES = (
    ("household", "alfworld"), ("web shopping", "webshop"), ("MySQL", "db"), ("SQL", "db"),
    ("linux", "os"), ("bash", "os"), ("knowledge base", "kg"), ("HTML", "mind2web"),
)


def env_from_prompt(prompt: str) -> tuple[str, str] | None:
    lowered = prompt.lower()
    for needle, split in PROMPT_SIGNATURES:
        if needle.lower() in lowered:
            return SPLITS[split]
    return None


class AgentInstruct(Source):
    name = "agentinstruct"
    hub_repo = "THUDM/AgentInstruct"
    # THUDM/AgentTuning ships no LICENSE file; the card of the OpenManus-RL re-release says CC-BY-NC-4.0.
    license = "cc-by-nc-4.0"
    keep_rank = KeepRank.ORIGINAL

    def domain_env(self, split, source_id, prompt=""):
        # Mirrors name files freely (db-sample.parquet, db.jsonl): the split is the first word,
        # and the id prefix (db_8) says it too.
        for key in (split, source_id.split("_")[0]):
            if key in SPLITS:
                return SPLITS[key]
        return env_from_prompt(prompt)

    def recognizes(self, path, rows):
        # Upstream names each file after its split and numbers rows within it (`os-0000...parquet`:
        # `os_0`, `os_1`, ...); Agent-FLAN's rewrites of these rows keep the ids, not the file names.
        split = self.split_of(path)
        ids = row_ids(rows, "id")
        if split in SPLITS and ids and all(re.fullmatch(rf"{split}_\d+", i) for i in ids):
            return f"a file named after its split `{split}`, ids like `{ids[0]}`"
        return None
