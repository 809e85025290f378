"""WebShop (AgentInstruct, AgentGym): recorded trajectories; run by an AgentGym server.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.agentgym import ServerProfile
from trajforge.pipeline.envs.grammar import INVENTED_VERBS, Breach, Context, command_grammar, templates

# --- WebShop ----------------------------------------------------------------------------------
WEBSHOP = templates({"keywords": r"[^\[\]\n]*\S[^\[\]\n]*", "value": r"[^\[\]\n]*\S[^\[\]\n]*"},
                    "search[{keywords}]", "click[{value}]")
# WebShop has no refusal text: an action it cannot perform changes nothing and the same page comes
# back (web_agent_text_env.step), which validation reads as the state unchanged.


def _webshop_clickable(action: str, context: Context) -> Breach | None:
    """WebShop: `the value in click must be a value in the list of available actions`; the page
    shows them as `[SEP]`-separated items."""
    if not action.startswith("click[") or "[SEP]" not in context.observation:
        return None
    value = action[len("click["):-1].strip().lower()
    items = {part.strip().lower() for part in context.observation.split("[SEP]")}
    if value not in items:
        return Breach("webshop.click_target", f"{action[:120]!r}: no such button or link on the page")
    return None


def _webshop_breaks(action: str, context: Context) -> dict[str, str]:
    if not action.startswith("click[") or "[SEP]" not in context.observation:
        return {}
    return {"webshop.click_target": f"click[{INVENTED_VERBS[0]} button]"}


SPECS = [EnvSpec(
    "webshop",
    grammar=command_grammar("webshop", "AgentBench/AgentGym WebShop prompt: `search[keywords]`, `click[value]`, the "
                            "value one of the page's clickables", WEBSHOP, extra=_webshop_clickable,
                            extra_breaks=_webshop_breaks,
                            extra_rules={"webshop.click_target": "a clicked value is a `[SEP]` item of the page"}),
    task_pattern=re.compile(r"Instruction:\s*\[SEP\]\s*(.+?)\s*\[SEP\]", re.S),
    server=ServerProfile(id_key="env_idx", reset_args=lambda idx: {"session_id": idx}, observation_key="state",
                         observe_after_reset=True))]
