"""Damaged containers and hostile records: every record is accounted for, the build goes on.

Also: files named by their path under the source root, provenance (sha256, revision), and a
build folder that never mixes two builds.
"""
from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trajforge.pipeline.build.second_half as second_half
import trajforge.pipeline.build.units as units
import trajforge.sources.base as base
from tests.support.paths import RAW
from trajforge.pipeline.atomic import StreamingTable
from trajforge.pipeline.build import BuildConfig, finalize, process_unit
from trajforge.pipeline.publish.manifest import EARLIER_MANIFEST, GENERATOR, MANIFEST, read_manifest
from trajforge.sources import get_source, iter_rows

ROWS = json.loads((RAW / "agenttraj_l" / "webshop_train.json").read_text())


def fifty() -> list[dict]:
    """50 copies of the real rows, fresh for each test (tests change them)."""
    return [dict(copy.deepcopy(ROWS[i % len(ROWS)]), item_id=f"webshop_{i}") for i in range(50)]


def array(rows: list[dict]) -> bytes:
    return ("[" + ", ".join(json.dumps(r) for r in rows) + "]").encode()


def unit_of(tmp_path, name: str, payload: bytes, source: str = "agenttraj_l"):
    path = tmp_path / "src" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    file = get_source(source).files(str(tmp_path / "src"))
    (file,) = [f for f in file if f.path == path]
    unit = process_unit(source, file, tmp_path / "staging", BuildConfig())
    assert unit.read == unit.written + unit.quarantined
    return unit, pq.read_table(unit.quarantine_path).to_pylist()


def test_json_array_with_a_bom(tmp_path):
    unit, quarantine = unit_of(tmp_path, "webshop_train.json", b"\xef\xbb\xbf" + array(fifty()))
    assert unit.read == 50 and unit.written == 50 and not quarantine


def test_jsonl_lines_with_a_bom_are_read(tmp_path):
    lines = b"".join(b"\xef\xbb\xbf" + json.dumps(r).encode() + b"\n" for r in fifty()[:3])
    unit, quarantine = unit_of(tmp_path, "webshop_train.jsonl", lines)
    assert unit.written == 3 and not quarantine


def test_malformed_third_element_costs_only_itself(tmp_path):
    elements = [json.dumps(r) for r in fifty()]
    elements[2] = elements[2].replace('": ', '"; ', 1)
    payload = ("[" + ", ".join(elements) + "]").encode()
    unit, quarantine = unit_of(tmp_path, "webshop_train.json", payload)
    assert unit.read == 50 and unit.written == 49
    (bad,) = quarantine
    assert bad["reason"] == "malformed_json" and bad["index"] == 2 and bad["raw"] == elements[2]
    start = payload.index(elements[2].encode())
    assert f"bytes {start}-{start + len(elements[2])}" in bad["detail"]


def test_unbalanced_element_and_a_too_deep_one_next_to_it(tmp_path):
    elements = [json.dumps(r) for r in fifty()]
    elements[3] = elements[3][:-1]  # the row's closing brace is gone
    elements[4] = elements[4].replace('"webshop_4"', "[" * 5000 + "]" * 5000, 1)
    unit, quarantine = unit_of(tmp_path, "webshop_train.json", ("[" + ", ".join(elements) + "]").encode())
    assert unit.read == 50 and unit.written == 48
    assert [(q["index"], q["reason"]) for q in quarantine] == [(3, "malformed_json"), (4, "too_deep")]


