"""Env grammars and episode-end rules on the real fixture rows: every real action passes its env's
grammar except the real defects, each rule catches a real action edited to break it, and the
episode-end and outcome rules catch the trajectories they are for."""
from __future__ import annotations

import copy
import json

import pytest

from tests.support.oracles import make_negatives
from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES
from trajforge.pipeline.envs.grammar import (
    _AGENTGYM_TOOL_LIST,
    Context,
    _python_as_json,
    _tool_listings,
    offered_tools,
    parse_arguments,
    tool_call,
)
from trajforge.pipeline.ingest.dialects import parse_literal
from trajforge.pipeline.ingest.grammars import GRAMMARS, grammar_for
from trajforge.pipeline.ingest.normalize import NormalizeError, normalize_row
from trajforge.pipeline.ingest.validate import ValidateConfig, action_contexts, validate_record
from trajforge.pipeline.quality.negatives import NEGATIVE_TYPES, NegativesConfig
from trajforge.sources import get_source, iter_rows
from trajforge.sources.agentinstruct import SPLITS
from trajforge.sources.agenttraj_l import ENVS
from trajforge.sources.synthetic import DOMAINS

# The real actions no env accepts: (record id, turn) -> rule.
REAL_DEFECTS = {
    ("agentinstruct/alfworld_53", 55): "alfworld.command",     # `End of the task.` -> Nothing happens.
    ("agentinstruct/alfworld_53", 63): "alfworld.command",
    ("agentinstruct/mind2web_46", 1): "mind2web.operation",    # `Action: SET`
    ("agenttraj_l/textcraft_251", 5): "textcraft.arguments",   # `get end stone brick stairs` -> Could not execute
    # textcraft_205 writes prose where the action goes (its row is quarantined as unparsed first).
    ("agenttraj_l/textcraft_205", 13): "textcraft.command",
    ("agenttraj_l/textcraft_205", 15): "textcraft.command",
    ("agenttraj_l/textcraft_205", 19): "textcraft.command",
}


@pytest.fixture(scope="module")
def records() -> dict[str, dict]:
    """Every fixture row, normalized (also the ones validation quarantines), first copy of each id."""
    out: dict[str, dict] = {}
    for name, location in FIXTURE_SOURCES.items():
        source = get_source(name)
        for f in source.files(location):
            for raw in iter_rows(f.path, f.path.name):
                record = normalize_row(raw.row, source, f.split, f.path.name, raw.index)
                out.setdefault(record["id"], record)
    return out


def test_every_env_we_ingest_or_synthesize_has_a_grammar():
    envs = {env for _, env in SPLITS.values()} | {env for _, env in ENVS.values()} | set(DOMAINS) | {"toolbench"}
    # WebArena is synthesis-only and eval-only upstream; its grammar is not sourced (pipeline/ingest/grammars.py).
    assert envs - set(GRAMMARS) == {"webarena"}
    for grammar in GRAMMARS.values():
        assert grammar.source and grammar.rules


def test_every_real_fixture_action_passes_its_grammar(records):
    breaches, checked = {}, 0
    for record in records.values():
        grammar = grammar_for(record["env"])
        for i, turn, context in action_contexts(record):
            checked += 1
            breach = grammar.check(turn["action"], context)
            if breach is not None:
                breaches[(record["id"], i)] = breach.rule
    assert checked > 900
    assert breaches == REAL_DEFECTS


