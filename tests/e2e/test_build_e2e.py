"""`trajforge build` end to end on every fixture source: the real CLI, the real Prefect flow.

This is the one place the build pays Prefect's embedded-server start-up.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import datasets
import polars as pl
import pytest

from tests.support.expected import FIXTURE_QUARANTINE
from tests.support.paths import FIXTURES, REPO
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.schemas import validator


@pytest.mark.slow
def test_trajforge_build_on_the_fixtures(tmp_path):
    """From the shipped example config (its sources are every fixture source), with options over it."""
    out = tmp_path / "build"
    # The processes runner: the flow on Prefect's temporary server (the small fixtures alone would
    # build in process, tests/e2e/test_small_build.py); --verbose: its task logs on the console.
    args = [sys.executable, "-m", "trajforge.flows.cli", "build", "--config", str(REPO / "configs" / "build.yaml"),
            "--out", str(out), "--rl-tasks", str(FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"),
            "--runner", "processes", "--verbose"]
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Progress while running and a summary at the end.
    assert "units done:" in proc.stdout + proc.stderr
    # One temporary server, started and stopped by the CLI (flows/temporary_server.py), and no link to
    # a UI it does not serve.
    logs = proc.stdout + proc.stderr
    assert logs.count("Starting temporary server") == logs.count("Stopping temporary server") == 1, logs[-3000:]
    assert "View at" not in logs
    assert "total" in proc.stdout and "quarantine" in proc.stdout

    report = json.loads((out / "report.json").read_text())
    assert set(report["sources"]) == {"agentinstruct", "agenttraj_l", "openmanus_rl", "agent_flan"}
    total = report["total"]
    assert total["read"] == total["written"] + total["quarantined"] + total.get("duplicates", 0)
    quarantine = pl.read_parquet(out / "quarantine" / "quarantine.parquet")
    assert Counter(zip(quarantine["source_id"], quarantine["reason"])) == FIXTURE_QUARANTINE
    # The DB task file's 39 tasks, plus the AgentGym items the AgentTraj-L trajectories were recorded on.
    rl_tasks = pl.read_parquet(out / "data" / "grpo_env" / "*.parquet")
    assert report["grpo_env"] == {"rows": rl_tasks.height, "unrunnable_tasks": 0}
    assert rl_tasks.filter(pl.col("environment") == "db").height == 39
    assert rl_tasks.filter(pl.col("environment") == "agentgym").height > 0

    ds = datasets.load_dataset("parquet", data_files=str(out / "data" / "sft" / "*.parquet"), split="train")
    frame = pl.read_parquet(out / "data" / "sft" / "*.parquet")
    assert len(ds) == frame.height > 0
    assert frame["id"].n_unique() == frame.height
    for record in ds:
        assert not list(validator("trajectory").iter_errors(record)), record["id"]
        if record["kind"] == "positive":
            assert validate_record(record) is None, record["id"]