@pytest.mark.parametrize("damage, reason", [(b"\xff\xfe", "invalid_utf8"), (b"\x00", "malformed_json")])
def test_bad_bytes_mid_file_spoil_one_element(tmp_path, damage, reason):
    payload = array(fifty())
    at = payload.index(b'"value": "', len(payload) // 2) + len(b'"value": "')
    unit, quarantine = unit_of(tmp_path, "webshop_train.json", payload[:at] + damage + payload[at:])
    assert unit.read == 50 and [q["reason"] for q in quarantine] == [reason]
    if reason == "invalid_utf8":
        assert "\\xff\\xfe" in quarantine[0]["raw"]  # the raw bytes, shown, not replaced


def test_array_truncated_at_three_quarters(tmp_path):
    payload = array(fifty())
    unit, quarantine = unit_of(tmp_path, "webshop_train.json", payload[:len(payload) * 3 // 4])
    assert unit.written >= 36 and [q["reason"] for q in quarantine] == ["truncated"]
    assert quarantine[0]["raw"] and quarantine[0]["index"] == unit.written


@pytest.mark.parametrize("container", ["json", "jsonl"])
def test_unpaired_surrogate_is_a_reason_not_a_question_mark(tmp_path, container):
    rows = fifty()[:3]
    rows[1]["conversations"][0]["value"] = "MARK"
    texts = [json.dumps(r).replace('"MARK"', '"x \\ud800 y"') for r in rows]
    payload = ("[" + ", ".join(texts) + "]").encode() if container == "json" else "\n".join(texts).encode()
    unit, quarantine = unit_of(tmp_path, f"webshop_train.{container}", payload)
    assert unit.written == 2 and [q["reason"] for q in quarantine] == ["unpaired_surrogate"]
    assert "\\ud800" in quarantine[0]["raw"]
    # A surrogate pair is one character, not a defect.
    rows[1]["conversations"][0]["value"] = "MARK"
    ok = json.dumps(rows[1]).replace('"MARK"', '"x \\ud83d\\ude00 y"').encode()
    assert next(iter_rows(_write(tmp_path / "pair.jsonl", ok))).row is not None


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 7, 11, 64, 1 << 20])
def test_damage_found_wherever_the_read_chunks_end(tmp_path, monkeypatch, chunk_bytes):
    """The JSON array reader checks a chunk's text, not each element, for bytes that are not UTF-8
    and escaped surrogates, until one shows: one that straddles two chunks is found all the same,
    in clean rows after clean rows, and a bad byte late in a file spoils only its own element."""
    rows = fifty()[:6]
    rows[2]["conversations"][0]["value"] = "LONE"
    rows[4]["conversations"][0]["value"] = "BYTES"
    texts = [json.dumps(r) for r in rows]
    payload = ("[" + ", ".join(texts) + "]").encode()
    payload = payload.replace(b'"LONE"', b'"x \\udc00 y"').replace(b'"BYTES"', b'"x \xff y"')
    monkeypatch.setattr(base, "CHUNK_BYTES", chunk_bytes)
    read = list(iter_rows(_write(tmp_path / "webshop_train.json", payload)))
    assert [(r.index, r.error) for r in read] == [(0, None), (1, None), (2, "unpaired_surrogate"), (3, None),
                                                   (4, "invalid_utf8"), (5, None)]
    assert [r.row for r in read if r.error is None] == [rows[i] for i in (0, 1, 3, 5)]


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 7, 64, 1 << 20])
def test_bad_bytes_after_a_bom_and_before_split_characters(tmp_path, monkeypatch, chunk_bytes):
    """The reader decodes strictly until a chunk holds a byte that is not UTF-8, then decodes that
    chunk again from the same state keeping the bad bytes: the BOM is dropped once, and the
    multi-byte characters on either side (split between chunks or not) read as they are."""
    rows = fifty()[:3]
    rows[0]["conversations"][0]["value"] = "é BYTES é"
    rows[1]["conversations"][0]["value"] = "ü 漢字 😀"
    payload = ("[" + ", ".join(json.dumps(r, ensure_ascii=False) for r in rows) + "]").encode()
    payload = b"\xef\xbb\xbf" + payload.replace(b"BYTES", b"\xff")
    monkeypatch.setattr(base, "CHUNK_BYTES", chunk_bytes)
    read = list(iter_rows(_write(tmp_path / "webshop_train.json", payload)))
    assert [(r.index, r.error) for r in read] == [(0, "invalid_utf8"), (1, None), (2, None)]
    assert "é \\xff é" in read[0].raw_text
    assert [r.row for r in read[1:]] == rows[1:]


def _write(path, payload: bytes):
    path.write_bytes(payload)
    return path


@pytest.mark.parametrize("container", ["json", "jsonl"])
def test_nesting_deeper_than_the_parser(tmp_path, container):
    deep = '{"item_id": "webshop_1", "conversations": ' + "[" * 1000 + "]" * 1000 + "}"
    payload = f"[{deep}]".encode() if container == "json" else deep.encode() + b"\n"
    unit, quarantine = unit_of(tmp_path, f"webshop_train.{container}", payload)
    assert [q["reason"] for q in quarantine] == ["too_deep"] and quarantine[0]["raw"]


@pytest.mark.parametrize("role", [{"name": "user"}, ["user"]])
def test_role_that_is_a_dict_or_a_list(tmp_path, role):
    row = fifty()[0]
    row["conversations"][0]["from"] = role
    unit, quarantine = unit_of(tmp_path, "webshop_train.jsonl", json.dumps(row).encode())
    assert [q["reason"] for q in quarantine] == ["unknown_role"]


