"""Bad input never crashes a build: each bad record is quarantined with a reason; bad arguments fail fast."""
from __future__ import annotations

import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.paths import RAW
from trajforge.flows.cli import main
from trajforge.pipeline.build import BuildConfig, process_unit
from trajforge.sources import SourceError, get_source, iter_rows
from trajforge.sources.base import SourceFile

# A real AgentTraj-L maze row; each case below breaks it in one way.
GOOD = json.loads((RAW / "agenttraj_l" / "lmrlgym_maze_train.json").read_text())[2]


def _run(tmp_path, name: str, payload: bytes):
    path = tmp_path / name
    path.write_bytes(payload)
    unit = process_unit("agenttraj_l", SourceFile(path, "lmrlgym_maze"), tmp_path / "staging", BuildConfig())
    quarantine = pq.read_table(unit.quarantine_path).to_pylist()
    assert unit.read == unit.written + unit.quarantined
    return unit, quarantine


def _line(row) -> bytes:
    return json.dumps(row).encode() + b"\n"


def _with(**changes):
    row = json.loads(json.dumps(GOOD))
    row.update(changes)
    return row


CASES = {
    "malformed_json": b'{"conversations": [\n',
    "invalid_utf8": b'{"item_id": "lmrlgym_maze_2", "conversations": "\xff\xfe"}\n',
    "missing_id": _line({"conversations": GOOD["conversations"]}),
    "missing_conversations": _line({"item_id": "lmrlgym_maze_3"}),
    "unexpected_keys": _line(_with(conversations=[dict(GOOD["conversations"][0], extra=1)] + GOOD["conversations"][1:])),
    "wrong_type": _line(_with(conversations=[dict(GOOD["conversations"][0], value=42)] + GOOD["conversations"][1:])),
    "empty_conversation": _line(_with(conversations=[])),
    "unknown_role": _line(_with(conversations=[dict(GOOD["conversations"][0], **{"from": "tool"})])),
    "too_long": _line(_with(conversations=[dict(GOOD["conversations"][0], value="x" * 10_000_000)] + GOOD["conversations"][1:])),
    "final_turn_not_assistant": _line(_with(conversations=GOOD["conversations"][:3])),
    "not_an_object": b"[1, 2]\n",
}


@pytest.mark.parametrize("reason", sorted(CASES))
def test_bad_record_is_quarantined_with_its_reason_and_good_ones_survive(tmp_path, reason):
    unit, quarantine = _run(tmp_path, "maze.jsonl", _line(GOOD) + CASES[reason] + _line(_with(item_id="lmrlgym_maze_9")))
    assert unit.written == 2
    assert [q["reason"] for q in quarantine] == [reason]
    assert quarantine[0]["raw"] or quarantine[0]["detail"]


def test_ten_megabyte_string_is_kept_traceable_but_cut(tmp_path):
    _, quarantine = _run(tmp_path, "maze.jsonl", CASES["too_long"])
    assert quarantine[0]["reason"] == "too_long" and len(quarantine[0]["raw"]) < 200_000


def test_file_that_is_not_the_format_it_claims(tmp_path):
    unit, quarantine = _run(tmp_path, "maze.parquet", _line(GOOD))
    assert unit.written == 0 and [q["reason"] for q in quarantine] == ["unreadable_file"]


def test_broken_json_array_keeps_the_rows_before_the_break(tmp_path):
    payload = b"[" + json.dumps(GOOD).encode() + b", {\"item_id\": "
    unit, quarantine = _run(tmp_path, "maze_train.json", payload)
    assert unit.written == 1 and [q["reason"] for q in quarantine] == ["truncated"]
    assert quarantine[0]["raw"] == '{"item_id":' and quarantine[0]["index"] == 1


def test_parquet_with_wrong_column_types(tmp_path):
    path = tmp_path / "maze.parquet"
    pq.write_table(pa.table({"item_id": [1.5], "conversations": ["not a list"]}), path)
    unit = process_unit("agenttraj_l", SourceFile(path, "lmrlgym_maze"), tmp_path / "s", BuildConfig())
    assert unit.quarantined == 1
    assert pq.read_table(unit.quarantine_path).column("reason").to_pylist() == ["wrong_type"]


def test_unknown_source_and_missing_path_fail_fast(tmp_path, capsys):
    assert main(["build", "--source", "nope=/tmp", "--out", str(tmp_path)]) == 2
    assert "--source nope: unknown source" in capsys.readouterr().err
    assert main(["build", "--source", f"agenttraj_l={tmp_path}/missing/dir", "--out", str(tmp_path)]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    with pytest.raises(SourceError, match="no data files"):
        get_source("agenttraj_l").files(str(tmp_path))


def test_json_array_reader_streams(tmp_path):
    """Peak memory while reading stays far below the file size (rows are not all loaded at once)."""
    path = tmp_path / "big_train.json"
    with open(path, "w") as fh:
        fh.write("[")
        for i in range(3000):
            fh.write(("," if i else "") + json.dumps(_with(item_id=f"lmrlgym_maze_{i}", pad="y" * 10_000)))
        fh.write("]")
    size = path.stat().st_size
    tracemalloc.start()
    count = sum(1 for _ in iter_rows(path))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == 3000
    assert peak < size / 10, (peak, size)
