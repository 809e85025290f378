"""SIGTERM and Ctrl-C stop a build or a synthesis within seconds, with their worker processes, publish
nothing half-way, and the same command run again resumes (flows/stopping.py)."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.openai_server import Server, fixture_policy
from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES, FIXTURES, REPO
from trajforge.pipeline.build import build_in_process
from trajforge.pipeline.publish.manifest import read_manifest

pytestmark = pytest.mark.slow

SOURCES = {**FIXTURE_SOURCES, "agent_flan": str(AGENT_FLAN)}
DB_FILE = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"
MODEL = "deepseek-ai/DeepSeek-R1"
# The stop grace (4 s) and the child processes' own stop, with room for a loaded 2-core machine.
STOP_BOUND_S = 15.0


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def published(out: Path) -> dict[str, str]:
    """Every file the manifest names, and the manifest itself, by content."""
    files = read_manifest(out)["files"]
    return {rel: sha256(out / rel) for rel in sorted(files)} | {"manifest.json": sha256(out / "manifest.json")}


def assert_nothing_half_published(out: Path) -> None:
    """A folder with a manifest holds exactly the files it names (a stop before the manifest's
    rename leaves none)."""
    if (out / "manifest.json").exists():
        for rel, entry in read_manifest(out)["files"].items():
            assert sha256(out / rel) == entry["sha256"], rel


def environment(tmp_path: Path) -> dict[str, str]:
    """This environment (PYTHONPATH too: it may point at the checkout under test) with a Prefect
    home of the test's own."""
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
    return {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PYTHONPATH": path}


def start(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    # Its own session: a group signal reaches the command, its workers and Prefect's server, not pytest.
    with open(log, "ab") as sink:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen, signum: int, group: bool) -> float:
    """Signal the command (or its whole group, as `timeout` and Ctrl-C do); the seconds it took to
    exit. Every process it had started (workers, Prefect's server) is gone too."""
    children = psutil.Process(proc.pid).children(recursive=True)
    sent = time.monotonic()
    (os.killpg if group else os.kill)(proc.pid, signum)
    proc.wait(timeout=120)
    elapsed = time.monotonic() - sent
    # multiprocessing's resource tracker ends once it reads the command's exit.
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in alive]
    return elapsed


def wait_below(proc: subprocess.Popen, ready) -> list[psutil.Process]:
    """Until `ready` holds of the processes below the running command, each given as (a child of
    the command's own, Prefect's server); returns them (none where the command ended first)."""
    while proc.poll() is None:
        try:
            below = psutil.Process(proc.pid).children(recursive=True)
            if ready([(p.ppid() == proc.pid, "uvicorn" in p.cmdline()) for p in below]):
                return below
        except psutil.Error:  # a child that ended meanwhile
            pass
        time.sleep(0.05)
    return []


def wait_for_server(proc: subprocess.Popen) -> None:
    """Until Prefect's temporary server runs: the command is past its start-up (a signal before
    that ends the bare interpreter, which has nothing to stop yet)."""
    wait_below(proc, lambda below: any(child and server for child, server in below))


def wait_for_workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """Until the command's task runner has forked its workers from the fork server (processes two
    levels below the command) and Prefect's temporary server runs; then every process below it."""
    below = wait_below(proc, lambda below: any(not child for child, _ in below)
                       and any(child and server for child, server in below))
    assert below, f"the command ended (status {proc.returncode}) before its workers started"
    return below


@pytest.fixture(scope="module")
def clean_build(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("clean")
    build_in_process(SOURCES, out)
    return published(out)


def test_build_stopped_at_random_points_then_rerun_publishes_the_clean_build(tmp_path, clean_build):
    """SIGTERM to the command (systemd, Kubernetes), SIGTERM to its group (`timeout`) and SIGINT to its
    group (Ctrl-C), each a seeded random delay after Prefect's temporary server is up (the processes
    runner; each run resumes the one before); then the same command once more."""
    out = tmp_path / "out"
    env = environment(tmp_path)
    command = [sys.executable, "-m", "trajforge.flows.cli", "build", "--runner", "processes", "--workers", "2",
               "--out", str(out), *(arg for name, path in SOURCES.items() for arg in ("--source", f"{name}={path}"))]
    rng = random.Random(22)
    stopped = 0
    for run, (signum, group) in enumerate([(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, True)]):
        log = tmp_path / f"build-{run}.log"
        proc = start(command, env, log)
        wait_for_server(proc)
        time.sleep(rng.uniform(0.0, 4.0))
        if proc.poll() is not None:  # finished before the signal: nothing to stop this time
            assert proc.returncode == 0, log.read_text()[-3000:]
            continue
        elapsed = stop(proc, signum, group)
        text = log.read_text()
        assert proc.returncode == 128 + signum, text[-3000:]
        assert elapsed < STOP_BOUND_S, f"{elapsed:.1f} s to stop"
        assert f"trajforge: stopped by {signal.Signals(signum).name}" in text
        assert_nothing_half_published(out)
        stopped += 1
    assert stopped >= 2, "the build finished before most signals: lengthen nothing, look at the delays"

    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert published(out) == clean_build
    assert not list(out.rglob(".*.tmp-*")), "temp files of the stopped runs are left"


def test_build_killed_outright_leaves_no_process_behind(tmp_path):
    """SIGKILL to the command alone (`kill -9`, the OOM killer) runs no handler of its own: its
    workers, the fork server and Prefect's temporary server end by themselves within seconds."""
    command = [sys.executable, "-m", "trajforge.flows.cli", "build", "--runner", "processes", "--workers", "2",
               "--out", str(tmp_path / "out"),
               *(arg for name, path in SOURCES.items() for arg in ("--source", f"{name}={path}"))]
    proc = start(command, environment(tmp_path), tmp_path / "build.log")
    below = wait_for_workers(proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(below, timeout=STOP_BOUND_S)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    try:
        assert not alive, [p.cmdline()[:4] for p in alive]
    finally:
        for process in alive:
            process.kill()


def journaled(out: Path) -> int:
    path = out / ".synth" / "episodes.sqlite"
    if not path.exists():
        return 0
    with sqlite3.connect(path) as db:
        try:
            return db.execute("SELECT count(*) FROM episodes").fetchone()[0]
        except sqlite3.OperationalError:  # not created yet
            return 0


def test_synth_stopped_mid_run_exits_in_seconds_and_the_rerun_resumes(tmp_path):
    out = tmp_path / "synth"
    env = environment(tmp_path)
    log = tmp_path / "synth.log"
    with Server(fixture_policy(db_files=[DB_FILE]), latency_s=0.3) as server:
        command = [sys.executable, "-m", "trajforge.flows.cli", "synth", "--tasks", str(DB_FILE), "--env", "db",
                   "--model", MODEL, "--base-url", server.base_url, "--n", "1", "--episodes", "2",
                   "--concurrency", "2", "--out", str(out)]
        proc = start(command, env, log)
        deadline = time.monotonic() + 300
        while journaled(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        elapsed = stop(proc, signal.SIGTERM, group=False)
        assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
        assert elapsed < STOP_BOUND_S, f"{elapsed:.1f} s to stop"
        done = journaled(out)
        assert 3 <= done < 39
        # Nothing published: the records and the report are written once every episode has ended.
        assert not (out / "data").exists() and not (out / "report.json").exists()

        rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())["db"]
    # The journaled episodes are not run again; every other one is.
    assert report["episodes_resumed"] == done
    assert report["episodes_run"] + report["skipped"] == report["episodes"] - done
    assert report["episodes"] == 39 and (out / "data" / "synthetic" / "db.parquet").exists()
