"""The stages of a build and their tallies: the map stages of a unit (read, normalize, validate,
stage), and the global stages over every unit.

Each stage counts what came in, what it kept and what it dropped by reason; the unit's counts
are those tallies, and the quarantine holds one entry per drop with the same reasons.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.fuzz_corpus import generate
from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES, RAW
from trajforge.pipeline.atomic import StreamingTable
from trajforge.pipeline.build import BuildConfig, UnitResult, global_stages, process_unit, unit_key
from trajforge.pipeline.build.assemble import key_table
from trajforge.pipeline.build.global_stages import GLOBAL_STAGES, QUARANTINE, StagedBuild, run_global_stages, tally_of
from trajforge.pipeline.build.report import source_counts
from trajforge.pipeline.build.resume import read_marker, resume_unit, unit_marker, write_marker
from trajforge.pipeline.quality.dedup import Contamination
from trajforge.pipeline.stages import StageTally, merge_tallies
from trajforge.schemas import arrow_schema
from trajforge.sources import get_source
from trajforge.sources.base import SourceFile

STAGES = ["read", "normalize", "validate", "stage"]
# An unreadable Parquet row group is one quarantine entry standing for the rows its detail names.
GROUP_ROWS = re.compile(r"\((\d+) rows")


def quarantine_reasons(unit: UnitResult) -> Counter:
    """Rows quarantined by reason, as the unit's quarantine file says."""
    reasons = Counter()
    for entry in pq.read_table(unit.quarantine_path).to_pylist():
        group = GROUP_ROWS.search(entry["detail"] or "") if entry["reason"] == "unreadable_row_group" else None
        reasons[entry["reason"]] += int(group[1]) if group else 1
    return reasons


def assert_tallies_add_up(unit: UnitResult) -> None:
    assert [stage["stage"] for stage in unit.stages] == STAGES
    for stage in unit.stages:
        assert stage["in"] == stage["kept"] + sum(stage["dropped"].values()), stage
    for before, after in zip(unit.stages, unit.stages[1:]):
        assert after["in"] == before["kept"], (before, after)
    assert unit.read == unit.written + unit.quarantined
    assert unit.written == pa.ipc.open_file(unit.records_path).read_all().num_rows
    assert unit.reasons == quarantine_reasons(unit)


def test_each_stage_counts_the_real_rows_and_the_bad_rows_it_dropped(tmp_path):
    real = json.loads((RAW / "agenttraj_l" / "textcraft_train.json").read_text())
    good = real[1]
    broken = [
        b'{"item_id": "textcraft_900", "conversations": [\n',              # read: malformed_json
        b'{"item_id": "textcraft_901", "conversations": "\xff\xfe"}\n',     # read: invalid_utf8
        json.dumps({"conversations": good["conversations"]}).encode() + b"\n",  # normalize: missing_id
        json.dumps(dict(good, item_id="textcraft_902", conversations=[dict(good["conversations"][0], **{"from": "tool"})]
                        + good["conversations"][1:])).encode() + b"\n",      # normalize: unknown_role
        json.dumps(dict(good, item_id="textcraft_903", conversations=good["conversations"][:3])).encode()
        + b"\n",                                                            # validate: final_turn_not_assistant
    ]
    path = tmp_path / "textcraft_train.jsonl"
    path.write_bytes(b"".join(json.dumps(row).encode() + b"\n" for row in real) + b"".join(broken))

    unit = process_unit("agenttraj_l", SourceFile(path, "textcraft"), tmp_path / "staging", BuildConfig())

    assert_tallies_add_up(unit)
    assert unit.stages == [
        {"stage": "read", "in": 9, "kept": 7, "dropped": {"invalid_utf8": 1, "malformed_json": 1}},
        {"stage": "normalize", "in": 7, "kept": 5, "dropped": {"missing_id": 1, "unknown_role": 1}},
        # textcraft_205 and textcraft_251 are kept, the steps TextCraft refused masked (tests/ingest/test_grounding.py).
        {"stage": "validate", "in": 5, "kept": 4, "dropped": {"final_turn_not_assistant": 1}},
        {"stage": "stage", "in": 4, "kept": 4, "dropped": {}},
    ]
    written = [r["source_id"] for r in pa.ipc.open_file(unit.records_path).read_all().to_pylist()]
    assert written == ["textcraft_205", "textcraft_132", "textcraft_251", "textcraft_320"]


def test_tallies_add_up_over_every_file_of_the_fuzz_corpus(tmp_path):
    # Seed 25: among its eight files a flipped Parquet row group and a broken footer.
    corpus = generate(tmp_path / "in", {**FIXTURE_SOURCES, "agent_flan": str(AGENT_FLAN)}, 400, seed=25)
    units = [process_unit(name, file, tmp_path / "staging", BuildConfig())
             for name, fuzz in corpus.items() for file in get_source(name).files(str(fuzz.root))]
    for unit in units:
        assert_tallies_add_up(unit)
    total = merge_tallies([[StageTally(s["stage"], s["in"], s["kept"], Counter(s["dropped"])) for s in unit.stages]
                           for unit in units])
    assert [tally.stage for tally in total] == STAGES
    generated = sum(f.records for fuzz in corpus.values() for f in fuzz.files.values())
    # Damage that hides a container's row count (a broken footer) makes one entry of the lost rows.
    assert total[0].seen <= generated
    assert all(tally.dropped for tally in total[:3]), "the corpus must make every map stage drop something"
    assert {"unreadable_row_group", "unreadable_file", "malformed_json"} <= set(total[0].dropped)
    assert sum(total[-1].dropped.values()) == 0


