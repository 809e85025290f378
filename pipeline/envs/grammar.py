"""The grammar toolkit every env spec builds its grammar with (pipeline/envs/<env>.py).

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
  an action out (`refused`, by name), when it did and nothing changed (`no_op`), and which replies
  report progress even when they repeat word for word. Validation grounds its verdicts in them
  (pipeline/ingest/validate.py): what the env refused is not trained on, a repeat the env reports
  as progress is no loop.

Two shapes cover most envs: a command grammar (a list of templates such as `take {obj} from {recep}`)
and the tool-call grammar (AgentGym tool envs, ToolBench / Agent-FLAN function calls).
"""
from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from trajforge.pipeline.ingest.dialects import parse_literal

# Verbs no env offers; the first one that is not a verb of the env replaces a real verb.
INVENTED_VERBS = ("teleport", "levitate", "summon", "conjure")


class _cached_once:
    """`functools.cached_property` without its lock: Python 3.11's takes an RLock at each first read,
    which costs as much as building the value it guards here. A Context is read by the thread that
    built it."""

    def __init__(self, func: Callable):
        self.func = func
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance, owner: type | None = None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.func(instance)
        return value


# Not frozen: validation builds one for every action, and a frozen dataclass's generated __init__
# (object.__setattr__ per field) costs several times a plain one's. Nothing changes one once built.
@dataclass
class Context:
    """What an action is checked against: the turns the agent saw before it."""
    seen: tuple[str, ...]    # every system/user turn before the action, from the first non-empty one
    observation: str         # the user turn right before the action ("" if none)
    dialect: str | None = None  # how the turn wrote the action (tool calls have several forms)

    # Joined only when a grammar reads it (tool, KG, Mind2Web): joining every action's growing
    # prompt costs as much as checking the action.
    @_cached_once
    def prompt(self) -> str:
        """The turns seen, joined by newlines."""
        return "\n".join(self.seen)

    @_cached_once
    def tools(self) -> dict[str, list[str]]:
        """`offered_tools(self.prompt)`, read turn by turn (each turn's listing is read once, not once
        per action after it), unless a listing may run on from one turn into the next."""
        tools: dict[str, list[str]] = {}
        for turn in self.seen:
            listed, open_listing = _turn_listing(turn)
            if open_listing:
                return offered_tools(self.prompt)
            if listed:
                tools.update(listed)
        return tools


@dataclass(frozen=True)
class Breach:
    rule: str
    detail: str


# Where an env's wrapper puts its own words before the reply (AgentGym tool envs `Observation: `,
# TextCraft `Instruction:\n`); the reply patterns below read what follows.
_LEAD = r"^(?:(?:Observation|Instruction)\s*:\s*)?"


def starts(*texts: str) -> re.Pattern:
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
        for name, pattern in self.refused.items():
            if pattern.search(reply):
                return name
        return None

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


class Commands(list):
    """An env's templates, the longest verb first (`toggle and go through` before `toggle`, `go to`
    before `go`), with what a check looks up in them: by an action's first character, the templates
    whose verb can start it (in the same order); by verb, its templates. A check then tries a few
    templates, not every one of the env's."""

    def __init__(self, table: list[Template]):
        super().__init__(sorted(table, key=lambda t: -len(t.verb)))
        self.shapes: dict[str, list[Template]] = {}
        for t in self:
            self.shapes.setdefault(t.verb, []).append(t)
        # A template that starts with a slot has no verb: it may start any action.
        self.no_verb = [t for t in self if not t.verb]
        self.by_initial = {t.verb[0]: [u for u in self if u.verb[:1] == t.verb[0] or not u.verb] for t in self if t.verb}
        self.known = ", ".join(sorted({f"`{t.text}`" for t in self}))


def templates(slots: dict[str, str], *texts: str) -> Commands:
    out = []
    for text in texts:
        parts = re.split(r"(\{\w+\})", text)
        regex = "".join(f"(?:{slots[p[1:-1]]})" if p.startswith("{") else re.escape(p) for p in parts)
        verb = parts[0].strip() if len(parts) > 1 else text
        out.append(Template(text, verb, re.compile(regex, re.S)))
    return Commands(out)


def _verb_of(action: str, table: Commands) -> str | None:
    # A verb ends at a space or newline, or is itself bracketed (`search[`).
    for t in table.by_initial.get(action[:1], table.no_verb):
        verb = t.verb
        if action.startswith(verb) and (action == verb or verb.endswith("[") or action[len(verb)] in " \n"):
            return verb
    return None


