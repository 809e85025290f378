"""THUDM/AgentInstruct: one parquet file per split, rows {conversations[{from, loss, value}], id}."""
from __future__ import annotations

from sources.base import Source

SPLITS = {
    "os": ("os", "os"),
    "db": ("db", "db"),
    "alfworld": ("household", "alfworld"),
    "webshop": ("ecommerce", "webshop"),
    "kg": ("kg", "kg"),
    "mind2web": ("web", "mind2web"),
}


class AgentInstruct(Source):
    name = "agentinstruct"
    hub_repo = "THUDM/AgentInstruct"
    # THUDM/AgentTuning ships no LICENSE file; the card of the OpenManus-RL re-release says CC-BY-NC-4.0.
    license = "cc-by-nc-4.0"

    def domain_env(self, split, source_id):
        # Mirrors name files freely (db-sample.parquet, db.jsonl): the split is the first word,
        # and the id prefix (db_8) says it too.
        for key in (split, source_id.split("_")[0]):
            if key in SPLITS:
                return SPLITS[key]
        return None