# (record id, a real action of it, the action edited to break one rule, that rule)
BREAKS = [
    ("agentinstruct/alfworld_155", "take spraybottle 1 from shelf 1", "grab spraybottle 1 from shelf 1",
     "alfworld.command"),
    ("agentinstruct/alfworld_155", "take spraybottle 1 from shelf 1", "take spraybottle from shelf 1",
     "alfworld.arguments"),
    ("openmanus_rl/look_at_obj_in_light-AlarmClock-None-DeskLamp-301_trial_T20190907_174127_043461",
     "go to desk 1", "go to desk 2", "alfworld.available"),
    ("agentinstruct/webshop_330", "search[on-ear headphone noise cancelling price < 180.00]",
     "find[on-ear headphone noise cancelling price < 180.00]", "webshop.command"),
    ("agentinstruct/webshop_330", "search[on-ear headphone noise cancelling price < 180.00]", "search[ ]",
     "webshop.arguments"),
    ("agentinstruct/webshop_330", "click[Buy Now]", "click[Add to Cart]", "webshop.click_target"),
    ("agentinstruct/mind2web_96", "Answer: B.\nAction: CLICK", "B. CLICK", "mind2web.syntax"),
    ("agentinstruct/mind2web_96", "Answer: B.\nAction: CLICK", "Answer: Q.\nAction: CLICK", "mind2web.choice"),
    ("agentinstruct/mind2web_96", "Answer: B.\nAction: CLICK", "Answer: B.\nAction: PRESS", "mind2web.operation"),
    ("agentinstruct/mind2web_96", "Answer: B.\nAction: CLICK", "Answer: B.\nAction: TYPE", "mind2web.value"),
    ("agentinstruct/kg_132", "get_relations(Fair division)", "get_relation(Fair division)", "kg.function"),
    ("agentinstruct/kg_132", "get_neighbors(Fair division, base.gametheory.game_theory_game.class_of_game)",
     "get_neighbors(Fair division)", "kg.arguments"),
    ("agentinstruct/kg_132", "get_relations(rock paper scissors)", "get_relations(#5)", "kg.variable"),
    ("agentinstruct/kg_132", "Final Answer: #2", "Final Answer: rock paper scissors", "kg.final_answer"),
    ("agentinstruct/os_42", "bash\n\n```bash\nls /etc\n```", "shell\n\n```bash\nls /etc\n```", "os.command"),
    ("agentinstruct/os_42", "bash\n\n```bash\nls /etc\n```", "bash ls /etc", "os.bash_block"),
    ("agentinstruct/os_42", "answer(220)", "answer(220", "os.answer"),
    ("agentinstruct/db_100", None, "Execute\n```sql\nSELECT 1\n```", "db.command"),
    ("agentinstruct/db_100", None, "Operation\nINSERT INTO Books VALUES ('x')", "db.sql_block"),
    ("agentinstruct/db_100", None, "Answer\nThe Great Gatsby was inserted", "db.final_answer"),
    ("agenttraj_l/babyai_320", None, "grab grey key 1", "babyai.command"),
    ("agenttraj_l/babyai_320", None, "pickup key", "babyai.arguments"),
    ("agenttraj_l/sciworld_2200", "connect battery anode to blue wire terminal 1",
     "attach battery anode to blue wire terminal 1", "sciworld.command"),
    ("agenttraj_l/sciworld_2200", "connect battery anode to blue wire terminal 1", "connect battery anode",
     "sciworld.arguments"),
    ("agenttraj_l/textcraft_205", "get 1 green dye", "fetch 1 green dye", "textcraft.command"),
    ("agenttraj_l/textcraft_205", "get 1 green dye", "get green dye", "textcraft.arguments"),
    ("agenttraj_l/lmrlgym_maze_18", None, "move diagonally", "maze.command"),
    ("agenttraj_l/lmrlgym_wordle_0", None, "could", "wordle.guess"),
    ("agenttraj_l/sqlgym_15", None, "SELECT 1", "sqlgym.sql_block"),
    ("openmanus_rl/todo_118", 'get_projects with Action Input: {}', 'get_projects({})', "tool.syntax"),
    ("openmanus_rl/todo_118", 'get_projects with Action Input: {}', 'get_all_projects with Action Input: {}',
     "tool.unknown_tool"),
    ("openmanus_rl/todo_118", 'get_projects with Action Input: {}', 'get_projects with Action Input: {"a": ',
     "tool.arguments"),
    ("openmanus_rl/todo_118", 'get_projects with Action Input: {}', 'get_projects with Action Input: {"limit": 5}',
     "tool.parameters"),
]


