"""Start-up cost of an `os` episode: `reset()` + `close()` of a task with no init script, N times.

Usage (as root, with bubblewrap): python bench/bench_os_sandbox.py [--episodes 10]

Reports the median and the slowest episode, after one warm-up episode (imports, page cache).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajforge.pipeline.synth.envs import make_env  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=10)
    args = parser.parse_args()
    task = {"env": "os", "description": "start-up", "evaluation": {"match": "x"}}
    env = make_env("os")
    env.reset(task)
    env.close()
    took = []
    for _ in range(args.episodes):
        started = time.perf_counter()
        env.reset(task)
        env.close()
        took.append(time.perf_counter() - started)
    print(f"reset+close over {args.episodes} episodes: total {sum(took):.2f} s, "
          f"median {statistics.median(took) * 1000:.0f} ms, max {max(took) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
