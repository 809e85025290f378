"""A small build end to end: `trajforge build` over the repository's fixture records (183 trajectories
in the four upstream layouts, as in configs/build.yaml), timed through the real CLI.

Usage: python bench/bench_small_build.py [--runs N] [--runner auto] [--verbose]

Each run is a fresh process into a fresh output folder (a new PREFECT_HOME each time too, so a
Prefect run pays its temporary server as a first run does). Prints, per run, the wall time, the CPU
seconds of the build's processes and the lines printed (stdout and stderr), then the medians and the
machine's load. `--runner processes`
shows the Prefect flow with worker processes for comparison; `--verbose` adds the task logs.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = {"agentinstruct": "tests/fixtures/raw/agentinstruct", "agenttraj_l": "tests/fixtures/raw/agenttraj_l",
           "openmanus_rl": "tests/fixtures/raw/openmanus_rl", "agent_flan": "tests/fixtures/agent_flan"}


def run_once(work: Path, runner: str, verbose: bool) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of the build's processes, lines printed) of one `trajforge build`.
    CPU seconds hardly depend on what else the machine runs: on a quiet machine the wall time of a
    one-process build is close to them."""
    env = {key: value for key, value in os.environ.items() if key not in ("PREFECT_API_URL", "PREFECT_LOGGING_LEVEL")}
    env["PREFECT_HOME"] = str(work / "prefect")
    command = [sys.executable, "-m", "trajforge.flows.cli", "build", "--out", str(work / "out"), "--runner", runner,
               *(arg for name, path in SOURCES.items() for arg in ("--source", f"{name}={path}"))]
    if verbose:
        command.append("--verbose")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if done.returncode != 0:
        raise SystemExit(f"build failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall, cpu, len((done.stdout + done.stderr).splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--runner", default="auto", choices=["auto", "processes", "threads"])
    parser.add_argument("--verbose", action="store_true", help="pass --verbose to the build")
    args = parser.parse_args()
    walls, cpus, lines = [], [], []
    for number in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="bench-small-") as work:
            wall, cpu, printed = run_once(Path(work), args.runner, args.verbose)
        walls.append(wall)
        cpus.append(cpu)
        lines.append(printed)
        print(f"run {number}: {wall:.1f} s wall, {cpu:.1f} s CPU, {printed} lines", flush=True)
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"runner {args.runner}{' --verbose' if args.verbose else ''}: median {statistics.median(walls):.1f} s "
          f"(min {min(walls):.1f}, max {max(walls):.1f}), CPU median {statistics.median(cpus):.1f} s over "
          f"{args.runs} runs, {max(lines)} lines at most; "
          f"load average {load} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
