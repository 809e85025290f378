"""Validation grounded in what the environment answered, on real fixture rows edited into each case:
a refused step inside an episode is written masked (loss false) with the rest unchanged, a repeat
the env reports as progress is written, a real wall-bump loop is quarantined, a JSON-literal answer
is written, a final invalid action is quarantined; and no trained action in the fixture build's
output is one its env refused."""
from __future__ import annotations

import copy
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.paths import RAW
from trajforge.pipeline.build import BuildConfig, process_unit
from trajforge.pipeline.envs.db import parse_answer
from trajforge.pipeline.ingest.dialects import parse_answer_list
from trajforge.pipeline.ingest.validate import ValidateConfig, check_record
from trajforge.sources import SourceFile
from trajforge.training.rewards import answers_match

# The refusals the envs' own code writes (agentenv-babyai, agentenv-textcraft, agentenv-tool,
# ScienceWorld, TextWorld, AgentBench KG and DBBench), written out here as the test's own oracle.
ENV_REFUSALS = re.compile(
    r"^(?:(?:Observation|Instruction)\s*:\s*)?(?:Nothing happens\.|The action is not recognized|You cannot |"
    r"Could not execute |Could not find |No known action matches that input|Format error, please response|"
    r"ERROR \| |\d{4} \([0-9A-Z]{5}\): )|\) cannot be executed\.")


def raw_row(file: str, item_id: str) -> dict:
    rows = json.loads((RAW / "agenttraj_l" / file).read_text())
    return copy.deepcopy(next(r for r in rows if r["item_id"] == item_id))


