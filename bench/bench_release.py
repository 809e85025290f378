"""The end of a build in one process: the card and the manifest of a finished build, as main wrote
them (every shard's metadata, (source, license) pairs and sha256 read again by the flow) against
this branch (the writers' figures of each shard passed in), alternated.

Usage: python bench/bench_release.py BUILD [--repeat N]

BUILD is the output folder of `trajforge build` (it is hard-linked into a temp folder, whose card
and manifest are rewritten). Prints the flow's wall and CPU seconds per variant, and the CPU the
workers spend on `shard_facts` (once per shard, while it is in the page cache), and checks that both
variants write the same card and manifest bytes.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from trajforge.pipeline.build.second_half import shard_facts
from trajforge.pipeline.publish.card import layout, write_card
from trajforge.pipeline.publish.manifest import MANIFEST, file_entry, read_manifest, write_manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("build", type=Path)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_release_") as tmp:
        out = Path(tmp) / "build"
        subprocess.run(["cp", "-al", str(args.build), str(out)], check=True)
        shutil.rmtree(out / ".staging", ignore_errors=True)
        manifest = read_manifest(out)
        files = [rel for rel in manifest["files"] if rel != "README.md"]
        report = json.loads((out / "report.json").read_text())
        shards = [rel for splits in layout(out).values() for paths in splits.values() for rel in paths]
        start = time.process_time()
        known = {rel: shard_facts(out / rel) for rel in shards}
        known["quarantine/quarantine.parquet"] = file_entry(out / "quarantine/quarantine.parquet")
        workers_cpu = time.process_time() - start
        figures: dict[str, list[tuple[float, float]]] = {"main": [], "branch": []}
        written: dict[str, bytes] = {}
        for _ in range(args.repeat):
            for name, given in (("main", None), ("branch", known)):
                wall, cpu = time.perf_counter(), time.process_time()
                write_card(out, report, [], manifest["build_id"], "bench", {}, given)
                write_manifest(out, manifest["build_id"], [*files, "README.md"], given)
                figures[name].append((time.perf_counter() - wall, time.process_time() - cpu))
                written[name] = (out / "README.md").read_bytes() + (out / MANIFEST).read_bytes()
        for name, runs in figures.items():
            print(f"{name:7s} flow: wall " + " ".join(f"{w:.3f}" for w, _ in runs)
                  + " s; CPU " + " ".join(f"{c:.3f}" for _, c in runs) + " s")
        print(f"workers: shard_facts of {len(shards)} shards + the quarantine's entry, CPU {workers_cpu:.3f} s")
        print("card and manifest bytes: " + ("identical" if written["main"] == written["branch"] else "DIFFER"))


if __name__ == "__main__":
    main()
