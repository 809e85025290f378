"""Mind2Web (AgentInstruct multiple choice): recorded trajectories only.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.grammar import Breach, Context, Grammar

# --- Mind2Web (AgentInstruct multiple choice) ---------------------------------------------------
MIND2WEB_OPERATIONS = ("CLICK", "TYPE", "SELECT")
_M2W = re.compile(r"Answer:\s*(?P<choice>[A-Z])\.?(?:\s*\nAction:\s*(?P<op>\S+))?"
                  r"(?:\s*\nValue:\s*(?P<value>.*\S))?\s*", re.S)
_M2W_CHOICES = re.compile(r"^([A-Z])\. ", re.M)


def _mind2web_check(action: str, context: Context) -> Breach | None:
    m = _M2W.fullmatch(action.strip())
    if not m:
        return Breach("mind2web.syntax", f"{action[:120]!r} is not `Answer: <letter>.` [`Action: <op>` [`Value: ...`]]")
    offered = set(_M2W_CHOICES.findall(context.observation or context.prompt))
    if offered and m["choice"] not in offered:
        return Breach("mind2web.choice", f"choice {m['choice']} is not among the offered {''.join(sorted(offered))}")
    op = m["op"]
    if m["choice"] == "A" and op is None:
        return None  # `A. None of the above`: nothing to do on the page
    if op not in MIND2WEB_OPERATIONS:
        return Breach("mind2web.operation", f"operation {op!r} is not one of {', '.join(MIND2WEB_OPERATIONS)}")
    if (m["value"] is None) != (op == "CLICK"):
        return Breach("mind2web.value", f"{op} {'needs' if op != 'CLICK' else 'takes no'} `Value:`")
    return None


def _mind2web_breaks(action: str, context: Context) -> dict[str, str]:
    m = _M2W.fullmatch(action.strip())
    if not m or not m["op"]:
        return {}
    offered = set(_M2W_CHOICES.findall(context.observation or context.prompt))
    missing = next((c for c in "ZYXWV" if c not in offered), None)
    out = {"mind2web.operation": action.replace(f"Action: {m['op']}", "Action: HOVER_AND_WAIT", 1),
           "mind2web.syntax": action.replace("\nAction: ", "\nAction ", 1)}
    if missing:
        out["mind2web.choice"] = action.replace(f"Answer: {m['choice']}", f"Answer: {missing}", 1)
    if m["op"] == "CLICK":
        out["mind2web.value"] = action + "\nValue: x"
    elif m["value"] is not None:
        out["mind2web.value"] = action[:m.start("value")].rstrip().removesuffix("Value:").rstrip()
    return out


SPECS = [EnvSpec(
    "mind2web",
    grammar=Grammar("mind2web", "Mind2Web/MindAct multiple choice as AgentInstruct asks it: a choice letter the "
                    "prompt offers, an operation (CLICK, TYPE, SELECT), a Value for TYPE/SELECT",
                    {"mind2web.syntax": "`Answer: <letter>.` then `Action: <op>` and `Value:` lines",
                     "mind2web.choice": "the letter is one of the offered choices",
                     "mind2web.operation": "the operation is CLICK, TYPE or SELECT (none only for A, None of the above)",
                     "mind2web.value": "TYPE and SELECT carry a Value, CLICK does not"},
                    _mind2web_check, _mind2web_breaks),
    task_pattern=re.compile(r"Task:\s*(.+?)\n", re.S))]
