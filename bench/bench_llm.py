"""LLM client throughput: calls/s at concurrency C against a server with fixed latency, vs the ideal C/latency.

The loopback test server runs in its own process (so that it does not share our event loop or
GIL) and answers every call after `--latency` seconds; the ideal rate is concurrency / latency
(64 / 0.2 s = 320 calls/s). The client is the real OpenAIBackend with its request cache on (each
call is a distinct request, so every call is a miss and a write), as in a synthesis job.

    python bench/bench_llm.py                      # 1280 calls, concurrency 64, 200 ms
    python bench/bench_llm.py --calls 640 --concurrency 32 --latency 0.1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trajforge.pipeline.llm.client import LLMConfig, OpenAIBackend  # noqa: E402


async def run(base_url: str, calls: int, concurrency: int, cache: str) -> tuple[float, float, int]:
    backend = OpenAIBackend(LLMConfig(model="deepseek-ai/DeepSeek-R1", base_url=base_url, api_key="sk-bench",
                                      concurrency=concurrency, cache_path=cache))
    messages = [{"role": "system", "content": "You are a helpful agent."}]
    try:
        # Warm-up: open the connection pool, so the measurement is the steady state.
        await asyncio.gather(*(backend.chat(messages + [{"role": "user", "content": f"warm {i}"}])
                               for i in range(concurrency)))
        started, cpu = time.perf_counter(), time.process_time()
        results = await asyncio.gather(*(backend.chat(messages + [{"role": "user", "content": f"task {i}"}])
                                         for i in range(calls)))
        elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        await backend.aclose()
    assert not any(r.choices[0].empty for r in results)
    return elapsed, cpu, backend.stats.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1280)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.2)
    args = parser.parse_args()

    server = subprocess.Popen([sys.executable, "-m", "tests.support.openai_server", "--latency", str(args.latency)],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        base_url = server.stdout.readline().strip()
        with tempfile.TemporaryDirectory() as tmp:
            elapsed, cpu, sent = asyncio.run(run(base_url, args.calls, args.concurrency, str(Path(tmp) / "cache.sqlite")))
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats") as response:
            served = json.load(response)["calls"]
    finally:
        server.terminate()
        server.wait(10)
    rate = args.calls / elapsed
    ideal = args.concurrency / args.latency
    print(json.dumps({"calls": args.calls, "concurrency": args.concurrency, "latency_s": args.latency,
                      "elapsed_s": round(elapsed, 3), "calls_per_s": round(rate, 1), "ideal_calls_per_s": round(ideal, 1),
                      "fraction_of_ideal": round(rate / ideal, 3), "served_by_server": served,
                      "sent_by_client": sent,
                      # The client is CPU-bound when the rate falls short: its CPU per call bounds the
                      # rate one free core could sustain; the load average says how free the cores were.
                      "client_cpu_ms_per_call": round(cpu / args.calls * 1000, 2),
                      "one_core_ceiling_calls_per_s": round(args.calls / cpu, 1),
                      "load_average_1m": os.getloadavg()[0], "cpus": os.cpu_count()}, indent=2))


if __name__ == "__main__":
    main()