def _context_of(record: dict, action: str | None):
    """The context of the turn that holds `action` (or of the first trained action)."""
    return next((turn, context) for _, turn, context in action_contexts(record)
                if (turn["action"] == action if action else turn["loss"]))


@pytest.mark.parametrize("record_id,action,edited,rule", BREAKS, ids=[b[3] for b in BREAKS])
def test_a_real_action_edited_to_break_a_rule_fails_with_it(records, record_id, action, edited, rule):
    record = records[record_id]
    grammar = grammar_for(record["env"])
    turn, context = _context_of(record, action)
    assert grammar.check(turn["action"], context) is None
    breach = grammar.check(edited, context)
    assert breach is not None and breach.rule == rule, breach


def test_the_table_covers_every_rule():
    assert {b[3] for b in BREAKS} == {rule for g in GRAMMARS.values() for rule in g.rules}


def test_toolbench_calls_must_name_an_offered_api(records):
    record = records["openmanus_rl/AgentFlan_toolbench_instruct_j1s1_3k_2053"]
    grammar = grammar_for("toolbench")
    turn, context = _context_of(record, None)
    assert grammar.check(turn["action"], context) is None
    invented = turn["action"].replace("get_120_hour_forecast_for_weather", "get_tomorrow_for_weather")
    assert grammar.check(invented, context).rule == "tool.unknown_tool"


def test_the_issue_cases_are_caught(records):
    for db in ("agentinstruct/db_291", "agentinstruct/db_314"):
        violation = validate_record(records[db])
        assert violation.reason == "incomplete_episode" and "Operation" in violation.detail, violation
    # `End of the task.` mid-episode: ALFWorld answered `Nothing happens.`, the agent recovered. Masked
    # by default; under `invalid_steps: drop` the record goes, naming the action and the rule.
    assert validate_record(records["agentinstruct/alfworld_53"]) is None
    violation = validate_record(records["agentinstruct/alfworld_53"], ValidateConfig(invalid_steps="drop"))
    assert violation.reason == "invalid_action" and violation.rule == "alfworld.command"
    assert "End of the task." in violation.detail and "alfworld.command" in violation.detail


def _drop_final_exchange(record: dict) -> dict:
    r = copy.deepcopy(record)
    del r["conversations"][-2:]
    r["answer"] = None
    return r


@pytest.mark.parametrize("record_id", ["agentinstruct/os_42", "agentinstruct/kg_132", "agentinstruct/db_279",
                                       "openmanus_rl/todo_118"])
def test_terminal_action_envs_must_end_with_it(records, record_id):
    record = records[record_id]
    assert validate_record(record) is None
    cut = _drop_final_exchange(record)
    violation = validate_record(cut)
    assert violation is not None and violation.reason == "incomplete_episode", violation


def test_self_ending_envs_need_an_action_at_the_end(records):
    record = records["agentinstruct/webshop_330"]
    assert validate_record(_drop_final_exchange(record)) is None  # WebShop ends on its own
    r = copy.deepcopy(record)
    r["conversations"][-1].update(content="I am done.", thought="I am done.", action=None, dialect="free_text",
                                  loss=False)
    assert validate_record(r).reason == "incomplete_episode"


def test_tool_use_ends_with_finish_a_prose_reply_or_a_single_call(records):
    for record_id in ("openmanus_rl/AgentFlan_toolbench_tflan_cot_30p_6770",
                      "openmanus_rl/AgentFlan_toolbench_instruct_j1s1_3k_2053"):
        assert validate_record(records[record_id]) is None
    cut = copy.deepcopy(records["openmanus_rl/AgentFlan_toolbench_tflan_cot_30p_6770"])
    del cut["conversations"][-2:]
    assert validate_record(cut).reason == "incomplete_episode"


