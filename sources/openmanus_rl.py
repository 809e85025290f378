"""CharlieDreemur/OpenManus-RL: parquet `data/train-*`, rows {id, conversations[{role, content}]}.

It re-released Agent-FLAN (ids `AgentFlan_<file>_<n>`) and AgentTraj-L (upstream `item_id` kept)
with `loss` dropped and content stripped. The env comes from the id.
"""
from __future__ import annotations

from trajforge.sources.agent_flan import FILES as FLAN_FILES
from trajforge.sources.agent_flan import AgentFlan
from trajforge.sources.agenttraj_l import env_from_item_id
from trajforge.sources.base import KeepRank, Source, row_ids


class OpenManusRL(Source):
    name = "openmanus_rl"
    hub_repo = "CharlieDreemur/OpenManus-RL"
    license = "apache-2.0"
    hub_patterns = ("data/*",)
    keep_rank = KeepRank.RE_RELEASE
    # Re-released Agent-FLAN negatives keep their label (`upstream_file` names the Agent-FLAN file).
    negative_files = AgentFlan.negative_files

    def split_of(self, path):
        return "train"

    def domain_env(self, split, source_id, prompt=""):
        if source_id.startswith("AgentFlan_"):
            flan_file = self.upstream_file(split, source_id)
            rest = source_id.removeprefix("AgentFlan_").removeprefix(flan_file).lstrip("_")
            return AgentFlan().domain_env(flan_file, rest, prompt)
        return env_from_item_id(source_id)

    def upstream_file(self, split, source_id):
        """The Agent-FLAN file a re-released row came from (its negatives keep their label)."""
        rest = source_id.removeprefix("AgentFlan_")
        return next((f for f in FLAN_FILES if rest.startswith(f)), split) if rest != source_id else split

    def recognizes(self, path, rows):
        # Its re-released AgentTraj-L rows keep their upstream ids, so only the Agent-FLAN ids tell
        # its files apart (a file of the other rows alone is not recognized).
        flan = [i for i in row_ids(rows, "id") if i.startswith("AgentFlan_")]
        return f"ids like `{flan[0]}` (its re-release of Agent-FLAN)" if flan else None
