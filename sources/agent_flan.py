"""internlm/Agent-FLAN: seven jsonl files, rows {conversation[{role, content, loss}], id}.

`agent_instruct_*` files are rewrites of AgentInstruct (their domain comes from the row id, or
from the task text when the id does not say); `toolbench_*` files are ToolBench tool use, and
`toolbench_negative.jsonl` holds Agent-FLAN's own negatives, which keep that label.
"""
from __future__ import annotations

from pathlib import Path

from trajforge.sources.agentinstruct import SPLITS, env_from_prompt
from trajforge.sources.base import KeepRank, Source, file_stem, row_ids

FILES = (
    "agent_instruct_react", "agent_instruct_tflan", "toolbench_instruct_j1s1_3k", "toolbench_negative",
    "toolbench_react_10p", "toolbench_tflan_60p_r10r5u7", "toolbench_tflan_cot_30p",
)

class AgentFlan(Source):
    name = "agent_flan"
    hub_repo = "internlm/Agent-FLAN"
    license = "apache-2.0"
    hub_patterns = ("data/*.jsonl",)
    keep_rank = KeepRank.ORIGINAL
    negative_files = {"toolbench_negative": "tool_irrelevance"}

    def split_of(self, path: Path) -> str:
        return file_stem(path)

    def record_id(self, split, source_id):
        # Agent-FLAN numbers rows per file, so the file is part of the id.
        return f"{self.name}/{split}/{source_id}"

    def domain_env(self, split, source_id, prompt=""):
        if split.startswith("toolbench") or source_id.startswith("toolbench"):
            return ("tool", "toolbench")
        if split.startswith("agent_instruct") or split in SPLITS:
            return SPLITS.get(source_id.split("_")[0]) or SPLITS.get(split) or env_from_prompt(prompt)
        return None

    def recognizes(self, path, rows):
        split = self.split_of(path)
        if split in FILES and row_ids(rows, "id"):
            return f"Agent-FLAN's file name `{split}`"
        return None
