"""The flow's own CPU in the global stages of a build (between the map and the unit writers), in one process.

Usage: python bench/bench_global.py prepare N --work DIR [--jobs 2]   (the map of a build, its units kept)
       python bench/bench_global.py time --work DIR [--reps R] [--cprofile FILE]

`prepare` stages the units of N trajectories of bench/bench_build.py's generated corpus (DIR/corpus,
made or reused; `--jobs` processes) under DIR/build/.staging and pickles them (DIR/units.pickle).
`time` runs what `finalize` runs before its unit writers (the key table, the global stages, unique
ids, the pools), with the runner's steps (`map_units`) in this process but timed apart, and prints
per part the flow's CPU (time.process_time, the steps' own excluded) and the steps' CPU, per repetition.
The results of each repetition are compared with the first (the dropped rows of each stage, the kept
rows, the unique ids, the pools); `--save FILE` keeps the first's and `--against FILE` compares with
another run's (another tree's code: run with PYTHONPATH pointing there).
"""
from __future__ import annotations

import argparse
import cProfile
import pickle
import sys
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_build import DEFAULT_FIXTURES  # noqa: E402
from bench.profile_build import sources_of  # noqa: E402
from trajforge.pipeline.build import BuildConfig, process_unit, second_half  # noqa: E402
from trajforge.pipeline.build import global_stages as gs  # noqa: E402
from trajforge.pipeline.quality import dedup_table  # noqa: E402
from trajforge.sources import get_source  # noqa: E402


def prepare(n: str, work: Path, jobs: int) -> None:
    sources = sources_of(n, work, DEFAULT_FIXTURES)
    config, staging = BuildConfig(), work / "build" / ".staging"
    files = [(name, f) for name, location in sources.items() for f in get_source(name).files(location)]
    with ProcessPoolExecutor(jobs) as pool:
        units = list(pool.map(process_unit, [n for n, _ in files], [f for _, f in files],
                              [staging] * len(files), [config] * len(files)))
    (work / "units.pickle").write_bytes(pickle.dumps(units))
    print(f"{len(units)} units, {sum(u.written for u in units)} staged records")


class Clock:
    """Flow CPU per part; the steps of `map_units` timed apart (their CPU is a worker's)."""

    def __init__(self):
        self.flow, self.steps, self.part, self.step_cpu = defaultdict(float), defaultdict(float), [], 0.0

    def map_units(self, function, calls, sizes=None, meanwhile=None):
        t0 = time.process_time()
        results = [function(*args) for args in calls]
        spent = time.process_time() - t0
        self.steps[function.__name__] += spent
        self.step_cpu += spent
        if meanwhile is not None:
            meanwhile()
        return results

    def wrap(self, name, function):
        def timed(*args, **kwargs):
            t0, s0 = time.process_time(), self.step_cpu
            try:
                return function(*args, **kwargs)
            finally:
                self.flow[name] += time.process_time() - t0 - (self.step_cpu - s0)
        return timed


def run_once(units, config, work: Path, clock: Clock):
    out = work / "build"
    key_table = clock.wrap("key table", second_half.key_table)
    keys = key_table(units, config)
    runs, kept = clock.wrap("global stages (all)", gs.run_global_stages)(
        keys, gs.StagedBuild(units, config, clock.map_units, out / ".staging"))
    repeats = clock.wrap("unique ids", second_half.unique_ids)(
        kept, pl.concat([run.dropped.select("order", "unit", "row") for run in runs]),
        second_half.StagedRecords.of(units, config.dedup))
    kept_rows = [kept.filter(pl.col("unit") == u)["row"].to_numpy() for u in range(len(units))]
    t0 = time.process_time()
    pools = clock.map_units(second_half.unit_pools, [(u.records_path, r) for u, r in zip(units, kept_rows)])
    merged = second_half.EnvPools()
    t0 = time.process_time()
    for p in pools:
        merged.merge(p)
    clock.flow["pools merge"] += time.process_time() - t0
    clock.wrap("by unit", lambda: (second_half._by_unit(repeats, len(units), "repeat"),
                                   second_half._quarantined(runs, len(units))))()
    return [run.dropped.sort("order") for run in runs], kept.select("order"), repeats.sort("order"), merged



def time_runs(work: Path, reps: int, profile: Path | None, save: Path | None, against: Path | None) -> None:
    units = pickle.loads((work / "units.pickle").read_bytes())
    config = BuildConfig()
    for module, name in [(dedup_table, "exact_duplicates"), (dedup_table, "_ranked"), (dedup_table, "write_near_table"),
                         (dedup_table, "resolve"), (dedup_table, "screened_pairs")]:
        setattr(module, name, CLOCK.wrap(name, getattr(module, name)))
    gs.contamination = CLOCK.wrap("contamination", gs.contamination)
    gs.duplicates_table = CLOCK.wrap("duplicates_table", gs.duplicates_table)
    first = None
    for rep in range(reps):
        CLOCK.flow.clear(), CLOCK.steps.clear()
        profiler = cProfile.Profile() if profile and rep == reps - 1 else None
        if profiler:
            profiler.enable()
        w0 = time.perf_counter()
        result = run_once(units, config, work, CLOCK)
        wall = time.perf_counter() - w0
        if profiler:
            profiler.disable()
            profiler.dump_stats(profile)
        same = "" if first is None else ("same" if all(a.equals(b) for a, b in zip(result[0] + [result[1], result[2]], first[0] + [first[1], first[2]])) and result[3] == first[3] else "DIFFERENT")
        first = first or result
        if save is not None and rep == 0:
            save.write_bytes(pickle.dumps(result))
        if against is not None and rep == 0:
            other = pickle.loads(against.read_bytes())
            equal = all(a.equals(b) for a, b in zip(result[0] + [result[1], result[2]], other[0] + [other[1], other[2]]))
            print(f"against {against}: {'same' if equal and result[3] == other[3] else 'DIFFERENT'}")
        print(f"rep {rep}: wall {wall:.2f} s {same}")
        for name, s in sorted(CLOCK.flow.items(), key=lambda x: -x[1]):
            print(f"  flow  {name:<22}{s:8.3f}")
        for name, s in CLOCK.steps.items():
            print(f"  step  {name:<22}{s:8.3f}")


CLOCK = Clock()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["prepare", "time"])
    p.add_argument("n", nargs="?")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cprofile", type=Path, default=None)
    p.add_argument("--save", type=Path, default=None, help="the first repetition's results, pickled, here")
    p.add_argument("--against", type=Path, default=None, help="compare the first repetition's results with these")
    args = p.parse_args()
    if args.what == "prepare":
        prepare(args.n, args.work, args.jobs)
    else:
        time_runs(args.work, args.reps, args.cprofile, args.save, args.against)


if __name__ == "__main__":
    main()
