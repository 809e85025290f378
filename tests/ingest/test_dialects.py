"""One test per upstream dialect, and parse/render round-trips on every real assistant turn."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES
from trajforge.pipeline.ingest.dialects import (
    _MARKER_DIALECTS,
    DIALECTS,
    FREE_TEXT,
    ParseError,
    clean_text,
    clean_texts,
    parse_turn,
    render_react,
    render_turn,
)
from trajforge.sources import iter_rows
from trajforge.sources.base import find_data_files

CASES = {
    "think_act": ("Think: To count the files in /etc, I need to print all the files in it.\n\nAct: bash\n\n```bash\nls /etc\n```",
                  "To count the files in /etc, I need to print all the files in it.", "bash\n\n```bash\nls /etc\n```"),
    "upper_thought_action": ("THOUGHT: I'll start by looking around.\nACTION: go to shelf 1",
                             "I'll start by looking around.", "go to shelf 1"),
    "thought_action_block": ("Thought:\nI should search.\n\nAction:\nsearch[red shirt]", "I should search.", "search[red shirt]"),
    "action_input": ('Thought: I need the movie id.\n\nAction: get_search_movie with Action Input: {"movie_name": "Pulp Fiction"}',
                     "I need the movie id.", 'get_search_movie with Action Input: {"movie_name": "Pulp Fiction"}'),
    "toolbench_react": ('Thought: convert it.\nAction: currency.convert\nAction Input: {"amount": 100}',
                        "convert it.", 'currency.convert\nAction Input: {"amount": 100}'),
    "choice_action": ("Thought: The maximum budget needs to be set.\nAnswer: C.\nAction: SET\nValue: $50,000",
                      "The maximum budget needs to be set.", "Answer: C.\nAction: SET\nValue: $50,000"),
    "final_answer": ("Thought: #2 is the final answer to the question.\nFinal Answer: #2", "#2 is the final answer to the question.",
                     "Final Answer: #2"),
    "thought_action": ("Thought: From the above relations, I might use it.\nAction: get_neighbors(Kerosene, fuel.engines)",
                       "From the above relations, I might use it.", "get_neighbors(Kerosene, fuel.engines)"),
    "prose_action": ('The answer is Phone.\nAction: Answer\nFinal Answer: ["Phone"]', "The answer is Phone.",
                     'Answer\nFinal Answer: ["Phone"]'),
    "json_tool": ('{\n    "Tool": "weather.forecast",\n    "Param": {\n        "lat": 25.7\n    },\n    "goal": "retry the call"\n}',
                  "retry the call", '{"Tool": "weather.forecast", "Param": {"lat": 25.7}}'),
    "dict_tool_call": ("I call the health API. As a Python dictionary:\n```python\n{'name': 'x.health', 'parameters': {}}\n```",
                       "I call the health API. As a Python dictionary:", "{'name': 'x.health', 'parameters': {}}"),
}


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_each_dialect_parses_and_renders(dialect):
    text, thought, action = CASES[dialect]
    parsed = parse_turn(text)
    assert (parsed.dialect, parsed.thought, parsed.action) == (dialect, thought, action)
    again = parse_turn(render_turn(dialect, thought, action))
    assert (again.dialect, again.thought, again.action) == (dialect, thought, action)
    react = parse_turn(render_react(thought, action))
    assert (react.dialect, react.thought, react.action) == ("think_act", thought, action)


def test_a_marker_dialects_regex_starts_with_its_markers():
    """A marker dialect tries its anchored regex only on a turn that starts with its thought or its
    action marker: each regex's two ways to start are those markers, as plain text."""
    for name, thought_head, action_pattern, *_ in _MARKER_DIALECTS:
        for marker, pattern in zip(DIALECTS[name].markers, (thought_head, action_pattern.removeprefix("(?P<action>"))):
            assert pattern.startswith(marker) and re.escape(marker).replace("\\ ", " ") == marker, name


def _spaced_thought_parse(text: str, thought_end: str = r"\s*\n") -> tuple[str, str | None, str]:
    """The oracle for the thought's end: the dialects as one anchored regex each, the thought ending
    lazily at `thought_end` (by default `.*?\\s*\\n`: the spaces before the line break left out of
    the thought), tried in the registry's order as parse_turn does."""
    text = clean_text(text)
    for name in DIALECTS:
        spec = next((s for s in _MARKER_DIALECTS if s[0] == name), None)
        if spec is not None:
            m = re.match(rf"^(?:{spec[1]}(?P<thought>.*?){thought_end}\s*)?{spec[2]}$", text, re.S)
        elif name == "prose_action" and not text.startswith("Thought:"):
            m = re.match(rf"^(?P<thought>.*?){thought_end}\s*Action:[ \t]*(?P<action>\S.*)$", text, re.S)
            m = m if m and "Action:" not in m["thought"] else None
        else:
            parsed = DIALECTS[name].parse(text)
            if parsed is not None:
                return parsed.thought, parsed.action, name
            continue
        if m:
            return (m["thought"] or "").strip(), m["action"].strip(), name
    return text, None, FREE_TEXT


def test_the_thought_ends_where_the_spaced_form_ends_it():
    """The dialects' regexes end the thought at a line break and strip it: the same thought, action and
    dialect as the form that leaves the spaces before the line break out, on every real turn."""
    crafted = ["Thought:\nA plan.\n\n\nAction:\nsearch[x]\n\nAction:\nclick[y]", "Thought: a \t\n \n  Action: b\nAction: c",
               "I plan.\n\nAction: one\nmore\nAction: two", "THOUGHT: x\n\u3000\nACTION: y", "Think: a\n\nAct: b\nAct: c", "Plan first. Action: x"]
    for text in [*_real_assistant_turns(), *crafted]:
        parsed = parse_turn(text)
        assert (parsed.thought, parsed.action, parsed.dialect) == _spaced_thought_parse(text), text[:200]


