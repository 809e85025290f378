"""Each semantic rule catches what it is for, on real records made wrong in one way."""
from __future__ import annotations

import copy

import pyarrow.parquet as pq
import pytest

from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES, RAW
from trajforge.pipeline.ingest.normalize import NormalizedRecord, NormalizeError, normalize_row
from trajforge.pipeline.ingest.validate import RULES, ValidateConfig, check_record, validate_record
from trajforge.schemas import first_error
from trajforge.sources import get_source, iter_rows


@pytest.fixture(scope="module")
def record(fixtures_build):
    rows = pq.read_table(fixtures_build / "data" / "sft").to_pylist()
    return next(r for r in rows if r["id"] == "agenttraj_l/webshop_1418")


def _broken(record, change):
    r = copy.deepcopy(record)
    change(r)
    return validate_record(r)


def test_the_real_record_is_valid(record):
    assert validate_record(record) is None


def _two_assistants(r):
    r["conversations"].insert(4, copy.deepcopy(r["conversations"][3]))


def _observation_in_assistant(r):
    turn = r["conversations"][3]
    turn["content"] += "\nObservation: the search returned 3 results"


def _prose_turn(r):
    r["conversations"][3].update(content="I think I will search now.", thought="I think I will search now.",
                                 action=None, dialect="free_text")


def _mismatch(r):
    r["conversations"][3]["action"] = "click[Buy Now]"


@pytest.mark.parametrize("change,reason", [
    (lambda r: r.update(domain="space"), "schema"),
    (lambda r: r["conversations"][1].update(content=""), "schema"),
    (lambda r: r["conversations"].pop(), "final_turn_not_assistant"),
    (_two_assistants, "role_order"),
    (lambda r: r["conversations"].insert(0, {**r["conversations"][1]}), "role_order"),
    (lambda r: [t.update(loss=False) for t in r["conversations"]], "no_trainable_turn"),
    (lambda r: r["conversations"][2].update(content="x" * 1_000_001), "too_long"),
    (_observation_in_assistant, "model_written_observation"),
    (_prose_turn, "unparsed_assistant_turn"),
    (_mismatch, "parse_mismatch"),
])
def test_rule_catches_its_case(record, change, reason):
    violation = _broken(record, change)
    assert violation is not None and violation.reason == reason, violation


def test_two_assistant_turns_in_a_row_are_placed(record):
    # The webshop record starts user, assistant, user, assistant: the copy of turn 3 at 4 is the pair
    # (3, 4), at body index 4 (no system turn).
    assert _broken(record, _two_assistants).detail == "two assistant turns in a row at 4"
    system = {**record["conversations"][0], "role": "system"}
    assert _broken(record, lambda r: (_two_assistants(r), r["conversations"].insert(0, system))).detail == (
        "two assistant turns in a row at 4")


def test_a_normalized_record_still_fails_the_schema_where_its_row_decides():
    """Validation leaves out the schema's turn check for a record normalize built (its turns are
    built to it); what the row decides still fails, with the full check's reason and detail."""
    source = get_source("agentinstruct")
    row = next(iter_rows(RAW / "agentinstruct" / "db.jsonl")).row
    for broken, path in (({**row, "id": "db 1"}, "id"), ({**row, "conversations": row["conversations"][:1]},
                                                          "conversations")):
        record = normalize_row(broken, source, "db", "db.jsonl", 0)
        violation = validate_record(record)
        assert isinstance(record, NormalizedRecord) and violation is not None and violation.reason == "schema"
        assert violation.detail == first_error("trajectory", dict(record))[:500] and violation.detail.startswith(path)


# Values a row decides, each wrong in a way the schema names (the constructor fixes the rest).
_HOSTILE = ({"id": "No Namespace"}, {"id": 7}, {"source": "elsewhere"}, {"source_id": ""}, {"source_file": None},
            {"license": 1}, {"domain": "space"}, {"env": ""}, {"negative_type": 3}, {"rendering": "html"},
            {"loss_flags": "some"}, {"demo_turns": -1}, {"demo_turns": 1.5}, {"task": ""}, {"answer": ["a"]},
            {"reward": "1"}, {"reward": True}, {"success": 1}, {"conversations": []}, {"conversations": "turns"})


def _normalized_fixture_records() -> list[NormalizedRecord]:
    records = []
    for name, location in {**FIXTURE_SOURCES, "agent_flan": str(AGENT_FLAN)}.items():
        source = get_source(name)
        for f in source.files(location):
            for raw in (r for r in iter_rows(f.path, f.label) if not r.error):
                try:
                    record = normalize_row(raw.row, source, f.split, f.label, raw.index)
                except NormalizeError:
                    continue
                if isinstance(record, NormalizedRecord):
                    records.append(record)
    return records


def test_the_schema_rule_on_a_built_record_agrees_with_the_full_check():
    """The schema rule checks a record normalize built for the values its row decides only: on every
    fixture record, and on each made wrong in one such value, its verdict and detail are the full
    check's."""
    records = _normalized_fixture_records()
    hostile = [NormalizedRecord({**record, **change}) for record in records[::25] for change in _HOSTILE]
    config = ValidateConfig()
    for record in records + hostile:
        full = first_error("trajectory", dict(record))
        violation = RULES["schema"](record, config)
        assert ((violation.reason, violation.detail) == ("schema", full[:500])) if full else violation is None, record
    assert len(records) > 100 and all(RULES["schema"](r, config) for r in hostile)


def test_compiled_and_reference_validators_agree(fixtures_build, record):
    """fastjsonschema decides, jsonschema explains: they must agree on valid and invalid records."""
    import fastjsonschema

    from trajforge.schemas import _compiled, validator

    def compiled_ok(r):
        try:
            _compiled("trajectory")(r)
            return True
        except fastjsonschema.JsonSchemaValueException:
            return False

    rows = pq.read_table(fixtures_build / "data" / "sft").to_pylist()
    broken = []
    for change in (lambda r: r.update(domain="space"), lambda r: r.update(id="No Namespace"),
                   lambda r: r["conversations"][0].update(loss=None), lambda r: r.update(extra=1),
                   lambda r: r.update(demo_turns=-1), lambda r: r["conversations"].__setitem__(slice(1, None), [])):
        r = copy.deepcopy(record)
        change(r)
        broken.append(r)
    for r in rows + broken:
        assert compiled_ok(r) == validator("trajectory").is_valid(r), r["id"]
    assert not any(compiled_ok(r) for r in broken)


def test_a_normalized_record_gives_its_answer():
    """The answer rule passes a record normalize built without reading its final action: on every
    fixture record (masked as validation writes it too), the full rule on a plain copy agrees."""
    config = ValidateConfig()
    records = _normalized_fixture_records()
    written = [check_record(r, config).record for r in records]
    assert sum(r["answer"] is not None for r in records) > 50
    for record in records + written:
        assert RULES["answer_consistent"](dict(record), config) is None