def test_the_tallies_survive_the_unit_marker(tmp_path):
    file = SourceFile(RAW / "agenttraj_l" / "textcraft_train.json", "textcraft")
    unit = process_unit("agenttraj_l", file, tmp_path, BuildConfig())
    marker = unit_marker(tmp_path, unit_key("agenttraj_l", file))
    write_marker(marker, "fingerprint", asdict(unit))
    again = UnitResult(**read_marker(marker, "fingerprint"))
    assert again == unit
    assert (again.read, again.written, again.quarantined, again.envs["textcraft"]["steps_masked"]) == (4, 4, 0, 9)


def test_a_marker_naming_files_of_another_staging_format_is_not_trusted(tmp_path):
    """A unit is skipped on its marker only when the marker names the files this code stages (in
    their format): one written by a build that staged Parquet records is redone, not read."""
    file = SourceFile(RAW / "agenttraj_l" / "textcraft_train.json", "textcraft")
    unit, earlier = resume_unit("agenttraj_l", file, tmp_path)
    assert not earlier and resume_unit("agenttraj_l", file, tmp_path) == (unit, True)
    marker = unit_marker(tmp_path, unit_key("agenttraj_l", file))
    done = json.loads(marker.read_text())
    older = str(tmp_path / Path(unit.records_path).name.replace(".records.arrow", ".records.parquet"))
    pq.write_table(pa.ipc.open_file(unit.records_path).read_all(), older)
    write_marker(marker, done["fingerprint"], {**done["payload"], "records_path": older})
    again, earlier = resume_unit("agenttraj_l", file, tmp_path)
    assert not earlier and again == unit and json.loads(marker.read_text())["payload"]["records_path"] == unit.records_path


def test_a_record_arrow_refuses_to_stage_is_a_drop_of_the_stage_stage(tmp_path):
    """Negatives pass validation unchecked: a synthetic negative whose reward is text reaches the
    writer, which refuses it; it is quarantined as that stage's internal_error, the rest staged."""
    file = SourceFile(RAW / "agenttraj_l" / "textcraft_train.json", "textcraft")
    records = [dict(r, source="synthetic", reward=None)
               for r in pa.ipc.open_file(process_unit("agenttraj_l", file, tmp_path / "a", BuildConfig()).records_path)
               .read_all().to_pylist()]
    negative = dict(records[0], id="textcraft_132-negative", kind="negative", negative_type="wrong_answer",
                    parent_id=records[0]["id"], reward="high")
    path = tmp_path / "synth" / "data" / "synthetic" / "textcraft-00000-of-00001.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([*records, negative]), path)
    (synthetic,) = get_source("synthetic").files(str(tmp_path / "synth"))

    unit = process_unit("synthetic", synthetic, tmp_path / "b", BuildConfig())

    assert_tallies_add_up(unit)
    assert unit.stages[-1] == {"stage": "stage", "in": 5, "kept": 4, "dropped": {"internal_error": 1}}
    (entry,) = pq.read_table(unit.quarantine_path).to_pylist()
    assert entry["reason"] == "internal_error" and entry["source_id"] == negative["source_id"]
    assert json.loads(entry["raw"])["reward"] == "high" and entry["detail"].startswith("Arrow")


def test_the_report_lists_every_stage_of_the_build_and_they_chain(fixtures_build):
    """report.json `stages`: the map stages summed over the units, then the global ones; each
    takes in what the one before kept, and the ends are the build's read and written totals."""
    report = json.loads((fixtures_build / "report.json").read_text())
    stages = report["stages"]
    assert [s["stage"] for s in stages] == ["read", "normalize", "validate", "stage", "decontaminate",
                                            "dedup_exact", "dedup_near"]
    for before, after in zip(stages, stages[1:]):
        assert after["in"] == before["kept"]
    for stage in stages:
        assert stage["in"] == stage["kept"] + sum(stage["dropped"].values())
    total = report["total"]
    assert stages[0]["in"] == total["read"] and stages[-1]["kept"] == total["written"]
    assert {reason: n for s in stages[:5] for reason, n in s["dropped"].items()} == total["reasons"]
    assert stages[5]["dropped"].get("exact", 0) + stages[6]["dropped"].get("near", 0) == total["duplicates"]


