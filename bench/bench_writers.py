"""The CPU of the build's unit writers (`write_unit`) on staged units, in one process.

Usage: python bench/bench_writers.py prepare N --work DIR     (stage a build's write_unit calls)
       python bench/bench_writers.py time --work DIR [--reps R] [--old PKG] [--cprofile FILE]
       valgrind --tool=callgrind --collect-atstart=no --toggle-collect=functools_reduce \
         python bench/bench_writers.py count --work DIR [--old PKG] [--units 0,1] [--rows N]

`prepare` builds N trajectories of bench/bench_build.py's generated corpus (made under DIR/corpus, or
reused: bench/profile_build.py's) with the build's plain functions, and keeps every `write_unit`
call of its `finalize`: the unit's staged records (copied to DIR/units) and the call's arguments
(DIR/calls.pickle). `time` runs those calls again, each repetition over every unit, and prints
the CPU time (time.process_time) of each repetition and the median per kept record. With `--old
PKG` it alternates this tree's `write_unit` with that of PKG, an importable copy of other code
(`trajforge_old`: a `git archive` of a commit with `trajforge.` renamed, see `old_copy`), and
checks that both wrote the same rows (tables equal, counts equal): a same-process A/B. `count` runs
one variant (`--old` or this tree's) once to warm up, then once more inside `functools.reduce`,
which callgrind's `--toggle-collect` counts alone: instructions, which the load does not move (a
busy machine moves CPU times by 20 %); `--units` and `--rows` (the first N kept of each) keep it short.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import importlib
import pickle
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_build import DEFAULT_FIXTURES  # noqa: E402
from bench.profile_build import sources_of  # noqa: E402
from trajforge.pipeline.build import BuildConfig, process_unit, second_half  # noqa: E402
from trajforge.sources import get_source  # noqa: E402

OLD_COPY = """old_copy: mkdir -p DIR/trajforge_old && git archive COMMIT pipeline schemas sources training flows |
  tar -x -C DIR/trajforge_old && grep -rl 'trajforge\\.' DIR/trajforge_old --include=*.py |
  xargs sed -i 's/trajforge\\./trajforge_old./g'; then PYTHONPATH=DIR:$PYTHONPATH"""


def prepare(n: str, work: Path) -> None:
    sources = sources_of(n, work, DEFAULT_FIXTURES)
    config, out, kept = BuildConfig(), work / "build", work / "units"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(kept, ignore_errors=True)
    kept.mkdir(parents=True)
    units = [process_unit(name, f, out / ".staging", config)
             for name, location in sources.items() for f in get_source(name).files(location)]
    calls = []
    write_unit = second_half.write_unit

    def keep(records_path, staged, *args):
        copy = kept / f"{len(calls):05d}.records.arrow"
        shutil.copyfile(records_path, copy)
        calls.append((str(copy), *args))
        return write_unit(records_path, staged, *args)

    second_half.write_unit = keep
    second_half.finalize(units, out, config)
    (work / "calls.pickle").write_bytes(pickle.dumps(calls))
    print(f"{len(calls)} write_unit calls, {sum(len(c[1]) for c in calls)} kept records, in {work}")


def run_all(write_unit, calls: list, into: Path) -> tuple[float, list]:
    shutil.rmtree(into, ignore_errors=True)
    t0 = time.process_time()
    results = [write_unit(path, str(into / f"{u:05d}"), *args) for u, (path, *args) in enumerate(calls)]
    return time.process_time() - t0, results


def outputs_of(results: list) -> list:
    """What a run wrote: per unit and output, the staged table (read back) and the counts, and its
    outputs' Arrow bytes and rows (what the shards are planned by)."""
    found = []
    for written in results:
        for name, path in sorted(written.paths.items()):
            with pa.memory_map(path) as source:
                found.append((name, pa.ipc.open_file(source).read_all(), dict(written.counts.get(name, {}))))
        found.append(("quarantined", written.quarantined, written.synthetic_answers))
        found.append(("sizes", written.nbytes, written.rows))
    return found


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x[0] == y[0] and (x[1].equals(y[1]) if isinstance(x[1], pa.Table) else x[1] == y[1])
                                    and x[2] == y[2] for x, y in zip(a, b))


def time_calls(work: Path, reps: int, old: str | None, profile: Path | None) -> None:
    calls = pickle.loads((work / "calls.pickle").read_bytes())
    records = sum(len(c[1]) for c in calls)
    variants = {"new": second_half.write_unit}
    if old:
        variants["old"] = importlib.import_module(f"{old}.pipeline.build.assemble").write_unit
    scratch = Path(tempfile.mkdtemp(prefix="bench_writers_"))
    try:
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            run_all(variants["new"], calls, scratch / "new")
            profiler.disable()
            profiler.dump_stats(profile)
            pstats.Stats(str(profile)).sort_stats("tottime").print_stats(40)
            return
        seen = {name: [] for name in variants}
        for rep in range(reps):
            for name in (variants if rep % 2 == 0 else reversed(variants)):
                cpu, results = run_all(variants[name], calls, scratch / name)
                seen[name].append(cpu)
                if rep == 0:
                    seen.setdefault(f"{name} outputs", outputs_of(results))
        if old:
            print("outputs", "the same" if same(seen["new outputs"], seen["old outputs"]) else "DIFFER")
        for name in variants:
            median = statistics.median(seen[name])
            print(f"{name}: median {median:.3f} s = {1000 * median / records:.4f} ms a kept record; "
                  f"runs {' '.join(f'{s:.3f}' for s in seen[name])}")
        if old:
            ratio = [n / o for n, o in zip(seen["new"], seen["old"])]
            print(f"new/old per repetition: {' '.join(f'{r:.3f}' for r in ratio)}; median {statistics.median(ratio):.3f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def count(work: Path, old: str | None, units: str | None, rows: int | None) -> None:
    calls = pickle.loads((work / "calls.pickle").read_bytes())
    if units:
        calls = [calls[int(u)] for u in units.split(",")]
    if rows:
        calls = [(path, kept[:rows], *args) for path, kept, *args in calls]
    write_unit = (importlib.import_module(f"{old}.pipeline.build.assemble").write_unit if old
                  else second_half.write_unit)
    scratch = Path(tempfile.mkdtemp(prefix="bench_writers_"))
    try:
        run_all(write_unit, calls, scratch / "warm")
        functools.reduce(lambda _, into: run_all(write_unit, calls, into), [scratch / "counted"], None)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{'old' if old else 'new'}: {sum(len(c[1]) for c in calls)} kept records")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=OLD_COPY)
    p.add_argument("what", choices=["prepare", "time", "count"])
    p.add_argument("n", nargs="?", default="20000")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--old", default=None, help="an importable package name of other code (see old_copy)")
    p.add_argument("--cprofile", type=Path, default=None)
    p.add_argument("--units", default=None, help="count: the calls to run, e.g. 0,3")
    p.add_argument("--rows", type=int, default=None, help="count: the first N kept records of each call")
    args = p.parse_args()
    if args.what == "prepare":
        prepare(args.n, args.work)
    elif args.what == "count":
        count(args.work, args.old, args.units, args.rows)
    else:
        time_calls(args.work, args.reps, args.old, args.cprofile)


if __name__ == "__main__":
    main()
