"""Ingest throughput and memory: does peak memory stay flat as the input grows?

Scales the real AgentTraj-L fixture rows up to N rows in one JSON array (the upstream container),
then runs the ingest stage (read + normalize + validate + stage to Parquet) for 1x and 8x sizes
in fresh processes and reports rows/s and the peak RSS of the reader alone and of the stage.

    python bench/bench_ingest.py --rows 4000
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RAW = REPO.parent / "shared" / "fixtures" / "raw" / "agenttraj_l"


def make_input(path: Path, rows: int) -> None:
    base = [r for f in sorted(RAW.glob("*.json")) for r in json.loads(f.read_text())]
    with open(path, "w") as fh:
        fh.write("[")
        for i in range(rows):
            row = dict(base[i % len(base)])
            row["item_id"] = f"{row['item_id']}_{i}"
            fh.write(("," if i else "") + json.dumps(row))
        fh.write("]")


def _read_only(path: str, queue) -> None:
    from trajforge.sources import iter_rows
    start = time.perf_counter()
    n = sum(1 for _ in iter_rows(Path(path)))
    queue.put((n, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))


def _stage(path: str, queue) -> None:
    from trajforge.pipeline.build import BuildConfig, process_unit
    from trajforge.sources.base import SourceFile
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as staging:
        unit = process_unit("agenttraj_l", SourceFile(Path(path), "webshop"), Path(staging), BuildConfig())
    queue.put((unit.read, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))


def run(target, path: Path):
    queue = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=target, args=(str(path), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        sizes = {}
        for factor in (1, 8):
            path = Path(tmp) / f"webshop_{factor}_train.json"
            make_input(path, args.rows * factor)
            sizes[factor] = path.stat().st_size / 2**20
            n, secs, rss = run(_read_only, path)
            print(f"read   {n:>7} rows  {sizes[factor]:7.1f} MiB  {n / secs:9.0f} rows/s  peak RSS {rss / 1024:6.1f} MiB")
            sizes[(factor, "read")] = rss
            n, secs, rss = run(_stage, path)
            print(f"stage  {n:>7} rows  {sizes[factor]:7.1f} MiB  {n / secs:9.0f} rows/s  peak RSS {rss / 1024:6.1f} MiB")
        print(f"reader peak RSS ratio 8x/1x input: {sizes[(8, 'read')] / sizes[(1, 'read')]:.2f} "
              f"(input grew {sizes[8] / sizes[1]:.1f}x)")


if __name__ == "__main__":
    main()