@pytest.mark.parametrize("success,reward,meta_reward,valid", [
    (True, 1.0, 1.0, True), (None, None, None, True), (False, 0.0, None, False), (True, 0.0, None, False),
    (True, 1.0, 0.5, False)])
def test_outcome_fields_are_consistent(records, success, reward, meta_reward, valid):
    r = copy.deepcopy(records["agentinstruct/os_42"])
    meta = json.loads(r["meta"])
    if meta_reward is not None:
        meta["reward"] = meta_reward
    r.update(success=success, reward=reward, meta=json.dumps(meta))
    violation = validate_record(r)
    assert (violation is None) if valid else (violation.reason == "outcome_mismatch"), violation


def test_invalid_action_negatives_break_the_rule_they_name(records):
    positives = [r for r in records.values() if r["kind"] == "positive" and validate_record(r) is None]
    config = NegativesConfig(rates={**dict.fromkeys(NEGATIVE_TYPES, 0.0), "invalid_action": 1.0})
    negatives = make_negatives(positives, config)
    assert {n["env"] for n in negatives} == {r["env"] for r in positives}
    rules = set()
    for negative in negatives:
        rule = json.loads(negative["meta"])["grammar_rule"]
        violation = validate_record({**negative, "kind": "positive", "negative_type": None, "parent_id": None})
        assert violation.reason == "invalid_action" and violation.rule == rule, (negative["id"], violation)
        rules.add(rule)
    assert len(rules) > 15


def test_tool_listings_are_the_regex_scan_matches():
    prompts = ["Name: get_tasks(project_id)\nName: finish(answer)", "xName: hidden(a)\nName: shown(b)",
               "Name: a(x,\nName: b(y))\nName: c()", "Name:\nName: d(e)", "Name: broken(\n\nName: ok(z)",
               "intro\n\nName:  spaced ( p1 , p2 )\ntext Name: inline(q)\nName: last(r)", "", "Name:"]
    for prompt in prompts:
        assert [m.span() for m in _tool_listings(prompt)] == [m.span() for m in _AGENTGYM_TOOL_LIST.finditer(prompt)]


def test_context_tools_turn_by_turn_are_those_of_the_joined_prompt():
    # Listings within a turn, a listing cut by the end of a turn (its `)` in the next one), a turn
    # that ends on `Name:`, an empty turn, and the tool prompts of the fixtures.
    turns = ["Name: a(x)\nName: b(y", "z)\nName: c(w)", "text", "", "Name:", " d(v)", "Name: e(u)\nName: a(t)"]
    cases = [tuple(turns[:k]) for k in range(len(turns) + 1)] + [tuple(turns[k:]) for k in range(len(turns))]
    for name, location in FIXTURE_SOURCES.items():
        source = get_source(name)
        for f in source.files(location):
            for raw in iter_rows(f.path, f.label):
                if raw.error is None:
                    turns = raw.row.get("conversations") or raw.row.get("conversation") or []
                    cases.append(tuple(t.get("value", t.get("content", "")) for t in turns if isinstance(t, dict)
                                       and isinstance(t.get("value", t.get("content")), str)))
    assert any(Context(seen, "").tools for seen in cases)
    for seen in cases:
        assert Context(seen, "").tools == offered_tools("\n".join(seen)), seen