@pytest.mark.parametrize("name", ["webshop_train.json", "webshop_train.jsonl", "webshop_train.parquet"])
def test_zero_byte_file_has_no_records_and_says_so(tmp_path, name):
    unit, quarantine = unit_of(tmp_path, name, b"")
    assert unit.read == 0 and not quarantine and unit.note == "empty file: no records"


def _parquet(rows: list[dict]) -> bytes:
    # One column type for every row: copies of one upstream row.
    rows = [dict(copy.deepcopy(ROWS[0]), item_id=row["item_id"]) for row in rows]
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=10, compression="zstd")
    return sink.getvalue()


def test_parquet_row_group_with_flipped_bytes_is_one_entry_with_its_row_count(tmp_path):
    data = bytearray(_parquet(fifty()))
    meta = pq.read_metadata(io.BytesIO(bytes(data)))
    column = meta.row_group(2).column(0)
    for i in range(column.data_page_offset + 20, column.data_page_offset + 28):
        data[i] ^= 0xFF
    unit, quarantine = unit_of(tmp_path, "webshop_train.parquet", bytes(data))
    assert unit.read == 50 and unit.written == 40 and unit.quarantined == 10
    (bad,) = quarantine
    assert bad["reason"] == "unreadable_row_group" and bad["index"] == 20
    assert "rows 20-29 (10 rows, bytes " in bad["detail"]


def test_parquet_with_a_truncated_footer(tmp_path):
    unit, quarantine = unit_of(tmp_path, "webshop_train.parquet", _parquet(fifty())[:-20])
    assert unit.read == 1 and [q["reason"] for q in quarantine] == ["unreadable_file"]


def test_a_crash_no_rule_foresaw_is_one_quarantine_entry(tmp_path, monkeypatch, caplog):
    real = units.normalize_row

    def failing(row, *args, **kwargs):
        if row.get("item_id") == "webshop_1":
            raise ZeroDivisionError("boom")
        return real(row, *args, **kwargs)

    monkeypatch.setattr(units, "normalize_row", failing)
    with caplog.at_level(logging.WARNING, "trajforge.build"):
        unit, quarantine = unit_of(tmp_path, "webshop_train.json", array(fifty()[:3]))
    assert unit.written == 2
    assert [(q["reason"], q["detail"]) for q in quarantine] == [("internal_error", "ZeroDivisionError: boom")]
    assert {s["stage"]: s["dropped"] for s in unit.stages}["normalize"] == {"internal_error": 1}
    assert json.loads(quarantine[0]["raw"])["item_id"] == "webshop_1"
    assert "Traceback" in caplog.text


def test_a_row_arrow_refuses_to_write_is_quarantined_and_the_rest_kept(tmp_path):
    refused = []
    schema = pa.schema([("text", pa.string())])
    path = tmp_path / "refuse.arrow"
    writer = StreamingTable(path, schema, batch_rows=2, on_refused=lambda row, exc: refused.append(row))
    for text in ["a", "b \ud800", "c"]:
        writer.append({"text": text})
    writer.close()
    assert pa.ipc.open_file(path).read_all()["text"].to_pylist() == ["a", "c"] and refused == [{"text": "b \ud800"}]


def test_files_are_named_by_their_path_under_the_source_root(tmp_path):
    for folder, n in (("a", 5), ("b", 7)):
        (tmp_path / "src" / folder).mkdir(parents=True)
        (tmp_path / "src" / folder / "webshop_train.json").write_bytes(array(fifty()[:n]))
    units = [process_unit("agenttraj_l", f, tmp_path / "staging", BuildConfig())
             for f in get_source("agenttraj_l").files(str(tmp_path / "src"))]
    report = finalize(units, tmp_path / "out")
    files = report["sources"]["agenttraj_l"]["files"]
    assert {k: v["read"] for k, v in files.items()} == {"a/webshop_train.json": 5, "b/webshop_train.json": 7}


@pytest.mark.parametrize("source, name, split", [
    ("agenttraj_l", "babyai_train-00000-of-00001.parquet", "babyai"),
    ("agenttraj_l", "data/webshop_train-00000-of-00002-0123abcd.parquet", "webshop"),
    ("agentinstruct", "data/os-00000-of-00001-971539c34fcc7500.parquet", "os"),
    ("agent_flan", "data/toolbench_negative-00000-of-00001.parquet", "toolbench_negative"),
    ("synthetic", "data/synthetic/os-00000-of-00001.parquet", "os"),
])
def test_split_ignores_the_hub_shard_suffix(source, name, split):
    assert get_source(source).split_of(Path(name)) == split