def test_the_two_step_match_is_the_one_anchored_regex():
    """Each dialect finds its thought's end by a search for the action after a line break: the same
    parse as its one anchored regex with a lazy thought (`^(?:head(?P<thought>.*?)\\n\\s*)?action$`) on
    random turns made of the dialects' markers, line breaks, spaces and words."""
    pieces = ["Thought:", "THOUGHT:", "Think:", "Action:", "ACTION:", "Act:", "Answer:", "Final Answer:", "Action Input:",
              " with Action Input:", "Operation", "\n", "\n\n", " ", "\t", "\u3000", "x", "go.to", "{}", "[1]", "a b"]
    rng = random.Random(3)
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))) for _ in range(30000)]
    checked = [t for t in texts if clean_text(t)]
    for text in checked:
        parsed = parse_turn(text)
        assert (parsed.thought, parsed.action, parsed.dialect) == _spaced_thought_parse(text, r"\n"), repr(text)
    assert {parse_turn(t).dialect for t in checked} >= set(DIALECTS) - {"json_tool", "dict_tool_call"}


def test_no_thought_turns_and_trailing_spaces_and_leading_newline():
    assert parse_turn("Action: go to drawer 1 ").action == "go to drawer 1"
    assert parse_turn("Action: go to drawer 1 ").thought == ""
    movie_118 = '\nAction: finish with Action Input: {"answer": "x"}'
    parsed = parse_turn(movie_118)
    assert (parsed.dialect, parsed.thought) == ("action_input", "")


def test_terminal_escape_codes_are_removed():
    raw = "The output of the OS:\n\n\x1b]0;root@287e51facd12: /\x07root@287e51facd12:/# \x1b[K"
    assert clean_text(raw) == "The output of the OS:\n\nroot@287e51facd12:/#"


def _clean_line_by_line(text: str) -> str:
    """The cleaning rule as the docstring states it, one pass per step: the oracle for clean_text's
    shortcuts (passes skipped where their characters do not occur)."""
    text = re.sub(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]|\x07", "", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip()


def test_clean_text_matches_the_line_by_line_rule_on_every_kind_of_space():
    spaces = [c for c in map(chr, range(0x3001)) if c.isspace()]
    alphabet = [*spaces, "a", "\u00e9", "\x1b", "[", "m", "]", "\x07", "\\"]
    rng = random.Random(7)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(20000)]
    texts += [f"x{space}\ny" for space in spaces] + [f"x{space}" for space in spaces]
    mismatched = [t for t in texts if clean_text(t) != _clean_line_by_line(t)]
    assert not mismatched, mismatched[:5]


def test_clean_texts_cleans_each_text_as_clean_text_does():
    # Texts of one row share the tests made on them joined: one text's trailing space meeting the next
    # one's line break, a rare space or an escape code in one text, ASCII and other texts mixed.
    rng = random.Random(11)
    alphabet = ["a", "b", " ", "\t", "\n", "\u00e9", "\u3000", "\xa0", "\x0b", "\x1f", "\x1b", "[", "m", "\r"]
    plain = ["a", "b", " ", "\n", "x y\nz"]
    groups = [[], [""], ["a ", "\nb"], ["a\t", "\nb"], ["x\u3000\ny", "a b"], ["a \nb", "c\nd"], ["\u00e9\u3000\nx", "a\nb"]]
    for _ in range(5000):
        letters = alphabet if rng.random() < 0.3 else plain
        groups.append(["".join(rng.choice(letters) for _ in range(rng.randint(0, 10))) for _ in range(rng.randint(1, 6))])
    mismatched = [g for g in groups if clean_texts(g) != [clean_text(t) for t in g]]
    assert not mismatched, mismatched[:5]


def test_prose_without_action_is_free_text_and_empty_turn_raises():
    assert parse_turn("Ok.").dialect == FREE_TEXT
    assert parse_turn("Ok.").action is None
    with pytest.raises(ParseError):
        parse_turn(" \x1b[K ")


def _real_assistant_turns():
    sources = dict(FIXTURE_SOURCES, agent_flan=str(AGENT_FLAN))
    for location in sources.values():
        for path in find_data_files(Path(location)):
            for raw in iter_rows(path):
                if raw.row is None:
                    continue
                turns = raw.row.get("conversations", raw.row.get("conversation"))
                if isinstance(turns, str):
                    turns = json.loads(turns)
                for turn in turns or []:
                    if turn.get("from", turn.get("role")) in ("gpt", "assistant"):
                        yield turn.get("value", turn.get("content"))


def test_round_trip_on_every_real_assistant_turn():
    turns = list(_real_assistant_turns())
    assert len(turns) > 1000
    dialects_seen = set()
    for text in turns:
        parsed = parse_turn(text)
        dialects_seen.add(parsed.dialect)
        again = parse_turn(render_turn(parsed.dialect, parsed.thought, parsed.action))
        assert (again.thought, again.action) == (parsed.thought, parsed.action), text[:200]
        if parsed.action is not None:
            react = parse_turn(render_react(parsed.thought, parsed.action))
            assert (react.dialect, react.thought, react.action) == ("think_act", parsed.thought, parsed.action), text[:200]
    # Every registered dialect occurs in real (or documented-layout) data.
    assert set(DIALECTS) <= dialects_seen