def check_commands(name: str, table: Commands, action: str) -> Breach | None:
    """`<name>.command` when no template's verb starts the action, `<name>.arguments` when a verb
    does but its arguments fit none of that verb's templates."""
    text = action.strip()
    verb = _verb_of(text, table)
    if verb is None:
        return Breach(f"{name}.command", f"{text[:120]!r} is not one of {table.known}"[:400])
    shapes = table.shapes[verb]
    for t in shapes:
        if t.regex.fullmatch(text):
            return None
    return Breach(f"{name}.arguments", f"{text[:120]!r} does not fit " + " or ".join(f"`{t.text}`" for t in shapes))


def break_commands(name: str, table: Commands, action: str) -> dict[str, str]:
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


def command_grammar(name: str, source: str, table: Commands, terminal=None,
                    extra: Callable[[str, Context], Breach | None] | None = None,
                    extra_breaks: Callable[[str, Context], dict[str, str]] | None = None,
                    extra_rules: dict[str, str] | None = None, replies: Replies = Replies(),
                    ends: str = Grammar.ends) -> Grammar:
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
    return Grammar(name, source, rules, check, breaks, terminal, ends, replies=replies)



# --- tool use: AgentGym tool envs and ToolBench / Agent-FLAN -------------------------------------
_AGENTGYM_TOOL = re.compile(r"(?P<name>[\w.\-]+) with Action Input:\s*(?P<input>.*)", re.S)
_AGENTGYM_TOOL_LIST = re.compile(r"^Name:\s*([\w.\-]+)\(([^)]*)\)", re.M)
_WORD = re.compile(r"[\w.\-]+")


# Callers only read the mapping.
@functools.lru_cache(maxsize=256)
def offered_tools(prompt: str) -> dict[str, list[str]]:
    """The tools an AgentGym tool prompt lists (`Name: get_tasks(project_id)`) with their parameters."""
    return _listed_tools(prompt)


def _listed_tools(prompt: str) -> dict[str, list[str]]:
    return {m.group(1): [p.strip() for p in m.group(2).split(",") if p.strip()]
            for m in _tool_listings(prompt)}


# Read for each turn of the prompt before every action (`Context.tools`): one scan of a turn, one lookup
# for both answers. Callers only read the mapping.
@functools.lru_cache(maxsize=256)
def _turn_listing(text: str) -> tuple[dict[str, list[str]], bool]:
    """(the tools `text` lists, whether a listing in it may run on into the next turn: `_open_listing`)."""
    return _listed_tools(text), _open_listing(text)


def _tool_listings(prompt: str):
    """`_AGENTGYM_TOOL_LIST.finditer(prompt)`, the same matches: only a line that starts with `Name:`
    can start one, so the scan jumps from one such line to the next instead of trying every
    character of a long prompt (what `^` makes the regex engine do)."""
    at = prompt.find("Name:")
    while at >= 0:
        m = _AGENTGYM_TOOL_LIST.match(prompt, at) if at == 0 or prompt[at - 1] == "\n" else None
        at = prompt.find("Name:", m.end() if m else at + 1)
        if m:
            yield m


def _open_listing(text: str) -> bool:
    """Whether a `Name:` line of `text` has no `)` after it: the only listing text that follows may
    change (a match never reads past the first `)` after its start)."""
    at = text.find("Name:", text.rfind(")") + 1)
    while at >= 0:
        if at == 0 or text[at - 1] == "\n":
            return True
        at = text.find("Name:", at + 1)
    return False


def tool_offered(name: str, context: Context) -> bool:
    """AgentGym prompts list every tool (`Name: f(...)`): only those. ToolBench / Agent-FLAN prompts
    describe their APIs in several layouts (`{'name': 'f', ...}` of tool "t", `t.f: This is the
    subfunction ...`, a plain list) but always name them: the name, or `t.f` with both t and f named,
    must appear in the prompt as a whole word (`Finish` included, where the prompt offers it)."""
    listed = context.tools
    if listed:
        return name in listed
    words = set(_WORD.findall(context.prompt))
    tool, _, function = name.partition(".")
    return name in words or bool(function and tool in words and function in words)


