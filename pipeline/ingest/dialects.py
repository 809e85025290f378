"""Parse and render every upstream assistant-turn dialect as (thought, action).

Each dialect is a (parse, render) pair in a registry (dict from name to functions, not an
if-chain). `parse_turn` tries the dialects from the most specific to the most general and returns
the first that matches. Rendering a parsed turn in its own dialect and parsing it again gives the
same thought and action (tested on every real turn), and so does rendering it as Think/Act.

The action always keeps its environment's syntax: everything after the action marker (`bash` +
fenced block, `answer(220)`, `search[...]`, `get_relations(...)`, `Operation` + SQL block, a
JSON tool call), so that it can be replayed in the environment. Each dialect also carries its
line markers (the GRPO rewards count them), and `extract_answer` reads the final answer out of a
terminal action (validation, negatives, the agent loop and the rewards all use it).
"""
from __future__ import annotations

import ast
import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trajforge.pipeline.registry import Registry

# CSI (ESC [ ... final byte), OSC (ESC ] ... BEL or ESC \), and two-byte escapes; bare BEL and CR.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]|\x07")


def _rare_space(text: str) -> bool:
    """Whether a text holds whitespace (str.isspace) that ASCII text rarely does, other than LF, CR
    and tab. Written out: a loop over them, or one regex with a character class, costs three times
    these substring searches (most turns pass); a search for one character is the cheapest."""
    return ("\x0b" in text or "\x0c" in text or "\x1c" in text or "\x1d" in text or "\x1e" in text
            or "\x1f" in text)


def _space_before_break(text: str) -> bool:
    """Whether a space or a tab comes right before a LF (a tab before LF is looked for only where a
    tab is)."""
    return " \n" in text or ("\t" in text and "\t\n" in text)


def _stripped_lines(text: str) -> str:
    return "\n".join(map(str.rstrip, text.split("\n"))).strip()


def clean_text(text: str) -> str:
    """Fold what differs between mirrors and terminals but carries no meaning.

    Terminal escape codes are removed, CRLF becomes LF, trailing spaces of each line and
    trailing blank lines go. Leading text is kept: upstream sometimes starts a turn with a
    newline, and that does not change the meaning either, so it goes too.
    """
    # Each pass only where its characters occur: most turns have no escape, CR or trailing space.
    if "\x1b" in text or "\x07" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    # One line (a third of real turns): its trailing whitespace is the text's own. A line of an ASCII
    # text ends in whitespace only at one of those.
    if "\n" not in text or (text.isascii() and not _rare_space(text) and not _space_before_break(text)):
        return text.strip()
    return _stripped_lines(text)


def clean_texts(texts: Sequence[str]) -> list[str]:
    """`clean_text` of each text, its tests that hold for nearly every text run once over them all,
    joined (a call per test and text costs more than the scans): escape codes, CR and the rare
    spaces; then, for each text, whether a line of it may end in a space. Joined texts that pass
    that test too are only stripped. A line break in one text and a space ending the one before may
    meet in the joined text: such texts are tested one by one."""
    joined = "".join(texts)
    if "\x1b" in joined or "\x07" in joined or "\r" in joined or _rare_space(joined):
        return list(map(clean_text, texts))
    if joined.isascii() and not _space_before_break(joined):
        return [text.strip() for text in texts]
    return [text.strip() if "\n" not in text or (text.isascii() and not _space_before_break(text))
            else _stripped_lines(text) for text in texts]


# Not frozen: normalize builds one for most assistant turns, and a frozen dataclass's __init__
# (object.__setattr__ per field) costs three times a plain one's. Nothing changes one once built (the
# parse cache hands the same one to every caller).
@dataclass
class ParsedTurn:
    thought: str
    action: str | None
    dialect: str


class ParseError(ValueError):
    """The assistant turn follows none of the known dialects."""


@dataclass(frozen=True)
class Dialect:
    name: str
    parse: Callable[[str], ParsedTurn | None]
    render: Callable[[str, str | None], str]
    # Keywords this dialect's prompts use for the thought and the action; the react rendering
    # rewrites them to Think/Act in the instruction turns.
    prompt_keywords: tuple[tuple[str, str], ...] = ()
    # (thought marker, action marker) that open a line of a turn; None for a part without a
    # marker, and no markers at all for JSON tool calls (the rewards check those by parsing). A turn
    # of a dialect with both starts with one of them; one with an action marker contains it.
    markers: tuple[str | None, str] | None = None
    # A text every turn of the dialect contains besides its markers ("" for none): a turn without it is
    # not tried.
    needle: str = ""


def _joined(head: str, thought: str, sep: str, marker: str, action: str) -> str:
    return f"{head}{thought}{sep}{marker}{action}" if thought else f"{marker}{action}"