def build_rows(tmp_path, env: str, rows: list[dict], config: BuildConfig = BuildConfig()):
    """The rows through the build's map stages, as an AgentTraj-L `<env>_train.json` file:
    (records written, quarantine rows)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{env}_train.json"
    path.write_text(json.dumps(rows))
    unit = process_unit("agenttraj_l", SourceFile(path, env), tmp_path / "staging", config)
    return pa.ipc.open_file(unit.records_path).read_all().to_pylist(), pq.read_table(unit.quarantine_path).to_pylist()


def gpt(thought: str, action: str) -> dict:
    return {"from": "gpt", "loss": True, "value": f"Thought:\n{thought}\n\nAction:\n{action}"}


def human(text: str) -> dict:
    return {"from": "human", "loss": None, "value": text}


def test_a_refused_step_mid_episode_is_masked_and_the_rest_is_unchanged(tmp_path):
    """BabyAI answers `turn around` (no action of its) with `The action is not recognized.`; the
    agent reads the error and goes on to succeed."""
    row = raw_row("babyai_train.json", "babyai_401")
    plain = copy.deepcopy(row)
    row["conversations"][3:3] = [gpt("I will turn to face the ball.", "turn around"),
                                 human("The action is not recognized. Please check valid actions.")]
    (edited,), _ = build_rows(tmp_path / "edited", "babyai", [row])
    (original,), _ = build_rows(tmp_path / "plain", "babyai", [plain])

    turns = edited["conversations"]
    assert (turns[3]["action"], turns[3]["loss"]) == ("turn around", False)
    assert turns[:3] + turns[5:] == original["conversations"]
    assert json.loads(edited["meta"])["masked_steps"] == [{"turn": 3, "rule": "babyai.command"}]
    assert {k: v for k, v in edited.items() if k not in ("conversations", "meta")} == \
        {k: v for k, v in original.items() if k not in ("conversations", "meta")}


def test_the_real_textcraft_rows_with_refused_steps_are_written_masked(tmp_path):
    """textcraft_251 sends `get` without a count (`Could not execute ...`) and crafts without enough
    bricks (`Could not find enough items ...`), then recovers; textcraft_205 writes prose where the
    action goes, which TextCraft answers `Could not execute <the prose>`."""
    rows = [raw_row("textcraft_train.json", "textcraft_251"), raw_row("textcraft_train.json", "textcraft_205")]
    written, quarantine = build_rows(tmp_path, "textcraft", rows)
    assert quarantine == []
    masked = {r["source_id"]: {s["turn"]: s["rule"] for s in json.loads(r["meta"])["masked_steps"]} for r in written}
    assert masked["textcraft_251"] == {5: "textcraft.arguments", 13: "textcraft.failed"}
    assert masked["textcraft_205"] == {7: "textcraft.failed", 9: "textcraft.failed", 11: "unparsed_assistant_turn",
                                       13: "textcraft.command", 15: "textcraft.command", 19: "textcraft.command"}
    for record in written:
        for i, turn in enumerate(record["conversations"]):
            if turn["role"] == "assistant" and i in masked[record["source_id"]]:
                assert not turn["loss"]
    # Under `drop` the record goes as before; under `keep` the refused steps stay trained.
    _, dropped = build_rows(tmp_path / "drop", "textcraft", rows[:1], BuildConfig(invalid_steps="drop"))
    assert [(q["source_id"], q["reason"]) for q in dropped] == [("textcraft_251", "invalid_action")]
    (kept,), _ = build_rows(tmp_path / "keep", "textcraft", rows[:1], BuildConfig(invalid_steps="keep"))
    assert kept["conversations"][5]["loss"] and "masked_steps" not in json.loads(kept["meta"])


def _crafting(reply: str) -> dict:
    """textcraft_132 edited: the agent gets 20 rabbit hide and sends `craft 1 leather using 4 rabbit
    hide` five times, each answered with `reply`."""
    row = raw_row("textcraft_train.json", "textcraft_132")
    turns = row["conversations"]
    get = next(i for i, t in enumerate(turns) if "get 4 rabbit hide" in t["value"])
    turns[get]["value"] = turns[get]["value"].replace("get 4 rabbit hide", "get 20 rabbit hide")
    turns[get + 1]["value"] = turns[get + 1]["value"].replace("Got 4 rabbit hide", "Got 20 rabbit hide")
    craft = turns[-1]
    turns[-1:] = [craft, human(f"Instruction:\n{reply}")] * 4 + [craft]
    return row


def test_a_repeat_the_env_reports_as_progress_is_no_loop(tmp_path):
    (record,), quarantine = build_rows(tmp_path, "textcraft", [_crafting("Crafted 1 minecraft:leather")])
    assert quarantine == [] and sum(t["loss"] for t in record["conversations"]) == 7
    _, quarantine = build_rows(tmp_path / "refused", "textcraft",
                               [_crafting("Could not find enough items to craft minecraft:leather")])
    assert [q["reason"] for q in quarantine] == ["action_loop"]


def test_a_real_wall_bump_loop_is_quarantined(tmp_path):
    """lmrlgym_maze_16 bumps into the wall above (5, 6) once; edited, it does so four times in a
    row, the position the maze reports unchanged each time."""
    row = raw_row("lmrlgym_maze_train.json", "lmrlgym_maze_16")
    turns = row["conversations"]
    bump = next(i for i in range(1, len(turns) - 1) if turns[i]["from"] == "gpt" and "move up" in turns[i]["value"]
                and turns[i + 1]["value"] == turns[i - 1]["value"])
    turns[bump + 2:bump + 2] = turns[bump:bump + 2] * 3
    _, quarantine = build_rows(tmp_path, "lmrlgym_maze", [row])
    assert [q["reason"] for q in quarantine] == ["action_loop"]
    assert "same action 4 times" in quarantine[0]["detail"]
    written, _ = build_rows(tmp_path / "real", "lmrlgym_maze", [raw_row("lmrlgym_maze_train.json", "lmrlgym_maze_16")])
    assert len(written) == 1  # the real row (one bump, then on) is no loop


@pytest.mark.parametrize("answer", ["[null]", "[true]", "[1.5e3]", "(329,)", "[None]"])
def test_a_json_literal_answer_is_written(tmp_path, answer):
    rows = [json.loads(line) for line in (RAW / "agentinstruct" / "db.jsonl").read_text().splitlines()]
    row = next(r for r in rows if r["id"] == "db_322")
    row["conversations"][-1]["value"] = row["conversations"][-1]["value"].replace("[329]", answer)
    folder = tmp_path / "agentinstruct"
    folder.mkdir()
    (folder / "db.jsonl").write_text(json.dumps(row) + "\n")
    unit = process_unit("agentinstruct", SourceFile(folder / "db.jsonl", "db"), tmp_path / "staging")
    (record,) = pa.ipc.open_file(unit.records_path).read_all().to_pylist()
    assert record["answer"] == answer and record["conversations"][-1]["loss"]
    assert parse_answer_list(answer) is not None and parse_answer(answer) == parse_answer_list(answer)
    assert answers_match(answer, answer.replace("(", "[").replace(",)", "]"))


def test_the_one_answer_parser():
    assert parse_answer_list("[null]") == [None] and parse_answer_list("[true]") == [True]
    assert parse_answer_list("[1.5e3]") == [1500.0] and parse_answer_list("('a', 2)") == ["a", 2]
    assert parse_answer_list("[(None,)]") == [(None,)]
    # A number with a thousands separator is a number, not the tuple Python would make of it.
    assert parse_answer_list("1,000") is None and answers_match("12,000", "[12000]")
    assert parse_answer("[null]") == [None] and parse_answer("28") == [28] and parse_answer("none") == ["none"]


def test_a_final_invalid_action_is_still_quarantined(tmp_path):
    row = raw_row("textcraft_train.json", "textcraft_132")
    row["conversations"][-1]["value"] = row["conversations"][-1]["value"].replace(
        "craft 1 leather using 4 rabbit hide", "craft leather")
    _, quarantine = build_rows(tmp_path, "textcraft", [row])
    assert [q["reason"] for q in quarantine] == ["invalid_action"]
    assert "textcraft.arguments (unconfirmed)" in quarantine[0]["detail"]


def test_a_grammar_only_breach_is_kept_and_trained(tmp_path):
    """An action outside SciWorld's prompt list that the env answered normally: the env accepted it."""
    row = raw_row("sciworld_train.json", "sciworld_350")
    at = next(i for i, t in enumerate(row["conversations"]) if t["from"] == "gpt" and "look around" in t["value"])
    row["conversations"][at]["value"] = row["conversations"][at]["value"].replace("look around", "look about")
    (record,), quarantine = build_rows(tmp_path, "sciworld", [row])
    assert quarantine == [] and record["conversations"][at]["loss"]
    checked = check_record(record)
    assert [(s.turn, s.verdict, s.rule) for s in checked.steps] == [(at, "grammar_only", "sciworld.command")]