# Python literals JSON could read otherwise than ast, or that one of them refuses: names, numbers,
# string forms, quotes inside strings, unclosed strings, raw control characters, a lone surrogate,
# deep nesting, containers JSON has not.
_LITERALS = ["{'a': True, 'b': None, 'c': False, 'True': 'None'}", "{'a': true}", "{'a': null}", "{'a': NaN}",
             "{'a': Infinity}", "{'a': -Infinity}", "{'a': 1e5, 'b': -0.0, 'c': 1E-3, 'd': -0, 'e': 10}",
             "{'a': 1e400, 'b': -1e400}", "{'a': 1j}", "{'a': 0x1F}", "{'a': 1_000}", "{'a': 01}", "{'a': 1.}",
             "{'a': .5}", "{'a': - 1}", "{'a': +1}", "{'a': 1" + "0" * 5000 + "}", "{'a': b'x'}", "{'a': u'x'}",
             "{'a': r'x'}", "{'a': 'x' 'y'}", "{'a': 'x''y'}", "{'a': '''x'''}", '{"a": """x"""}',
             r"{'a': 'it\'s'}", """{'a': 'say "hi"'}""", """{"a": 'x', 'b': "y'z", 'c': 'w"v'}""",
             "{'a': 'x\ny'}", "{'a': 'x\ry'}", "{'a': 'x\ty'}", "{'a': '\x00'}", "{'a': '\u2028 é 펄'}",
             "{'a': '\ud800'}", "{'a': 'x'\n, 'b': 1}", "{'a':\r\n1}", "{'a': (1, 2)}", "{'a': {1, 2}}", "{1: 'a'}",
             "{'a': 1,}", "{'a': 1} # 'b'", "{'a': 'x'", "{'a': 'x}", """{'a": 1}""", "{'a': 1, 'a': 2, 'b': 3}",
             "{'a': Truex}", "{'a': True1}", "{'a': ...}", "{'a': [1, 2.5, [], {}]}", "['a']", "'a'", "1", "", "{}",
             "{'a': " * 99 + "1" + "}" * 99, "{'a': " * 150 + "1" + "}" * 150, "[" * 201 + "]" * 201,
             "{'a': " + "[" * 201 + "]" * 201 + "}"]


def _fixture_argument_texts() -> list[str]:
    """Every fixture action, and the argument text of each that is a tool call."""
    texts = []
    for name, location in {**FIXTURE_SOURCES, "agent_flan": str(AGENT_FLAN)}.items():
        source = get_source(name)
        for f in source.files(location):
            for raw in iter_rows(f.path, f.label):
                if raw.error is not None:
                    continue
                try:
                    record = normalize_row(raw.row, source, f.split, f.label, raw.index)
                except NormalizeError:
                    continue
                for turn in record["conversations"]:
                    if turn["action"] is not None:
                        texts += [turn["action"], tool_call(turn["action"], turn["dialect"])[1] or ""]
    return texts


def _read_as_json(text: str) -> bool:
    """Whether `parse_arguments` reads `text` as the JSON `_python_as_json` makes of it."""
    text = text.strip()
    try:
        json.loads(text)
        return False
    except ValueError:
        as_json = _python_as_json(text)
    try:
        return as_json is not None and isinstance(json.loads(as_json), dict)
    except ValueError:
        return False


def test_python_literal_arguments_read_as_json_are_what_ast_reads():
    """Tool arguments that are no JSON are read as the JSON `_python_as_json` makes of them where that
    parses: on every fixture action and argument text, and on literals that tell the two apart, the
    arguments are `parse_literal`'s (ast's reading), value, types and key order alike."""
    fixture_texts = _fixture_argument_texts()
    for text in fixture_texts + _LITERALS:
        assert repr(parse_arguments(text)) == repr(parse_literal(text.strip(), dict)), text
    # The JSON reading is taken on real rows (Agent-FLAN's dict calls, AgentGym's Python reprs) and on
    # literals with names, numbers and quotes: the comparison is not only of texts left to ast.
    assert sum(map(_read_as_json, fixture_texts)) >= 5
    assert {"{'a': True, 'b': None, 'c': False, 'True': 'None'}", "{'a': 1e400, 'b': -1e400}",
            """{"a": 'x', 'b': "y'z", 'c': 'w"v'}""", "{'a': 'x'\n, 'b': 1}"} <= set(filter(_read_as_json, _LITERALS))
