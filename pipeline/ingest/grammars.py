"""The action grammar and the episode-end rule of every environment, registered by env name.

A grammar says which actions an env accepts, in the env's own syntax (the action text a dialect
parses out of a turn, pipeline/ingest/dialects.py), and how an episode of it ends:

- `check(action, context)` returns the first rule the action breaks, as a `Breach` (rule name and
  what is wrong), or None. Rules are named `<grammar>.<rule>` (`alfworld.command`, `kg.arguments`,
  `tool.unknown_tool`, ...) so the quarantine and the report can count them.
- `terminal(action)` says whether an action ends the episode, for envs that have an explicit
  terminal action (DB `Answer`, OS `answer(...)`/`finish`, KG `Final Answer`, tool `finish`);
  None for envs that end on their own (ALFWorld, WebShop, the games).
- `breaks(action, context)` edits a valid action so that it breaks one named rule each: what the
  `invalid_action` negatives are made from, so a negative is wrong for a stated reason.
- `replies` says how the env answers an action (`Replies`): the words it uses when it did not carry
  an action out (`refused`, by name: TextCraft `Could not execute ...`, BabyAI `The action is not
  recognized...`, DBBench's MySQL errors, ...), when it did and nothing changed (`no_op`), and which
  replies report progress even when they repeat word for word (TextCraft `Crafted ...`). Validation
  grounds its verdicts in them (pipeline/ingest/validate.py): what the env refused is not trained on,
  a repeat the env reports as progress is no loop.

Where the rules come from (each grammar's `source`): the environments' own code and prompts.
AgentBench's task prompts (OS, DBBench, KG, WebShop, ALFWorld as AgentInstruct carries them), the
AgentGym environment servers (BabyAI's action space, TextCraft's action regexes, the tool envs'
`Name: f(params)` lists, SciWorld's action list in its prompt), Mind2Web's operation set, and the
ToolBench / Agent-FLAN function lists each prompt offers. WebArena has no grammar: no trajectory
of it is ingested and its action set (playwright-style `click [id]`, `type [id] [text]`, ...) was
not checked against a prompt of ours; its records are counted as unchecked.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from trajforge.pipeline.ingest.dialects import parse_answer_list, parse_literal
from trajforge.pipeline.synth.envs.os_sandbox import parse_os_action
from trajforge.pipeline.registry import Registry

# Verbs no env offers; the first one that is not a verb of the env replaces a real verb.
INVENTED_VERBS = ("teleport", "levitate", "summon", "conjure")


@dataclass(frozen=True)
class Context:
    """What an action is checked against: the turns the agent saw before it."""
    prompt: str              # every system/user turn before the action, joined
    observation: str         # the user turn right before the action ("" if none)
    dialect: str | None = None  # how the turn wrote the action (tool calls have several forms)


@dataclass(frozen=True)
class Breach:
    rule: str
    detail: str


# Where an env's wrapper puts its own words before the reply (AgentGym tool envs `Observation: `,
# TextCraft `Instruction:\n`); the reply patterns below read what follows.
_LEAD = r"^(?:(?:Observation|Instruction)\s*:\s*)?"


def _starts(*texts: str) -> re.Pattern:
    """A reply that starts (after the wrapper's lead) with one of `texts`, each a regex."""
    return re.compile(_LEAD + "(?:" + "|".join(texts) + ")")


@dataclass(frozen=True)
class Replies:
    """How an env answers an action, in its own words (its code, or its real rows where the code is
    out of reach): `refused` by name, the replies of an action it did not carry out; `no_op`, carried
    out and nothing changed; `progress`, a reply that reports a change even when it repeats word for
    word. A reply none of them matches is a normal answer, and a reply equal to the observation
    before the action shows a state the action did not change."""
    refused: dict[str, re.Pattern] = field(default_factory=dict)
    no_op: re.Pattern | None = None
    progress: re.Pattern | None = None

    def refusal(self, reply: str) -> str | None:
        """The name of the refusal `reply` is, or None."""
        return next((name for name, pattern in self.refused.items() if pattern.search(reply)), None)

    def stuck(self, reply: str, before: str) -> bool:
        """`reply` shows the action got nowhere: refused, a no-op, or the state unchanged (and it does
        not report progress)."""
        if self.progress is not None and self.progress.search(reply):
            return False
        return (reply == before or self.refusal(reply) is not None
                or (self.no_op is not None and self.no_op.search(reply) is not None))


@dataclass(frozen=True)
class Grammar:
    name: str
    source: str
    rules: dict[str, str]                                        # rule -> what it requires
    check: Callable[[str, Context], Breach | None]
    breaks: Callable[[str, Context], dict[str, str]]
    terminal: Callable[[str], bool] | None = None
    ends: str = "on its own (the final trained turn must be a valid action)"
    # ToolBench: a final prose reply ends the episode like `Finish`, and a row with a single call
    # and no observation is a one-step instruction (Agent-FLAN toolbench_instruct_j1s1), complete.
    tool_replies: bool = False
    replies: Replies = Replies()


# --- command grammars: a list of templates, `{slot}` standing for an argument -----------------

@dataclass(frozen=True)
class Template:
    text: str            # as the env's documentation writes it: `take {obj} from {recep}`
    verb: str            # the literal words before the first slot
    regex: re.Pattern


def templates(slots: dict[str, str], *texts: str) -> list[Template]:
    out = []
    for text in texts:
        parts = re.split(r"(\{\w+\})", text)
        regex = "".join(f"(?:{slots[p[1:-1]]})" if p.startswith("{") else re.escape(p) for p in parts)
        verb = parts[0].strip() if len(parts) > 1 else text
        out.append(Template(text, verb, re.compile(regex, re.S)))
    # The longest verb first: `toggle and go through` before `toggle`, `go to` before `go`.
    return sorted(out, key=lambda t: -len(t.verb))


def _verb_of(action: str, table: list[Template]) -> str | None:
    # A verb ends at a space or newline, or is itself bracketed (`search[`).
    return next((t.verb for t in table if action.startswith(t.verb) and (
        action == t.verb or t.verb.endswith("[") or action[len(t.verb)] in " \n")), None)


def check_commands(name: str, table: list[Template], action: str) -> Breach | None:
    """`<name>.command` when no template's verb starts the action, `<name>.arguments` when a verb
    does but its arguments fit none of that verb's templates."""
    text = action.strip()
    verb = _verb_of(text, table)
    if verb is None:
        known = ", ".join(sorted({f"`{t.text}`" for t in table}))
        return Breach(f"{name}.command", f"{text[:120]!r} is not one of {known}"[:400])
    shapes = [t for t in table if t.verb == verb]
    if any(t.regex.fullmatch(text) for t in shapes):
        return None
    return Breach(f"{name}.arguments", f"{text[:120]!r} does not fit " + " or ".join(f"`{t.text}`" for t in shapes))


def break_commands(name: str, table: list[Template], action: str) -> dict[str, str]:
    """A real action with its verb swapped for an invented one, and with its arguments dropped."""
    text = action.strip()
    verb = _verb_of(text, table)
    if verb is None:
        return {}
    verbs = {t.verb.split()[0] for t in table}
    invented = next(v for v in INVENTED_VERBS if v not in verbs)
    out = {f"{name}.command": invented + text[len(verb):]}
    if verb != text and check_commands(name, table, verb) is not None:
        out[f"{name}.arguments"] = verb
    return out


def command_grammar(name: str, source: str, table: list[Template], terminal=None,
                    extra: Callable[[str, Context], Breach | None] | None = None,
                    extra_breaks: Callable[[str, Context], dict[str, str]] | None = None,
                    extra_rules: dict[str, str] | None = None, replies: Replies = Replies()) -> Grammar:
    def check(action: str, context: Context) -> Breach | None:
        return check_commands(name, table, action) or (extra(action.strip(), context) if extra else None)

    def breaks(action: str, context: Context) -> dict[str, str]:
        out = break_commands(name, table, action)
        if extra_breaks:
            out.update(extra_breaks(action.strip(), context))
        return out

    rules = {f"{name}.command": "the action starts with one of the env's verbs: "
                                + ", ".join(sorted({t.verb for t in table}))}
    if any("{" in t.text for t in table):
        rules[f"{name}.arguments"] = "its arguments fit the verb's template: " + "; ".join(
            t.text for t in sorted(table, key=lambda t: t.text))
    rules.update(extra_rules or {})
    return Grammar(name, source, rules, check, breaks, terminal, replies=replies)


# --- ALFWorld ---------------------------------------------------------------------------------
# Objects and receptacles are a lowercase name and an instance number (`spraybottle 1`).
_ALF_THING = r"[a-z]+ \d+"
ALFWORLD = templates(
    {"obj": _ALF_THING, "recep": _ALF_THING},
    "go to {recep}", "open {recep}", "close {recep}", "take {obj} from {recep}", "put {obj} in/on {recep}",
    "toggle {obj}", "use {obj}", "clean {obj} with {recep}", "heat {obj} with {recep}",
    "cool {obj} with {recep}", "examine {obj}", "look", "inventory")
_AVAILABLE = re.compile(r"AVAILABLE ACTIONS:\s*(.+)\s*$", re.S)
# TextWorld answers a command it cannot carry out (unknown, or impossible here) with `Nothing happens.`
ALFWORLD_REPLIES = Replies({"alfworld.nothing_happens": _starts(r"Nothing happens\.")})


def _alfworld_available(action: str, context: Context) -> Breach | None:
    """AgentGym's ALFWorld lists the admissible commands after each observation; the AgentInstruct
    prompt says an action outside the given list is illegal."""
    m = _AVAILABLE.search(context.observation)
    if not m:
        return None
    available = {a.strip() for a in m.group(1).split(",")}
    if action not in available:
        return Breach("alfworld.available", f"{action[:120]!r} is not among the {len(available)} AVAILABLE ACTIONS")
    return None


def _alfworld_breaks(action: str, context: Context) -> dict[str, str]:
    if not _AVAILABLE.search(context.observation) or not re.fullmatch(rf"go to {_ALF_THING}", action):
        return {}
    return {"alfworld.available": re.sub(r"\d+$", "99", action)}


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


# --- OS (AgentBench OS) -----------------------------------------------------------------------
# Our OS env answers an action it cannot parse with `Invalid action: ...` (os_sandbox). A command
# that runs and fails (`No such file or directory`) is the shell's answer, not a refusal: exploring
# with it is part of the task.
OS_REPLIES = Replies({"os.invalid_action": _starts(r"Invalid action: ")})
def _os_check(action: str, context: Context) -> Breach | None:
    kind, why = parse_os_action(action)
    if kind != "invalid":
        return None
    text = action.strip()
    rule = "os.bash_block" if text.startswith("bash") else "os.answer" if text.startswith("answer(") else "os.command"
    return Breach(rule, f"{text[:120]!r}: {why}")


def _os_breaks(action: str, context: Context) -> dict[str, str]:
    text = action.strip()
    verb_end = text.find("(") if text.startswith("answer(") else len(text.split()[0])
    out = {"os.command": INVENTED_VERBS[0] + text[verb_end:]}
    if text.startswith("bash"):
        out["os.bash_block"] = "bash " + parse_os_action(text)[1].strip().replace("\n", "; ")
    if text.startswith("answer("):
        out["os.answer"] = text.rstrip(")")
    return out


def _os_terminal(action: str) -> bool:
    return parse_os_action(action)[0] in ("answer", "finish")


# --- DB (AgentBench DBBench) ------------------------------------------------------------------
_DB_OPERATION = re.compile(r"Operation\s*\n\s*```sql\s*\n.*\S.*```\s*", re.S | re.I)
# DBBench shows MySQL's errors (`1054 (42S22): Unknown column ...`), our DB env SQLite's (`Error: ...`)
# and `Invalid action: ...` for a turn it cannot parse.
DB_REPLIES = Replies({"db.sql_error": _starts(r"\d{4} \([0-9A-Z]{5}\): ", r"Error: "),
                      "db.invalid_action": _starts(r"Invalid action: ")})
_DB_ANSWER = re.compile(r"Answer\s*\nFinal Answer:\s*(?P<answer>.*\S)\s*", re.S)


def _db_check(action: str, context: Context) -> Breach | None:
    text = action.strip()
    if text.startswith("Operation"):
        return None if _DB_OPERATION.fullmatch(text) else Breach(
            "db.sql_block", f"{text[:120]!r}: `Operation` needs one ```sql code block")
    if text.startswith("Answer"):
        m = _DB_ANSWER.fullmatch(text)
        ok = m is not None and parse_answer_list(m["answer"]) is not None
        return None if ok else Breach("db.final_answer",
                                      f"{text[:120]!r}: `Answer` needs `Final Answer: [...]`, a list")
    return Breach("db.command", f"{text[:120]!r} is neither `Operation` + SQL nor `Answer` + `Final Answer`")


def _db_breaks(action: str, context: Context) -> dict[str, str]:
    text = action.strip()
    head, _, rest = text.partition("\n")
    out = {"db.command": f"{INVENTED_VERBS[0].title()}\n{rest}"}
    if head.strip() == "Operation":
        out["db.sql_block"] = "Operation\n" + re.sub(r"```(?:sql)?", "", rest).strip()
    if head.strip() == "Answer":
        out["db.final_answer"] = "Answer\n" + rest.replace("[", "", 1)[::-1].replace("]", "", 1)[::-1]
    return out


def _db_terminal(action: str) -> bool:
    return action.strip().startswith("Answer")


# --- SQLGym (AgentGym): the action is one SQL block -------------------------------------------
_SQL_BLOCK = re.compile(r"```sql\s*\n.*\S.*```\s*", re.S | re.I)


def _sqlgym_check(action: str, context: Context) -> Breach | None:
    return None if _SQL_BLOCK.fullmatch(action.strip()) else Breach(
        "sqlgym.sql_block", f"{action[:120]!r} is not one ```sql code block")


def _sqlgym_breaks(action: str, context: Context) -> dict[str, str]:
    return {"sqlgym.sql_block": re.sub(r"```(?:sql)?", "", action).strip()}


# --- AgentGym games -----------------------------------------------------------------------------
# BabyAI: the action space agentenv-babyai builds from the room (`turn left`, `pickup grey key 1`,
# `toggle and go through red locked door 1`, ...), plus its `check available actions`.
_COLOR = "red|green|blue|purple|yellow|grey"
BABYAI = templates(
    {"obj": rf"(?:{_COLOR}) (?:ball|box|key) \d+", "door": rf"(?:{_COLOR}) (?:open|closed|locked) door \d+",
     "opendoor": rf"(?:{_COLOR}) open door \d+", "shutdoor": rf"(?:{_COLOR}) (?:closed|locked) door \d+"},
    "turn left", "turn right", "move forward", "drop", "toggle", "go to goal", "check available actions",
    "go to {obj}", "go to {door}", "pickup {obj}", "go through {opendoor}", "toggle and go through {shutdoor}")
# agentenv-babyai (check_action_is_valid, postprocess_obs): an action outside the room's action space
# is `not recognized`, one the room rules out is `You cannot ...` / `... you can't move forward.`;
# an action with nothing to do answers `No change in state.`
BABYAI_REPLIES = Replies({"babyai.not_recognized": _starts(r"The action is not recognized"),
                          "babyai.cannot": _starts(r"You cannot ", r"There is a barrier in front of you")},
                         no_op=_starts(r"No change in state\."))
# ScienceWorld: the action list in the AgentGym prompt; `drop` is accepted by the env too (an
# upstream row drops an object and the env moves it), and a number answers its "Ambiguous request"
# question.
_SCI_THING = r"\S.*"
SCIWORLD = templates(
    {"obj": _SCI_THING, "loc": _SCI_THING},
    "open {obj}", "close {obj}", "activate {obj}", "deactivate {obj}", "connect {obj} to {obj}",
    "disconnect {obj}", "use {obj}", "use {obj} on {obj}", "look around", "look at {obj}", "look in {obj}",
    "read {obj}", "move {obj} to {obj}", "pick up {obj}", "put down {obj}", "drop {obj}",
    "pour {obj} into {obj}", "dunk {obj} into {obj}", "mix {obj}", "go to {loc}", "eat {obj}", "flush {obj}",
    "focus on {obj}", "wait", "wait1", "task", "inventory")
# ScienceWorld's parser: `No known action matches that input.`; a done thing: `The door is already open.`
SCIWORLD_REPLIES = Replies({"sciworld.no_known_action": _starts(r"No known action matches that input",
                                                                r"Unknown action\.")},
                           no_op=_starts(r"The .+ is already (?:open|closed|activated|deactivated)\."))


def _sciworld_check(action: str, context: Context) -> Breach | None:
    if action.strip().isdigit() and "Ambiguous" in context.observation:
        return None
    return check_commands("sciworld", SCIWORLD, action)


# TextCraft: agentenv-textcraft's action regexes (`get N item`, `craft X using N a, M b`, `inventory`).
TEXTCRAFT = templates({"n_item": r"\d+ \S.*", "target": r"\S.*", "ingredients": r"\d+ [^,]+(?:, *\d+ [^,]+)*"},
                      "get {n_item}", "craft {target} using {ingredients}", "inventory")
# agentenv-textcraft's ActionFailed messages; `Crafted N x` / `Got N x` add to the inventory each time,
# so the same action met with the same words is progress there, not a loop.
TEXTCRAFT_REPLIES = Replies({"textcraft.could_not_execute": _starts(r"Could not execute "),
                             "textcraft.failed": _starts(r"Could not find ", r"Could not extract recipe ",
                                                         r"Wrong item format: ")},
                            progress=_starts(r"Crafted \d+ ", r"Got \d+ "))
# The maze has no refusal text: a move into a wall leaves the position the reply states unchanged.
MAZE = templates({}, "move up", "move down", "move left", "move right")
_WORDLE = re.compile(r"[a-z]( [a-z]){4}")
# agentenv-lmrlgym answers a guess the game does not take with `invalid word`.
WORDLE_REPLIES = Replies({"wordle.invalid_word": _starts(r"invalid word\s*$")})


def _wordle_check(action: str, context: Context) -> Breach | None:
    return None if _WORDLE.fullmatch(action.strip()) else Breach(
        "wordle.guess", f"{action[:60]!r} is not five lowercase letters separated by spaces")


def _wordle_breaks(action: str, context: Context) -> dict[str, str]:
    return {"wordle.guess": action.replace(" ", "")}


# --- tool use: AgentGym tool envs and ToolBench / Agent-FLAN -------------------------------------
_AGENTGYM_TOOL = re.compile(r"(?P<name>[\w.\-]+) with Action Input:\s*(?P<input>.*)", re.S)
_AGENTGYM_TOOL_LIST = re.compile(r"^Name:\s*([\w.\-]+)\(([^)]*)\)", re.M)
_WORD = re.compile(r"[\w.\-]+")


# Read four times per action (whether the tool is offered, its parameters; when validating and when
# counting): one scan of the prompt. Callers only read the mapping.
@functools.lru_cache(maxsize=64)
def offered_tools(prompt: str) -> dict[str, list[str]]:
    """The tools an AgentGym tool prompt lists (`Name: get_tasks(project_id)`) with their parameters."""
    return {m.group(1): [p.strip() for p in m.group(2).split(",") if p.strip()]
            for m in _AGENTGYM_TOOL_LIST.finditer(prompt)}


def tool_offered(name: str, prompt: str) -> bool:
    """AgentGym prompts list every tool (`Name: f(...)`): only those. ToolBench / Agent-FLAN prompts
    describe their APIs in several layouts (`{'name': 'f', ...}` of tool "t", `t.f: This is the
    subfunction ...`, a plain list) but always name them: the name, or `t.f` with both t and f named,
    must appear in the prompt as a whole word (`Finish` included, where the prompt offers it)."""
    listed = offered_tools(prompt)
    if listed:
        return name in listed
    words = set(_WORD.findall(prompt))
    tool, _, function = name.partition(".")
    return name in words or bool(function and tool in words and function in words)


def parse_arguments(text: str) -> dict | None:
    """A tool call's arguments: a JSON object, or the Python dict literal some upstream rows write."""
    return parse_literal(text.strip(), dict)


def tool_call(action: str, dialect: str | None) -> tuple[str | None, str | None]:
    """(tool name, argument text) of a tool call in any tool dialect; (None, None) if it is none."""
    text = action.strip()
    if dialect == "json_tool" or dialect == "dict_tool_call":
        call = parse_arguments(text)
        if call is None:
            return None, None
        name, args = call.get("Tool" if dialect == "json_tool" else "name"), call.get(
            "Param" if dialect == "json_tool" else "parameters")
        return (name if isinstance(name, str) else None), "{}" if args is None else json.dumps(args, ensure_ascii=False)
    m = _AGENTGYM_TOOL.fullmatch(text)
    if m:
        return m["name"], m["input"]
    name, _, rest = text.partition("\n")
    if rest.startswith("Action Input:"):
        return name.strip(), rest[len("Action Input:"):]
    return None, None


_NAME_HEAD = re.compile(r"[A-Za-z_][\w.\-]*")


def action_name(action: str, dialect: str | None) -> str | None:
    """The name of the tool or command an action invokes (`bash`, `get_relations`, `search`, ...)."""
    if dialect in ("json_tool", "dict_tool_call"):
        return tool_call(action, dialect)[0]
    m = _NAME_HEAD.search(action.lstrip("`"))
    return m.group(0) if m else None


def check_tool_call(action: str, context: Context) -> Breach | None:
    name, args = tool_call(action, context.dialect)
    if name is None:
        return Breach("tool.syntax", f"{action[:120]!r} is not a tool call with arguments")
    if not tool_offered(name, context.prompt):
        return Breach("tool.unknown_tool", f"{name!r} is not a tool the prompt offers")
    parsed = parse_arguments(args or "")
    if parsed is None:
        return Breach("tool.arguments", f"{name}: the arguments {(args or '')[:100]!r} are not an object")
    params = offered_tools(context.prompt).get(name)
    unknown = sorted(set(parsed) - set(params)) if params is not None else []
    if unknown:
        return Breach("tool.parameters", f"{name} takes {params}, not {unknown}")
    return None


def break_tool_call(action: str, context: Context) -> dict[str, str]:
    name, args = tool_call(action, context.dialect)
    if name is None:
        return {}
    if context.dialect in ("json_tool", "dict_tool_call"):
        # The arguments written as a string instead of an object.
        call = parse_arguments(action)
        key = "Param" if context.dialect == "json_tool" else "parameters"
        call[key] = ", ".join(f"{k}={v}" for k, v in (call.get(key) or {}).items()) or "none"
        text = json.dumps(call, ensure_ascii=False) if context.dialect == "json_tool" else repr(call)
        return {"tool.arguments": text}
    sep = " with Action Input: " if context.dialect == "action_input" else "\nAction Input: "
    out = {"tool.arguments": f"{name}{sep}{{{(args or '').strip()[1:-1]}"}
    if name in offered_tools(context.prompt):
        out["tool.parameters"] = f"{name}{sep}" + json.dumps({"teleport_to": "moon"})
    return out


# agentenv-tool: a turn it cannot parse gets `Format error, please response in the format of ...`, a
# call that raises `ERROR | <exception>`. ToolBench's API replies carry a non-empty `error` field.
AGENTGYM_TOOL_REPLIES = Replies({"tool.format_error": _starts(r"Format error, please response in the format"),
                                 "tool.error": _starts(r"ERROR \| ")})
TOOLBENCH_REPLIES = Replies({"tool.api_error": re.compile(r"""^\s*\{\s*["']error["']\s*:\s*["'](?!["'])""")})

TOOL_RULES = {"tool.syntax": "a tool call: `name with Action Input: {...}`, ToolBench `Action:`/`Action Input:`, "
                             "or a JSON/dict call",
              "tool.unknown_tool": "the tool is one the prompt offers",
              "tool.arguments": "the arguments parse as an object (JSON, or a Python dict literal)",
              "tool.parameters": "every argument is a parameter the prompt lists for the tool (AgentGym lists them)"}


def _tool_grammar(name: str, source: str, terminal: Callable[[str], bool], ends: str, replies: Replies,
                  tool_replies: bool = False) -> Grammar:
    return Grammar(name, source, TOOL_RULES, check_tool_call, break_tool_call, terminal, ends, tool_replies,
                   replies)


def _agentgym_finish(action: str) -> bool:
    return action.strip().startswith("finish with Action Input:")


def _toolbench_finish(action: str) -> bool:
    name = tool_call(action, None)[0] or action.strip().split("\n", 1)[0].strip()
    return name == "Finish"


_AGENTGYM_TOOLS_SOURCE = ("AgentGym tool envs (agentenv-tool): `Action: <name> with Action Input: {...}`, the "
                          "tools the prompt lists as `Name: f(params)`, ending with `finish`")
GRAMMARS: Registry[Grammar] = Registry("grammar", {g.name: g for g in [
    command_grammar("alfworld", "ALFWorld admissible commands (TextWorld ALFRED grammar) as AgentInstruct/AgentGym "
                    "prompts use them; AgentGym's AVAILABLE ACTIONS list", ALFWORLD,
                    extra=_alfworld_available, extra_breaks=_alfworld_breaks,
                    extra_rules={"alfworld.available":
                                 "when the observation lists AVAILABLE ACTIONS, the action is one of them"},
                    replies=ALFWORLD_REPLIES),
    command_grammar("webshop", "AgentBench/AgentGym WebShop prompt: `search[keywords]`, `click[value]`, the value "
                    "one of the page's clickables", WEBSHOP, extra=_webshop_clickable, extra_breaks=_webshop_breaks,
                    extra_rules={"webshop.click_target": "a clicked value is a `[SEP]` item of the page"}),
    Grammar("mind2web", "Mind2Web/MindAct multiple choice as AgentInstruct asks it: a choice letter the prompt "
            "offers, an operation (CLICK, TYPE, SELECT), a Value for TYPE/SELECT",
            {"mind2web.syntax": "`Answer: <letter>.` then `Action: <op>` and `Value:` lines",
             "mind2web.choice": "the letter is one of the offered choices",
             "mind2web.operation": "the operation is CLICK, TYPE or SELECT (none only for A, None of the above)",
             "mind2web.value": "TYPE and SELECT carry a Value, CLICK does not"},
            _mind2web_check, _mind2web_breaks),
    Grammar("kg", "AgentBench KG prompt: get_relations, get_neighbors, intersection, get_attributes, argmax, "
            "argmin, count, and `Final Answer: #id`",
            {"kg.function": "one of the seven functions, called as name(args)",
             "kg.arguments": "the function's number of arguments (intersection: two variables)",
             "kg.variable": "a #id variable an earlier observation defined",
             "kg.final_answer": "`Final Answer: #<id>`"},
            _kg_check, _kg_breaks, lambda a: a.strip().startswith("Final Answer:"), "with `Final Answer: #id`",
            replies=KG_REPLIES),
    Grammar("os", "AgentBench OS prompt: `bash` + a ```bash block, `answer(...)`, `finish` "
            "(pipeline/synth/envs/os_sandbox.parse_os_action)",
            {"os.command": "bash, answer(...) or finish",
             "os.bash_block": "`bash` is followed by a ```bash code block",
             "os.answer": "`answer(` is closed"},
            _os_check, _os_breaks, _os_terminal, "with `answer(...)` or `finish`", replies=OS_REPLIES),
    Grammar("db", "AgentBench DBBench prompt: `Operation` + a ```sql block, or `Answer` + `Final Answer: [...]`",
            {"db.command": "Operation or Answer",
             "db.sql_block": "`Operation` is followed by a ```sql code block",
             "db.final_answer": "`Answer` is followed by `Final Answer:` and a list"},
            _db_check, _db_breaks, _db_terminal, "with `Action: Answer` + `Final Answer: [...]`", replies=DB_REPLIES),
    Grammar("sqlgym", "AgentGym SQLGym: one ```sql block per turn", {"sqlgym.sql_block": "one ```sql code block"},
            _sqlgym_check, _sqlgym_breaks),
    command_grammar("babyai", "agentenv-babyai's action space (environment.py postprocess_obs)", BABYAI,
                    replies=BABYAI_REPLIES),
    Grammar("sciworld", "the AgentGym SciWorld prompt's action list, plus the env's `drop` and numbered choices",
            command_grammar("sciworld", "", SCIWORLD).rules, _sciworld_check,
            lambda action, context: break_commands("sciworld", SCIWORLD, action), replies=SCIWORLD_REPLIES),
    command_grammar("textcraft", "agentenv-textcraft's action regexes (environment.py)", TEXTCRAFT,
                    replies=TEXTCRAFT_REPLIES),
    command_grammar("maze", "the AgentGym LMRL-Gym maze prompt: move up/down/left/right", MAZE),
    Grammar("wordle", "the AgentGym LMRL-Gym wordle prompt: a 5-letter guess as space-separated letters",
            {"wordle.guess": "five lowercase letters separated by spaces"}, _wordle_check, _wordle_breaks,
            replies=WORDLE_REPLIES),
    *(_tool_grammar(env, _AGENTGYM_TOOLS_SOURCE, _agentgym_finish, "with `finish with Action Input: {...}`",
                    AGENTGYM_TOOL_REPLIES)
      for env in ("movie", "todo", "weather", "academia", "sheet")),
    _tool_grammar("toolbench", "ToolBench / Agent-FLAN: the functions the prompt lists (and `Finish`), arguments "
                  "that parse; a single-call instruction row may end on its call", _toolbench_finish,
                  "with `Finish` or a final reply in prose", TOOLBENCH_REPLIES, tool_replies=True),
]})


def grammar_for(env: str) -> Grammar | None:
    return GRAMMARS.get(env)


def break_action(grammar: Grammar, action: str, context: Context) -> dict[str, str]:
    """Edits of a valid action, one per rule; only those that really break that rule are kept."""
    return {rule: edited for rule, edited in grammar.breaks(action, context).items()
            if edited.strip() and (b := grammar.check(edited, context)) is not None and b.rule == rule}
