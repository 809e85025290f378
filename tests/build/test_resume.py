"""Crash safety: SIGKILL `trajforge build` mid-way; the rerun skips finished units, output identical."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import RAW, REPO
from trajforge.pipeline.build import BuildConfig, finalize, process_unit
from trajforge.pipeline.build.units import unit_files
from trajforge.pipeline.publish.manifest import read_manifest
from trajforge.sources import get_source

pytestmark = pytest.mark.slow


def make_source(folder: Path) -> Path:
    """AgentTraj-L's fixture files plus one large env file, so the build spends seconds on one unit."""
    shutil.copytree(RAW / "agenttraj_l", folder)
    rows = json.loads((folder / "webshop_train.json").read_text())
    big = [dict(row, item_id=f"{row['item_id']}{copy:04d}") for copy in range(3000) for row in rows]
    # The largest unit: the flow starts it first, and it still runs once the pool has finished most small units.
    (folder / "zz_webshop_train.json").write_text(json.dumps(big))
    return folder


def staged(out: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (out / ".staging").iterdir() if p.is_file()}


def markers(out: Path) -> set[str]:
    folder = out / ".staging" / "markers" / "units"
    return {p.name for p in folder.glob("*.done")} if folder.exists() else set()


def test_sigkill_then_rerun_skips_done_units_and_matches_a_clean_build(tmp_path):
    src = make_source(tmp_path / "agenttraj_l")
    out = tmp_path / "out"
    n_units = len(get_source("agenttraj_l").files(str(src)))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect_home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "trajforge.flows.cli", "build", "--source", f"agenttraj_l={src}", "--out", str(out)]

    with open(tmp_path / "killed.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 240
        # Kill once most small units are done and the large one is running.
        while len(markers(out)) < n_units - 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        done_before = markers(out)
        staged_before = staged(out)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()[-3000:]
    assert 0 < len(done_before) < n_units and not any(m.startswith("agenttraj_l__zz_webshop") for m in done_before)
    assert not (out / "manifest.json").exists()

    rerun = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert done_before <= markers(out) and len(markers(out)) == n_units
    after = staged(out)
    for marker in done_before:
        for path in unit_files(Path(), marker.removesuffix(".done")).values():
            assert after[path.name] == staged_before[path.name], f"{path.name} was redone"

    clean = tmp_path / "clean"
    config = BuildConfig()
    units = [process_unit("agenttraj_l", f, clean / ".staging", config)
             for f in get_source("agenttraj_l").files(str(src))]
    finalize(units, clean, config)
    assert read_manifest(out) == read_manifest(clean)
    for rel in read_manifest(clean)["files"]:
        assert (out / rel).read_bytes() == (clean / rel).read_bytes(), rel
