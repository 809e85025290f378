"""The typed record and its one constructor agree with schemas/trajectory.schema.json."""
from __future__ import annotations

import pytest

from trajforge.schemas import first_error, load_schema
from trajforge.schemas.record import SCHEMA_VERSION, TrajectoryRecord, Turn, new_record


def _keys(typed) -> tuple[list[str], set[str]]:
    return list(typed.__annotations__), set(typed.__required_keys__)


def test_record_typeddict_matches_schema():
    schema = load_schema("trajectory")
    keys, required = _keys(TrajectoryRecord)
    assert keys == list(schema["properties"])
    assert required == set(schema["required"])
    assert SCHEMA_VERSION == schema["properties"]["schema_version"]["enum"][-1]


def test_turn_typeddict_matches_schema():
    turn = load_schema("trajectory")["properties"]["conversations"]["items"]
    keys, required = _keys(Turn)
    assert keys == list(turn["properties"])
    assert required == set(turn["required"])


@pytest.mark.parametrize("negative_type, kind", [(None, "positive"), ("tool_irrelevance", "negative")])
def test_new_record_is_a_valid_record(negative_type, kind):
    turns: list[Turn] = [
        {"role": "user", "content": "list files", "loss": False, "thought": None, "action": None,
         "reasoning": None, "dialect": None},
        {"role": "assistant", "content": "Act: answer(3)", "loss": True, "thought": "", "action": "answer(3)",
         "reasoning": None, "dialect": "think_act"},
    ]
    record = new_record(id="synthetic/t~0", source="synthetic", source_id="t~0", source_file="tasks.jsonl",
                        license="other", domain="os", env="os", task="list files", conversations=turns,
                        meta={"é": 1, "a": 0}, negative_type=negative_type, answer="3")
    assert first_error("trajectory", record) is None
    assert list(record) == list(TrajectoryRecord.__annotations__)
    assert (record["kind"], record["negative_type"], record["parent_id"]) == (kind, negative_type, None)
    assert record["meta"] == '{"a": 0, "é": 1}'
