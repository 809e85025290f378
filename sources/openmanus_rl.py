"""CharlieDreemur/OpenManus-RL: parquet `data/train-*`, rows {id, conversations[{role, content}]}.

It re-released Agent-FLAN (ids `AgentFlan_<file>_<n>`) and AgentTraj-L (upstream `item_id` kept)
with `loss` dropped and content stripped. The env comes from the id.
"""
from __future__ import annotations

from sources.agent_flan import FILES as FLAN_FILES
from sources.agent_flan import AgentFlan
from sources.agenttraj_l import env_from_item_id
from sources.base import Source


class OpenManusRL(Source):
    name = "openmanus_rl"
    hub_repo = "CharlieDreemur/OpenManus-RL"
    license = "apache-2.0"
    hub_patterns = ("data/*",)

    def split_of(self, path):
        return "train"

    def domain_env(self, split, source_id):
        if source_id.startswith("AgentFlan_"):
            rest = source_id.removeprefix("AgentFlan_")
            flan_file = next((f for f in FLAN_FILES if rest.startswith(f)), "")
            return AgentFlan().domain_env(flan_file, rest.removeprefix(flan_file).lstrip("_"))
        return env_from_item_id(source_id)

    def upstream_file(self, source_id: str) -> str | None:
        """The Agent-FLAN file a re-released row came from (its negatives keep their label)."""
        if not source_id.startswith("AgentFlan_"):
            return None
        rest = source_id.removeprefix("AgentFlan_")
        return next((f for f in FLAN_FILES if rest.startswith(f)), None)
