"""KG (AgentBench knowledge graph, AgentInstruct): recorded trajectories only.
"""
from __future__ import annotations

import re

from trajforge.pipeline.envs import EnvSpec
from trajforge.pipeline.envs.grammar import INVENTED_VERBS, Breach, Context, Grammar, Replies

# --- KG (AgentBench knowledge graph) --------------------------------------------------------------
# The functions and their argument counts, as the AgentBench KG prompt defines them.
KG_FUNCTIONS = {"get_relations": 1, "get_neighbors": 2, "intersection": 2, "get_attributes": 1,
                "argmax": 2, "argmin": 2, "count": 1}
_KG_CALL = re.compile(r"(?P<name>\w+)\((?P<args>.*)\)", re.S)
_KG_FINAL = re.compile(r"Final Answer:\s*(?P<var>#\d+)\s*")
_KG_VAR = re.compile(r"#\d+")
# AgentBench KG: `get_relations(x) cannot be executed. You may make a mistake and need to fix it.`
KG_REPLIES = Replies({"kg.cannot_execute": re.compile(r"\) cannot be executed\.")})


def _kg_args(name: str, args: str) -> list[str]:
    # Entities may hold commas (`Washington, D.C.`); a relation or attribute, the second
    # argument, never does, so split at the last comma only.
    if KG_FUNCTIONS.get(name) == 2:
        return [a.strip() for a in args.rsplit(",", 1)]
    return [args.strip()]


def _kg_check(action: str, context: Context) -> Breach | None:
    text = action.strip()
    if text.startswith("Final Answer:"):
        m = _KG_FINAL.fullmatch(text)
        if not m:
            return Breach("kg.final_answer", f"{text[:120]!r} is not `Final Answer: #<id>`")
        variables = [m["var"]]
    else:
        m = _KG_CALL.fullmatch(text)
        if not m or m["name"] not in KG_FUNCTIONS:
            return Breach("kg.function", f"{text[:120]!r} calls none of {', '.join(KG_FUNCTIONS)}")
        args = _kg_args(m["name"], m["args"])
        if len(args) != KG_FUNCTIONS[m["name"]] or not all(args) or (
                m["name"] == "intersection" and not all(_KG_VAR.fullmatch(a) for a in args)):
            return Breach("kg.arguments", f"{text[:120]!r}: {m['name']} takes {KG_FUNCTIONS[m['name']]} "
                                          "argument(s)" + (", both variables" if m["name"] == "intersection" else ""))
        variables = [a for a in args if _KG_VAR.fullmatch(a)]
    for var in variables:
        # A variable exists once an observation has named it (`Variable #0, which are ...`).
        if not re.search(rf"{var}(?!\d)", context.prompt):
            return Breach("kg.variable", f"{var} is used before any observation defined it")
    return None


def _kg_breaks(action: str, context: Context) -> dict[str, str]:
    text = action.strip()
    if text.startswith("Final Answer:"):
        return {"kg.final_answer": text.replace("#", "variable ", 1), "kg.variable": "Final Answer: #99"}
    m = _KG_CALL.fullmatch(text)
    if not m:
        return {}
    out = {"kg.function": f"{INVENTED_VERBS[0]}({m['args']})",
           "kg.arguments": f"{m['name']}({m['args']}, extra)" if KG_FUNCTIONS.get(m["name"]) == 2
           else f"{m['name']}()"}
    if m["name"] == "get_relations":
        out["kg.variable"] = "get_relations(#99)"
    return out


SPECS = [EnvSpec(
    "kg",
    grammar=Grammar("kg", "AgentBench KG prompt: get_relations, get_neighbors, intersection, get_attributes, argmax, "
                    "argmin, count, and `Final Answer: #id`",
                    {"kg.function": "one of the seven functions, called as name(args)",
                     "kg.arguments": "the function's number of arguments (intersection: two variables)",
                     "kg.variable": "a #id variable an earlier observation defined",
                     "kg.final_answer": "`Final Answer: #<id>`"},
                    _kg_check, _kg_breaks, lambda a: a.strip().startswith("Final Answer:"), "with `Final Answer: #id`",
                    replies=KG_REPLIES),
    task_start=re.compile(r"^(?:A new question:\s*|Question:\s*)"),
    task_pattern=re.compile(r"^(?:A new question:\s*|Question:\s*)?(.+)$", re.S))]
