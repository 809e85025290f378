"""What one Prefect task run costs in CPU, outside the task's own work, on the build's task runner.

Usage: python bench/prefect_task_cost.py [--tasks N ...] [--workers W]

A flow on the build's `processes` runner (`make_task_runner("processes", W, api_url)`: Prefect's
ProcessPoolTaskRunner, its workers forked from the fork server and told the run's API), against a
temporary server as the CLI starts it (flows/temporary_server.py), submits N no-op tasks, for each N
given, after two warm-up tasks have started the workers.
It prints the CPU (user + system, from psutil) that the flow process, its workers and the server
spent on the N task runs, and per task the difference between the largest and the smallest N:
the flow's submission (the context it sends), the worker's (the context rebuilt, the task engine;
its client is the worker's own, opened once) and the server's (the task run's events and logs).
CPU rather than wall: on a shared machine it moves far less with the load.
"""
from __future__ import annotations

import argparse
import time

import psutil
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from trajforge.flows.build import make_task_runner
from trajforge.flows.temporary_server import TemporaryServer


@task(cache_policy=NO_CACHE, persist_result=False)
def noop(calls: list) -> list:
    return [len(call) for call in calls]


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _role(process: psutil.Process) -> str:
    line = " ".join(process.cmdline())
    return "server" if "uvicorn" in line else "worker" if "forkserver" in line else "other"


def task_cost(tasks: int) -> dict[str, float]:
    """CPU seconds per role (flow, worker, server) that `tasks` no-op task runs cost."""
    me = psutil.Process()
    noop.submit([()]).result()
    noop.submit([()]).result()
    before = {p.pid: _cpu(p) for p in [me, *me.children(recursive=True)]}
    for future in [noop.submit([(1, 2)] * 4) for _ in range(tasks)]:
        future.result()
    time.sleep(3)  # the server records the last events
    spent = {"flow": _cpu(me) - before[me.pid], "worker": 0.0, "server": 0.0}
    for child in me.children(recursive=True):
        role = _role(child)
        if role != "other" and child.pid in before:
            spent[role] += _cpu(child) - before[child.pid]
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[10, 40])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    @flow
    def submit_tasks(tasks: int) -> dict[str, float]:
        return task_cost(tasks)

    server = TemporaryServer().start()
    try:
        with server.api():
            # The workers told this run's API, as the build's are (one client each, for their life).
            runner = make_task_runner("processes", workers=args.workers, api_url=server.url)
            results = {n: submit_tasks.with_options(task_runner=runner)(n) for n in sorted(args.tasks)}
    finally:
        server.stop()
    for n, spent in results.items():
        print(f"{n:4d} tasks: " + ", ".join(f"{role} {s:.2f} s" for role, s in spent.items()))
    low, high = min(results), max(results)
    if high > low:
        per = {role: (results[high][role] - results[low][role]) / (high - low) for role in results[high]}
        print("per task: " + ", ".join(f"{role} {s * 1000:.0f} ms" for role, s in per.items())
              + f", in all {sum(per.values()) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