def parse_arguments(text: str) -> dict | None:
    """A tool call's arguments: a JSON object, or the Python dict literal some upstream rows write
    (`parse_literal(text.strip(), dict)`)."""
    text = text.strip()
    try:
        value = json.loads(text)
    except _JSON_ERRORS:
        return _python_arguments(text)
    return value if isinstance(value, dict) else None


_JSON_ERRORS = (ValueError, RecursionError, MemoryError)
# The string literals of a Python literal without backslashes, and the names outside them (a name
# right after a digit or a point is part of a number, or a token JSON refuses as well).
_STRINGS = re.compile(r"""('[^'\n\r]*'|"[^"\n\r]*")""")
_NAME = re.compile(r"(?<![0-9.])[A-Za-z_]\w*")
_JSON_NAMES = {"True": "true", "False": "false", "None": "null"}
# Python's parser refuses a literal nested deeper than 200 brackets, JSON does not: a text with this
# many openings is left to ast.
_DEEP = 100


def _python_as_json(text: str) -> str | None:
    """A Python literal without backslashes as JSON text: its single-quoted strings double-quoted,
    True/False/None written as JSON does; None when it has another name (`NaN`, `true`, a string
    prefix), which JSON could read otherwise than Python."""
    parts = _STRINGS.split(text)  # outside strings, a string, outside, ...
    names = set(_NAME.findall(" ".join(parts[0::2])))
    if not names <= _JSON_NAMES.keys():
        return None
    parts[1::2] = ['"' + p[1:-1].replace('"', '\\"') + '"' if p[0] == "'" else p for p in parts[1::2]]
    if names:
        parts[0::2] = [_NAME.sub(lambda m: _JSON_NAMES[m.group()], part) for part in parts[0::2]]
    return "".join(parts)


def _python_arguments(text: str) -> dict | None:
    """`parse_literal(text, dict)` of a stripped text that is no JSON, mostly without ast (several
    times slower on a large argument): a Python literal without a backslash, a lone surrogate (compile
    refuses one) or deep nesting means as Python what `_python_as_json` makes of it means as JSON,
    whenever that parses: each token reads the same in both, and one left unread (an unclosed
    string) fails JSON too. AgentGym tool envs write the Python repr of an API result as `finish`
    arguments; tests/ingest/test_grammars.py holds the two readings together."""
    if "\\" in text or text.count("{") + text.count("[") >= _DEEP or not _utf8(text):
        return parse_literal(text, dict)
    as_json = _python_as_json(text)
    if as_json is not None:
        try:
            value = json.loads(as_json)
        except _JSON_ERRORS:
            pass
        else:
            return value if isinstance(value, dict) else None
    return parse_literal(text, dict)


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


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
    if not tool_offered(name, context):
        return Breach("tool.unknown_tool", f"{name!r} is not a tool the prompt offers")
    parsed = parse_arguments(args or "")
    if parsed is None:
        return Breach("tool.arguments", f"{name}: the arguments {(args or '')[:100]!r} are not an object")
    params = context.tools.get(name)
    unknown = parsed.keys() - params if params is not None else None
    if unknown:
        return Breach("tool.parameters", f"{name} takes {params}, not {sorted(unknown)}")
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
    if name in context.tools:
        out["tool.parameters"] = f"{name}{sep}" + json.dumps({"teleport_to": "moon"})
    return out


# agentenv-tool: a turn it cannot parse gets `Format error, please response in the format of ...`, a

TOOL_RULES = {"tool.syntax": "a tool call: `name with Action Input: {...}`, ToolBench `Action:`/`Action Input:`, "
                             "or a JSON/dict call",
              "tool.unknown_tool": "the tool is one the prompt offers",
              "tool.arguments": "the arguments parse as an object (JSON, or a Python dict literal)",
              "tool.parameters": "every argument is a parameter the prompt lists for the tool (AgentGym lists them)"}


def tool_grammar(name: str, source: str, terminal: Callable[[str], bool], ends: str, replies: Replies,
                  tool_replies: bool = False) -> Grammar:
    return Grammar(name, source, TOOL_RULES, check_tool_call, break_tool_call, terminal, ends, tool_replies,
                   replies)



def break_action(grammar: Grammar, action: str, context: Context) -> dict[str, str]:
    """Edits of a valid action, one per rule; only those that really break that rule are kept."""
    return {rule: edited for rule, edited in grammar.breaks(action, context).items()
            if edited.strip() and (b := grammar.check(edited, context)) is not None and b.rule == rule}