def _one_file_build(tmp_path, payload: bytes, out_name: str = "out"):
    src = tmp_path / f"src-{out_name}"
    src.mkdir()
    (src / "webshop_train.json").write_bytes(payload)
    (file,) = get_source("agenttraj_l").files(str(src))
    out = tmp_path / out_name
    finalize([process_unit("agenttraj_l", file, out / ".staging", BuildConfig())], out)
    return out


def test_provenance_sha256_and_the_build_id_follow_the_input_bytes(tmp_path):
    payload = array(fifty()[:3])
    out = _one_file_build(tmp_path, payload, "a")
    card = (out / "README.md").read_text()
    sha = re.search(r"`webshop_train\.json` \(sha256 `([0-9a-f]{64})`\)", card)
    assert sha and sha[1] == hashlib.sha256(payload).hexdigest()
    changed = payload.replace(b"webshop_2", b"webshop_3", 1)  # one byte
    assert len(changed) == len(payload) and changed != payload
    other = _one_file_build(tmp_path, changed, "b")
    assert read_manifest(out)["build_id"] != read_manifest(other)["build_id"]


def test_every_record_quarantined_still_writes_configs_quarantine_and_report(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, "trajforge.build"):
        out = _one_file_build(tmp_path, b"this is not JSON at all")
    report = json.loads((out / "report.json").read_text())
    assert report["total"]["read"] == report["total"]["quarantined"] == 1 and report["total"]["written"] == 0
    assert report["warnings"] and "every input record was quarantined" in caplog.text
    shard = out / "data" / "sft" / "train-00000-of-00001.parquet"
    assert pq.read_metadata(shard).num_rows == 0
    assert pq.read_metadata(out / "quarantine" / "quarantine.parquet").num_rows == 1
    assert set(read_manifest(out)["files"]) >= {"data/sft/train-00000-of-00001.parquet", "report.json", "README.md"}


def test_rebuild_removes_leftovers_keeps_user_files_and_never_shows_a_mixed_manifest(tmp_path, monkeypatch):
    out = _one_file_build(tmp_path, array(fifty()[:3]))
    assert json.loads((out / MANIFEST).read_text())["generator"] == GENERATOR
    assert json.loads((out / "report.json").read_text())["generator"] == GENERATOR
    (out / "notes.txt").write_text("mine")  # a user's file in the build folder
    stale = [out / ".staging" / ".x.records.arrow.tmp-999999", out / "data" / "preference" / ".train.tmp-999999"]
    for path in stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    earlier_files = set(read_manifest(out)["files"])
    (out / "report_files" / "old_plot.png").write_bytes(b"png")  # an earlier build's file ...
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["files"]["report_files/old_plot.png"] = {"size": 3, "sha256": "0" * 64}  # ... that it listed
    (out / MANIFEST).write_text(json.dumps(manifest))

    # A rebuild killed before its manifest: no manifest (readers see no finished build) ...
    monkeypatch.setattr(second_half, "write_card", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    src = tmp_path / "src-out"
    (file,) = get_source("agenttraj_l").files(str(src))
    unit = process_unit("agenttraj_l", file, out / ".staging", BuildConfig())
    with pytest.raises(KeyboardInterrupt):
        finalize([unit], out)
    assert not (out / MANIFEST).exists() and (out / EARLIER_MANIFEST).exists()
    monkeypatch.undo()
    # ... and the rerun finishes it: temp files gone, the earlier build's extra file gone, the user's kept.
    finalize([unit], out)
    assert not any(path.exists() for path in stale)
    assert not (out / "report_files" / "old_plot.png").exists() and not (out / EARLIER_MANIFEST).exists()
    assert (out / "notes.txt").read_text() == "mine"
    files = set(read_manifest(out)["files"])
    assert "notes.txt" not in files and files == earlier_files


def test_a_hub_file_keeps_its_revision_in_the_provenance(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "datasets--AgentGym--AgentTraj-L" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "webshop_train.json").write_bytes(array(fifty()[:2]))
    (file,) = get_source("agenttraj_l").files(str(snapshot))
    unit = process_unit("agenttraj_l", file, tmp_path / "staging", BuildConfig())
    assert unit.revision == commit and unit.input_sha256 == hashlib.sha256(array(fifty()[:2])).hexdigest()
