"""Start-up cost of an `os` episode: `reset()` + `close()` of a task with no init script, N times,
and of one more process started inside each episode (what each init or check script, and Ctrl-C
at a timeout, costs on top).

Usage (as root, with bubblewrap): python bench/bench_os_sandbox.py [--episodes 10]

Reports medians and the slowest, after one warm-up episode (imports, page cache, the seccomp
filter's compilation), and the load average, since the figures move with it.
"""
from __future__ import annotations

import argparse
import os
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
    episodes, processes = [], []
    for _ in range(args.episodes):
        started = time.perf_counter()
        env.reset(task)
        env.close()
        episodes.append(time.perf_counter() - started)
        env.reset(task)
        started = time.perf_counter()
        run = env.sandbox.run_script({"language": "bash", "code": "true"}, [], timeout=30)
        processes.append(time.perf_counter() - started)
        env.close()
        assert run.exit_code == 0, run
    print(f"reset+close over {args.episodes} episodes: total {sum(episodes):.2f} s, "
          f"median {statistics.median(episodes) * 1000:.0f} ms, max {max(episodes) * 1000:.0f} ms; "
          f"one more process inside: median {statistics.median(processes) * 1000:.0f} ms, "
          f"max {max(processes) * 1000:.0f} ms (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
