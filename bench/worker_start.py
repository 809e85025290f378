"""How long the `processes` runner's workers take to be ready for their first unit: spawned (Prefect's
ProcessPoolTaskRunner as it is: each worker a new interpreter importing Prefect and the stages) or
forked from a fork server that loaded them once (flows/workers.py), started before the pool as the
CLI does.

Usage: python bench/worker_start.py [--workers 2] [--repeat 3]

Per try: the wall time from the pool's creation until each worker has run one call that needs the
build's modules (what a worker's first unit imports), and the CPU of the processes it took (the
workers, and the fork server's loading, which the CLI overlaps with its own imports and the
temporary server's start). Spawn and fork server alternate.
"""
from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.forkserver
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajforge.flows.workers import PRELOAD  # noqa: E402


def ready(delay: float) -> int:
    """A first call: the build's modules, as a unit task needs them."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    time.sleep(delay)  # held, so that every worker takes one call
    return multiprocessing.current_process().pid


def _cpu(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def one(method: str, workers: int) -> tuple[float, float]:
    start = time.perf_counter()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method)) as pool:
        pids = set(pool.map(ready, [0.3] * workers))
        wall = time.perf_counter() - start
        new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        cpu = _cpu([p for p in new if p.pid in pids])
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    server = psutil.Process(multiprocessing.forkserver._forkserver._forkserver_pid)
    # The fork server's loading (the CLI starts it before it imports anything heavy itself).
    multiprocessing.get_context("forkserver").Process(target=len, args=("",)).start()
    print(f"fork server loaded in {time.perf_counter() - started:.2f} s wall, {_cpu([server]):.2f} s CPU")
    for _ in range(args.repeat):
        for method in ("spawn", "forkserver"):
            wall, cpu = one(method, args.workers)
            print(f"{method:10s} {args.workers} workers ready: {wall:5.2f} s wall, workers' CPU {cpu:5.2f} s (minus the 0.3 s hold)")


if __name__ == "__main__":
    main()