def test_global_stages_report_their_own_tallies_and_the_counts_come_from_them(tmp_path):
    """Each global stage takes in what the one before kept and reports its tally and dropped rows;
    their split per unit adds up to the stage's tally, and the per-file counts made from the units'
    tallies balance and name the records left."""
    config = BuildConfig()
    units = [process_unit("agentinstruct", f, tmp_path / "staging", config)
             for f in get_source("agentinstruct").files(FIXTURE_SOURCES["agentinstruct"])]
    task = pa.ipc.open_file(units[0].records_path).read_all()["task"][0].as_py()
    (tmp_path / "eval.txt").write_text(task + "\n")
    config = BuildConfig(decontaminate=str(tmp_path / "eval.txt"), decontaminate_splits=False)

    class LongRecords:  # a throwaway stage: what a new stage declares, nothing more
        name, outcome = "too_long", QUARANTINE

        def run(self, keys, build):
            dropped = keys.filter(pl.col("chars") > 6000).select("order", reason=pl.lit("too_long"),
                                                                 detail=pl.lit("long"))
            return tally_of(self.name, keys, dropped), dropped

    keys = key_table(units, config)
    runs, kept = run_global_stages(keys, StagedBuild(units, config), [*GLOBAL_STAGES, LongRecords()])
    assert [run.tally.stage for run in runs] == ["decontaminate", "dedup_exact", "dedup_near", "too_long"]
    seen = keys.height
    for run in runs:
        assert run.tally.seen == seen and run.dropped.height == sum(run.tally.dropped.values())
        assert merge_tallies([[t] for t in run.unit_tallies]) == [run.tally]
        seen = run.tally.kept
    assert seen == kept.height
    assert runs[0].tally.dropped["contaminated"] >= 1 and runs[1].tally.dropped["exact"] > 0
    assert runs[3].tally.dropped["too_long"] > 0

    counts = source_counts(units, runs)
    files = counts["sources"]["agentinstruct"]["files"]
    for u, unit in enumerate(units):
        entry = files[unit.source_file]
        assert entry["read"] == entry["written"] + entry["quarantined"] + entry["duplicates"]
        assert entry["written"] == kept.filter(pl.col("unit") == u).height
    total = counts["total"]
    assert total["duplicates"] == runs[1].tally.dropped["exact"] + sum(runs[2].tally.dropped.values())
    assert total["reasons"]["too_long"] == runs[3].tally.dropped["too_long"]
    assert total["reasons"]["contaminated"] == runs[0].tally.dropped["contaminated"]


def test_freed_memory_goes_back_to_the_system():
    """What a step freed on glibc's heap, between chunks still alive, stays the process's after
    `free`; `release_freed_memory` hands it back. In a new interpreter, so that no other test's heap
    is measured."""
    script = """
import sys
import psutil
from trajforge.pipeline.stages import _MALLOC_TRIM, release_freed_memory
if _MALLOC_TRIM is None:
    print("no-glibc"); sys.exit()
freed, held = [], []
for i in range(3000):
    freed.append(("y" * 65536) + str(i))  # 64 KiB strings: malloc's heap (below its mmap threshold)
    held.append(("z" * 1000) + str(i))  # a live chunk after each: the heap cannot shrink from its top
del freed
before = psutil.Process().memory_info().rss
release_freed_memory()
print(before - psutil.Process().memory_info().rss)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()
    if out == "no-glibc":
        pytest.skip("malloc_trim is glibc's: nothing to hand back elsewhere")
    assert int(out) > 150 * 2**20  # of the ~190 MiB freed


def test_a_units_contamination_does_not_depend_on_how_its_tasks_are_chunked(tmp_path, fixtures_build, monkeypatch):
    """`unit_contamination` checks a unit's tasks a chunk at a time (rows or bytes of text, whichever
    comes first, to bound a worker's memory): the details are the same for one chunk, a chunk per
    staged batch, and the defaults."""
    largest = max((fixtures_build / ".staging").glob("*.records.arrow"), key=lambda p: p.stat().st_size)
    rows = pa.ipc.open_file(str(largest)).read_all().to_pylist()
    staged = tmp_path / "unit.records.arrow"
    with StreamingTable(staged, arrow_schema("trajectory"), batch_rows=7) as writer:  # many small batches
        for row in rows:
            writer.append(row)
    eval_tasks = [rows[i]["task"] for i in (0, len(rows) // 2, len(rows) - 1)]
    index = Contamination(eval_tasks, n=8)

    def details(chunk_rows: int, chunk_bytes: int) -> list:
        monkeypatch.setattr(global_stages, "CONTAMINATION_CHUNK", chunk_rows)
        monkeypatch.setattr(global_stages, "CONTAMINATION_CHUNK_BYTES", chunk_bytes)
        return global_stages.unit_contamination(str(staged), index, None)

    whole = details(10**9, 10**12)
    assert len(whole) == len(rows) and sum(d is not None for d in whole) >= 3
    assert details(10**9, 1) == whole  # a chunk per batch (the last with the one before it)
    assert details(global_stages.CONTAMINATION_CHUNK, global_stages.CONTAMINATION_CHUNK_BYTES) == whole