def _marker_dialect(name: str, thought_head: str, action_pattern: str, head: str, sep: str, marker: str,
                    keywords: tuple[tuple[str, str], ...], action_marker: str | None = None,
                    needle: str | None = None) -> Dialect:
    """A dialect of the shape `[<thought head> thought \n] <action marker> action`.

    The thought is optional (upstream has turns with only an action) and runs up to a line break as
    in `_PROSE_ACTION`; `action_pattern` must capture the action, in its environment's syntax, as
    group `action`. `action_marker` is the marker where the action keeps its own (`Final Answer:`),
    the rendered marker otherwise. `needle` is a text `action_pattern` needs besides the marker
    (`Action Input:`): a turn without it is not searched.
    """
    # The turn is `^(?:{thought_head}(?P<thought>.*?)\n\s*)?{action_pattern}$` (re.S), matched in two
    # steps: after the head, a search for the first line break from which the action runs to the end
    # (the thought ends there, as `.*?` would end it), else the action alone. A search jumps between
    # line breaks; `.*?` tries the rest of the pattern after every character, ~5x slower on real turns.
    thought_start = re.compile(thought_head)
    action_after = re.compile(rf"\n\s*{action_pattern}$", re.S)
    action_alone = re.compile(rf"{action_pattern}$", re.S)
    markers = (head.strip(), action_marker or marker.strip())
    needed = needle or markers[1]
    # `thought_head` and `action_pattern` start with these markers (held by tests/ingest/test_dialects.py):
    # a turn that starts with neither is not tried (prose, `Action:` later), nor one without the action
    # marker (or the needle). The start is tested first: it costs no scan of the turn.

    def parse(text: str) -> ParsedTurn | None:
        if not text.startswith(markers) or needed not in text:
            return None
        head_match = thought_start.match(text)
        found = action_after.search(text, head_match.end()) if head_match else None
        if found is not None:
            return ParsedTurn(text[head_match.end():found.start()].strip(), found["action"].strip(), name)
        m = action_alone.match(text)
        return ParsedTurn("", m["action"].strip(), name) if m else None

    def render(thought: str, action: str | None) -> str:
        return _joined(head, thought, sep, marker, action or "")

    return Dialect(name, parse, render, keywords, markers, needed)


_THOUGHT_ACTION_WORDS = (("Thought:", "Think:"), ("Action:", "Act:"))
# (name, thought head, action pattern, rendered head, separator, rendered action marker, prompt keywords
#  [, action marker when the action carries its own])
_MARKER_DIALECTS = [
    # AgentBench OS, and our react rendering.
    ("think_act", r"Think:[ \t]*", r"Act:[ \t]*(?P<action>\S.*)", "Think: ", "\n\n", "Act: ",
     (("Think:", "Think:"), ("Act:", "Act:"))),
    # AgentInstruct ALFWorld.
    ("upper_thought_action", r"THOUGHT:[ \t]*", r"ACTION:[ \t]*(?P<action>\S.*)", "THOUGHT: ", "\n", "ACTION: ",
     (("THOUGHT", "Think"), ("ACTION", "Act"))),
    # AgentGym block style: Thought:\n...\n\nAction:\n... A cleaned turn has no space before a line break:
    # its action marker is then `Action:\n` (the other Thought/Action turns are not tried).
    ("thought_action_block", r"Thought:[ \t]*\n", r"Action:[ \t]*\n(?P<action>.*\S.*)", "Thought:\n", "\n\n",
     "Action:\n", _THOUGHT_ACTION_WORDS, None, "Action:\n"),
    # AgentGym tool envs: Action: X with Action Input: {...}
    ("action_input", r"Thought:[ \t]*", r"Action:[ \t]*(?P<action>[\w.\-]+ with Action Input:.*)", "Thought: ",
     "\n\n", "Action: ", _THOUGHT_ACTION_WORDS, None, " with Action Input:"),
    # ToolBench ReAct: Action: api\nAction Input: {...}
    ("toolbench_react", r"Thought:[ \t]*", r"Action:[ \t]*(?P<action>[\w.\-]+[ \t]*\nAction Input:.*)", "Thought: ",
     "\n", "Action: ", _THOUGHT_ACTION_WORDS, None, "\nAction Input:"),
    # Mind2Web multiple choice: Answer: B.\nAction: CLICK
    ("choice_action", r"Thought:[ \t]*", r"(?P<action>Answer:[ \t]*\S.*)", "Thought: ", "\n", "",
     (("Thought:", "Think:"),), "Answer:"),
    # AgentInstruct KG final turn.
    ("final_answer", r"Thought:[ \t]*", r"(?P<action>Final Answer:[ \t]*\S.*)", "Thought: ", "\n", "",
     _THOUGHT_ACTION_WORDS, "Final Answer:"),
    # One line each: AgentInstruct KG, ALFWorld in AgentGym, SQL blocks in SQLGym.
    ("thought_action", r"Thought:[ \t]*", r"Action:[ \t]*(?P<action>\S.*)", "Thought: ", "\n", "Action: ",
     _THOUGHT_ACTION_WORDS),
]


