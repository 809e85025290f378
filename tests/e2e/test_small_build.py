"""A small build takes seconds and says little: `trajforge build` on the fixtures runs in process
(`--runner auto`, no Prefect server set: no temporary server, no worker processes), prints its short
report, and publishes the same bytes as the build's plain functions. bench/bench_small_build.py
measures the time."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import FIXTURE_SOURCES, REPO
from trajforge.pipeline.publish.manifest import read_manifest

MAX_LINES = 25


def published(out) -> dict[str, bytes]:
    return {rel: (out / rel).read_bytes() for rel in sorted(read_manifest(out)["files"])}


def build(out, tmp_path, *options: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"),
               PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])))
    sources = [arg for name, path in FIXTURE_SOURCES.items() for arg in ("--source", f"{name}={path}")]
    return subprocess.run([sys.executable, "-m", "trajforge.flows.cli", "build", "--out", str(out), *sources,
                           *options], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_small_build_runs_in_process_says_little_and_publishes_the_same_bytes(tmp_path, fixtures_build):
    out = tmp_path / "out"
    proc = build(out, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    assert len(lines) <= MAX_LINES, "\n".join(lines)
    # The short report: counts per source with reasons and duplicates, the stages, the shards.
    assert lines[0].split() == ["source", "read", "written", "quarant.", "dups", "reasons"]
    assert any(line.startswith("agentinstruct") and "invalid_action=" in line for line in lines)
    assert any(line.startswith("stages: read") and "dedup_near" in line for line in lines)
    assert any(line.startswith("shards: sft 1") for line in lines)
    # No Prefect run: no temporary server made a database in the Prefect home.
    assert not list(tmp_path.glob("prefect/*.db"))
    assert published(out) == published(fixtures_build)

    # Verbose: the per-unit log lines, and a rerun that finds every unit done.
    again = build(out, tmp_path, "--verbose")
    assert again.returncode == 0, again.stderr[-3000:]
    units = len(list((out / ".staging" / "markers" / "units").glob("*.done")))
    assert again.stderr.count("done in an earlier run, skipped") == units > 0
    assert f"units done: {units}/{units}" in again.stderr
    assert published(out) == published(fixtures_build)
