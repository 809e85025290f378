"""Fuzz: `trajforge build` over thousands of mutated real rows in every container and damage.

The corpus (tests/support/fuzz_corpus.py) is seeded: a failure reproduces with the same seed and size.
`--fuzz-records N` sets the size (default 3000 for CI; run it once with 10000+).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter, defaultdict

import pyarrow.parquet as pq
import pytest

from tests.support.fuzz_corpus import generate
from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES, REPO

pytestmark = pytest.mark.slow
SEED = 20261201
SOURCES = {**FIXTURE_SOURCES, "agent_flan": str(AGENT_FLAN)}
# What each file-level damage must leave in that file's quarantine.
DAMAGE_REASONS = {"utf8_in_element": "invalid_utf8", "nul_in_element": "malformed_json",
                  "malformed_element": "malformed_json", "unbalanced_element": "malformed_json",
                  "dropped_quote": "malformed_json", "truncated_footer": "unreadable_file"}
# Record mutations that can never make a valid record.
NEVER_WRITTEN = {"role_dict", "role_list", "deep", "surrogate", "huge_turn"}
GROUP_ROWS = re.compile(r"\((\d+) rows")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, fuzz_records):
    root = tmp_path_factory.mktemp("fuzz")
    corpus = generate(root / "in", SOURCES, fuzz_records, SEED)
    out = root / "out"
    args = [sys.executable, "-m", "trajforge.flows.cli", "build", "--out", str(out)]
    for name, fuzz in corpus.items():
        args += ["--source", f"{name}={fuzz.root}"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800)
    return corpus, out, proc


def test_build_exits_0_without_a_traceback(fuzzed):
    _, _, proc = fuzzed
    assert proc.returncode == 0, proc.stderr[-5000:]
    # Prefect's temporary server may log its own shutdown noise (a cancelled event flush); no
    # traceback may pass through the build's code.
    ours = [block for block in (proc.stdout + proc.stderr).split("Traceback (most recent call last)")[1:]
            if str(REPO) in block.split("\n\n")[0]]
    assert not ours, ours[0][-3000:]


def test_read_is_what_the_generator_wrote_and_every_count_adds_up(fuzzed, fuzz_records):
    corpus, out, _ = fuzzed
    report = json.loads((out / "report.json").read_text())
    generated = sum(f.records for fuzz in corpus.values() for f in fuzz.files.values())
    assert generated >= fuzz_records
    for name, fuzz in corpus.items():
        files = report["sources"][name]["files"]
        # Every file has its own entry, also where two folders hold files of the same name.
        assert set(files) == set(fuzz.files)
        for rel, made in fuzz.files.items():
            counts = files[rel]
            assert counts["read"] == counts["written"] + counts["quarantined"] + counts["duplicates"], rel
            if made.expected is not None:
                assert counts["read"] == made.expected, (rel, made.damage)
            if made.damage == "empty":
                assert counts["read"] == 0 and counts["note"] == "empty file: no records"
    for entry in [*report["sources"].values(), report["total"]]:
        assert entry["read"] == entry["written"] + entry["quarantined"] + entry["duplicates"]
        assert entry["quarantined"] == sum(entry["reasons"].values())
    total = report["total"]
    assert total["written"] == sum(pq.read_metadata(out / p).num_rows for p in report["outputs"]["sft"])
    assert total["duplicates"] == pq.read_metadata(out / "duplicates.parquet").num_rows
    assert "internal_error" not in total["reasons"], "the fuzz found a failure no rule names"


def test_every_quarantine_row_has_a_reason_and_its_raw_input(fuzzed):
    corpus, out, _ = fuzzed
    report = json.loads((out / "report.json").read_text())
    rows = pq.read_table(out / "quarantine" / "quarantine.parquet").to_pylist()
    weighted: Counter[tuple[str, str]] = Counter()
    for row in rows:
        assert row["reason"], row
        assert row["raw"] or re.search(r"bytes \d+-\d+", row["detail"]), row
        group = GROUP_ROWS.search(row["detail"]) if row["reason"] == "unreadable_row_group" else None
        weighted[row["source"], row["source_file"]] += int(group[1]) if group else 1
    for name, entry in report["sources"].items():
        for rel, counts in entry["files"].items():
            assert weighted[name, rel] == counts["quarantined"], rel


def test_each_damage_and_mutation_ends_where_it_must(fuzzed):
    corpus, out, _ = fuzzed
    quarantine = pq.read_table(out / "quarantine" / "quarantine.parquet").to_pylist()
    reasons_by_file: dict[tuple[str, str], set[str]] = defaultdict(set)
    for row in quarantine:
        reasons_by_file[row["source"], row["source_file"]].add(row["reason"])
    sft = pq.read_table(out / "data" / "sft", columns=["source", "source_id"]).to_pylist()
    written = {(r["source"], r["source_id"]) for r in sft}
    seen = Counter()
    for name, fuzz in corpus.items():
        for rel, made in fuzz.files.items():
            seen[made.damage] += 1
            if made.damage in DAMAGE_REASONS:
                assert DAMAGE_REASONS[made.damage] in reasons_by_file[name, rel], (rel, made.damage)
            for tag in NEVER_WRITTEN:
                assert not written & {(name, i) for i in made.marked.get(tag, [])}, (rel, tag)
            if made.damage == "none":
                if made.marked.get("deep"):
                    assert "too_deep" in reasons_by_file[name, rel], rel
                if made.marked.get("surrogate") and not rel.endswith(".parquet"):
                    assert "unpaired_surrogate" in reasons_by_file[name, rel], rel
            seen.update(tag for tag, ids in made.marked.items() if ids)
    # The corpus held every case the suite is about.
    assert {"bom", "truncated", "flipped_row_group", "empty", "role_dict", "role_list", "deep", "surrogate"} <= set(seen)


def test_the_corpus_is_reproducible(tmp_path):
    first = generate(tmp_path / "a", {"agenttraj_l": SOURCES["agenttraj_l"]}, 200, SEED)
    second = generate(tmp_path / "b", {"agenttraj_l": SOURCES["agenttraj_l"]}, 200, SEED)
    assert first["agenttraj_l"].files.keys() == second["agenttraj_l"].files.keys()
    for rel in first["agenttraj_l"].files:
        assert (tmp_path / "a" / "agenttraj_l" / rel).read_bytes() == (tmp_path / "b" / "agenttraj_l" / rel).read_bytes()