# --- free prose then Action: Operation + ```sql / Action: Answer + Final Answer (DBBench) ----
# `^(?P<thought>.*?)\n\s*Action:[ \t]*(?P<action>\S.*)$` (re.S), matched as the marker dialects are: the
# first line break followed by the action marker and an action ends the thought. The thought ends at a
# line break and may keep the spaces before it, which the parse strips; the action starts at the same
# place either way (tests/ingest/test_dialects.py).
_PROSE_ACTION = re.compile(r"\n\s*Action:[ \t]*(?=\S)")


def _parse_prose_action(text: str) -> ParsedTurn | None:
    if text.startswith("Thought:"):
        return None
    m = _PROSE_ACTION.search(text)
    if not m or text.find("Action:", 0, m.start()) >= 0:
        return None
    return ParsedTurn(text[:m.start()].strip(), text[m.end():].strip(), "prose_action")


def _render_prose_action(thought: str, action: str | None) -> str:
    return _joined("", thought, "\n", "Action: ", action or "")


# --- JSON tool call {"goal", "Tool", "Param"} (Agent-FLAN toolbench_instruct_j1s1) ------------
def _parse_json_tool(text: str) -> ParsedTurn | None:
    if "{" not in text:
        return None
    body = text.strip()
    if body.startswith("```"):
        body = re.sub(r"^```\w*\n|\n?```$", "", body).strip()
    if not body.startswith("{"):
        return None
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or "Tool" not in call:
        return None
    thought = call.pop("goal", "") or ""
    if not isinstance(thought, str):
        return None
    return ParsedTurn(thought.strip(), json.dumps(call, ensure_ascii=False), "json_tool")


def _render_json_tool(thought: str, action: str | None) -> str:
    call = json.loads(action or "{}")
    if thought:
        call = {**call, "goal": thought}
    return json.dumps(call, ensure_ascii=False, indent=4)


# --- prose + ```python {'name': ..., 'parameters': ...}``` (Agent-FLAN tflan / cot) ----------
_PY_CALL = re.compile(r"^(?P<thought>.*?)\s*```(?:python|json)?\n(?P<call>\{.*\})\s*\n```$", re.S)


def _parse_dict_call(text: str) -> ParsedTurn | None:
    # Every match of _PY_CALL contains one of these openings; a turn with none is not tried (SQL blocks
    # are many). Written out: a generator over them costs more than the searches.
    opens = "{" in text and "\n{" in text and ("```\n{" in text or "```python\n{" in text or "```json\n{" in text)
    m = _PY_CALL.match(text) if opens else None
    if not m:
        return None
    try:
        call = ast.literal_eval(m["call"])
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(call, dict) or "name" not in call:
        return None
    return ParsedTurn(m["thought"].strip(), m["call"].strip(), "dict_tool_call")


def _render_dict_call(thought: str, action: str | None) -> str:
    return _joined("", thought, "\n", "```python\n", f"{action}\n```")


# Most specific first: a Think/Act turn also contains "Act:", an Action-Input turn is also a
# Thought/Action turn, and prose_action would swallow anything with "Action:" in it.
DIALECTS: Registry[Dialect] = Registry("dialect", {d.name: d for d in [
    Dialect("json_tool", _parse_json_tool, _render_json_tool, needle="{"),
    Dialect("dict_tool_call", _parse_dict_call, _render_dict_call, needle="\n{"),
    *(_marker_dialect(*spec) for spec in _MARKER_DIALECTS),
    Dialect("prose_action", _parse_prose_action, _render_prose_action, (("Action:", "Act:"),), (None, "Action:")),
]})

# Turns with no action: the acknowledgement after the instructions ("Ok.") and a final reply in
# plain prose (ToolBench CoT). Whether they are allowed where they stand is the validator's call.
FREE_TEXT = "free_text"


def parse_turn(text: str) -> ParsedTurn:
    """Parse one assistant turn, cleaned first (`clean_text`). Never raises on prose: returns dialect
    `free_text`."""
    return parse_cleaned_turn(clean_text(text))