def test_an_episode_whose_every_trained_step_was_refused_is_quarantined():
    """babyai_401 with each trained step answered `not recognized` and its last turn not trained
    (upstream loss flags can leave it out)."""
    from trajforge.pipeline.ingest.normalize import normalize_row
    from trajforge.sources import get_source

    row = raw_row("babyai_train.json", "babyai_401")
    turns = row["conversations"]
    for turn in turns[3:-1]:
        if turn["from"] == "human":
            turn["value"] = "The action is not recognized. Please check valid actions."
    turns[-1]["loss"] = False
    record = normalize_row(row, get_source("agenttraj_l"), "babyai", "babyai_train.json", 0)
    for mode in ("mask", "keep", "drop"):
        assert check_record(record, ValidateConfig(invalid_steps=mode)).violation.reason == "all_steps_refused"


def test_no_trained_action_in_the_build_is_one_its_env_refused(fixtures_build):
    rows = pq.read_table(fixtures_build / "data" / "sft").to_pylist()
    masked = 0
    for row in rows:
        turns = row["conversations"]
        named = {s["turn"] for s in json.loads(row["meta"]).get("masked_steps", [])}
        for i, turn in enumerate(turns[:-1]):
            if turn["role"] != "assistant" or turns[i + 1]["role"] != "user":
                continue
            refused = bool(ENV_REFUSALS.search(turns[i + 1]["content"]))
            assert not (turn["loss"] and refused), (row["id"], i, turns[i + 1]["content"][:100])
            if i in named:
                assert refused and not turn["loss"], (row["id"], i)
                masked += 1
    assert masked >= 15  # the fixtures hold real refused steps: alfworld_53, KG, TextCraft, movie_118


def test_the_sft_labels_leave_a_masked_step_untrained(fixtures_build):
    """textcraft_251 as the build wrote it: the label tensor trains the recovery, never the refused
    `get end stone brick stairs`."""
    pytest.importorskip("trl")
    from tests.support.tiny_model import build_tokenizer, fixture_texts
    from trajforge.training.data import IGNORE, tokenize_trajectory

    rows = pq.read_table(fixtures_build / "data" / "sft").to_pylist()
    record = next(r for r in rows if r["id"] == "agenttraj_l/textcraft_251")
    tokenizer = build_tokenizer(fixture_texts(fixtures_build))
    out = tokenize_trajectory(tokenizer, record["conversations"], max_length=None)
    trained = tokenizer.decode([label for label in out["labels"] if label != IGNORE])
    turns = record["conversations"]
    assert (turns[5]["action"], turns[5]["loss"]) == ("get end stone brick stairs", False)
    assert turns[5]["content"] in tokenizer.decode(out["input_ids"])
    assert "Action:\nget end stone brick stairs" not in trained and turns[5]["thought"] not in trained
    assert turns[9]["content"] in trained  # `get 4 end stone`, the recovery


def test_the_report_and_the_card_show_the_grounded_steps_per_env(fixtures_build):
    figures = json.loads((fixtures_build / "report.json").read_text())["validation_by_env"]
    assert figures["textcraft"]["refused"] == {"textcraft.arguments": 1, "textcraft.command": 3, "textcraft.failed": 4,
                                               "unparsed_assistant_turn": 1}
    assert (figures["textcraft"]["records_masked"], figures["textcraft"]["steps_masked"]) == (3, 9)
    assert figures["db"]["refused"] == {"db.sql_error": 26} and figures["db"]["records_masked"] == 0  # all quarantined
    html = (fixtures_build / "report.html").read_text()
    card = (fixtures_build / "README.md").read_text()
    assert "<td>alfworld</td><td>1</td><td>2</td><td>alfworld.command 2</td><td>-</td><td>-</td>" in html
    assert "| textcraft | 3 | 9 | textcraft.arguments 1, textcraft.command 3, textcraft.failed 4, " \
           "unparsed_assistant_turn 1 | - | - |" in card
    assert "Steps grounded in the environment's answers" in card