class _DialectsByStart:
    """The dialects a turn may be, in the registry's order, by the start marker it opens with: one
    lookup, not a test per dialect. A turn of a dialect with both markers starts with one of them, one
    with only an action marker contains it, and each contains its needle: a dialect is listed with the
    text the turn must contain, tested before its parse (cheaper than a call). A start marker ends in
    its one colon, so it is the turn's text up to its first colon. Built again when a dialect is
    registered."""

    def __init__(self, dialects: Registry[Dialect]):
        self.dialects = dialects.values()  # a view: it sees a dialect registered later
        self._build()

    def _build(self) -> None:
        starts = {m for d in self.dialects if d.markers and d.markers[0] for m in d.markers}
        if any(m.find(":") != len(m) - 1 for m in starts):
            raise ValueError(f"a start marker must end in its only colon: {sorted(starts)}")
        self.longest = max(map(len, starts), default=0)
        self.by_start = {start: self._tried(start) for start in starts}
        self.unmarked = self._tried(None)
        self.registered = len(self.dialects)

    def _tried(self, start: str | None) -> tuple[tuple[str, Callable[[str], ParsedTurn | None]], ...]:
        tried = []
        for d in self.dialects:
            if d.markers is None or d.markers[0] is None:
                tried.append((d.needle or (d.markers[1] if d.markers else ""), d.parse))
            elif start in d.markers:
                tried.append((d.needle, d.parse))
        return tuple(tried)

    def of(self, text: str) -> tuple[tuple[str, Callable[[str], ParsedTurn | None]], ...]:
        if self.registered != len(self.dialects):
            self._build()
        # No colon: text[:0], no start marker.
        return self.by_start.get(text[:text.find(":", 0, self.longest) + 1], self.unmarked)


# A bound method, called as a function: an instance's __call__ is looked up on each call.
_dialects_by_start = _DialectsByStart(DIALECTS).of


# A turn read again soon after (an acknowledgement, a validated record's turn) is a lookup. Bounded,
# so memory stays a few turns deep.
@functools.lru_cache(maxsize=256)
def parse_cleaned_turn(text: str) -> ParsedTurn:
    """`parse_turn` of a text `clean_text` already cleaned (normalize cleans each turn once)."""
    if not text:
        raise ParseError("empty assistant turn")
    for needle, parse in _dialects_by_start(text):
        if needle in text:
            parsed = parse(text)
            if parsed is not None:
                return parsed
    return ParsedTurn(text, None, FREE_TEXT)


# The final answer in a terminal action, per benchmark action syntax.
_ANSWER_PATTERNS = (
    re.compile(r"^answer\((?P<a>.*)\)$", re.S),                      # AgentBench OS
    re.compile(r"Final Answer:\s*(?P<a>.+)$", re.S),                   # DBBench, KG
    re.compile(r"^finish with Action Input:\s*(?P<a>\{.*\})$", re.S),  # AgentGym tool envs
)


def parse_literal(text: str, expected: type | tuple[type, ...]) -> object | None:
    """`text` as a JSON value, or as the Python literal some upstream rows write instead; None unless it
    parses to an `expected` (dict for tool arguments, list or tuple for answers)."""
    for parse in (json.loads, ast.literal_eval):
        try:
            value = parse(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        return value if isinstance(value, expected) else None
    return None


def parse_answer_list(text: str) -> list | None:
    """A final answer written as a list: JSON (`[null]`, `[true]`, `[1.5e3]`) or Python (`[None]`,
    the tuple `(1, 2)`), as a list; None when it is no list. The one parser every reader of a final
    answer uses (grammars, the DB env, rewards, DB scoring). Only a bracketed text is a list: `1,000`
    is a number, not the tuple Python would make of it."""
    text = text.strip()
    value = parse_literal(text, (list, tuple)) if text.startswith(("[", "(")) else None
    return None if value is None else list(value)


def extract_answer(action: str | None, dialect: str) -> str | None:
    """The final answer a terminal action gives, in plain text (None when it gives none)."""
    if action is None:
        return None
    for pattern in _ANSWER_PATTERNS:
        m = pattern.search(action)
        if m:
            answer = m["a"].strip()
            if answer.startswith("{"):
                try:
                    value = json.loads(answer).get("answer")
                except (json.JSONDecodeError, AttributeError):
                    return answer
                return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            return answer
    if dialect == "toolbench_react" and action.split("\n", 1)[0].strip() == "Finish":
        m = re.search(r'"final_answer"\s*:\s*"(?P<a>(?:[^"\\]|\\.)*)"', action)
        return m["a"] if m else None
    return None


def render_turn(dialect: str, thought: str, action: str | None) -> str:
    """Canonical text of a turn in a dialect; `free_text` turns are their thought."""
    if dialect == FREE_TEXT or action is None:
        return thought
    return DIALECTS[dialect].render(thought, action)


def render_react(thought: str, action: str | None) -> str:
    """The react rendering: `Think: ...\\nAct: ...` whatever the upstream dialect."""
    if action is None:
        return thought
    return f"Think: {thought}\nAct: {action}" if thought else f"Act: {action}"
