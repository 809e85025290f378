"""Where the CPU of a build goes, per stage and per record, measured in one process.

Usage: python bench/profile_build.py N [--work DIR] [--fixtures DIR] [--cprofile FILE] [--top K]
       python bench/profile_build.py fixtures [--work DIR]

Builds N trajectories of bench/bench_build.py's generated corpus (made once under `--work`/corpus
and reused; `fixtures` builds the real fixture sources instead) with the build's plain functions in
this process (`process_unit` per unit, then `finalize`, as tests/conftest.py's fixtures build
does): the same outputs as `trajforge build`, without Prefect and its task runner. CPU time (user +
system of this process) is counted per stage, each stage's own time without the stages it calls:

- map, per unit: `read` (decoding the upstream rows), `normalize`, `validate` (JSON Schema, the
  dialects and the env grammars), `keys` (dedup tokens, shingles, MinHash, band keys, sketches,
  exact key: the key table), `stage write` (records to the unit's staged Arrow file);
- global: `key table` (concatenation, contamination, unique ids), `dedup` (exact group-by, band
  screens, Jaccard checks), `pools`, `unit writers` (sft, negatives, pairs, prompts), `shards`,
  `quarantine + report` (the rest of `finalize`: the quarantine merge, report, card, manifest).

CPU time rather than wall time: on a shared machine it moves far less with the load. The outputs
stay under `--work`/build; `python bench/build_digest.py` states them as sha256 digests to compare
two builds. `--cprofile FILE` also runs the build under cProfile (slower: the per-stage figures
then include its overhead) and prints the functions with the most time of their own.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.bench_build import DEFAULT_FIXTURES, generate  # noqa: E402
from trajforge.pipeline import atomic  # noqa: E402
from trajforge.pipeline.build import BuildConfig, assemble, global_stages, process_unit, second_half  # noqa: E402
from trajforge.pipeline.build import units as unit_map  # noqa: E402
from trajforge.sources import get_source  # noqa: E402

MAP = ["read", "normalize", "validate", "keys", "stage write"]
GLOBAL = ["key table", "decontaminate", "dedup", "pools", "unit writers", "shards", "quarantine + report"]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class StageClock:
    """Exclusive CPU time per named stage: time spent in a nested timed call goes to its stage."""

    def __init__(self):
        self.totals: Counter[str] = Counter()
        self.stack: list[list] = []

    def _enter(self, name: str) -> None:
        now = time.process_time()
        if self.stack:
            self.totals[self.stack[-1][0]] += now - self.stack[-1][1]
        self.stack.append([name, now])

    def _leave(self) -> None:
        now = time.process_time()
        name, started = self.stack.pop()
        self.totals[name] += now - started
        if self.stack:
            self.stack[-1][1] = now

    def wrap(self, name: str, function, outermost: bool = False):
        """`function` timed as `name`; with `outermost`, only where no other stage called it."""
        def timed(*args, **kwargs):
            if outermost and self.stack:
                return function(*args, **kwargs)
            self._enter(name)
            try:
                return function(*args, **kwargs)
            finally:
                self._leave()
        return timed

    def wrap_iterator(self, name: str, make):
        """`make(...)` returns an iterator; each step of it is timed as `name`."""
        def timed(*args, **kwargs):
            iterator = iter(make(*args, **kwargs))
            while True:
                self._enter(name)
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    self._leave()
                yield item
        return timed


def instrument(clock: StageClock) -> None:
    """Time the build's stages where `process_unit` and `finalize` call them."""
    patches = [
        (unit_map, "iter_rows", clock.wrap_iterator("read", unit_map.iter_rows)),
        (unit_map, "normalize_stage", clock.wrap("normalize", unit_map.normalize_stage)),
        (unit_map, "validate_stage", clock.wrap("validate", unit_map.validate_stage)),
        (assemble, "stage_keys", clock.wrap("keys", assemble.stage_keys)),
        (atomic.StreamingTable, "_flush", clock.wrap("stage write", atomic.StreamingTable._flush, outermost=True)),
        (second_half, "key_table", clock.wrap("key table", second_half.key_table)),
        (global_stages, "contamination", clock.wrap("decontaminate", global_stages.contamination)),
        (global_stages, "duplicates_table", clock.wrap("dedup", global_stages.duplicates_table)),
        (second_half, "unit_pools", clock.wrap("pools", second_half.unit_pools)),
        (second_half, "write_unit", clock.wrap("unit writers", second_half.write_unit)),
        (second_half, "write_shard_from_files", clock.wrap("shards", second_half.write_shard_from_files)),
        (second_half, "finalize", clock.wrap("quarantine + report", second_half.finalize)),
    ]
    for owner, name, timed in patches:
        setattr(owner, name, timed)


def sources_of(what: str, work: Path, fixtures: Path) -> dict[str, str]:
    if what == "fixtures":
        return {name: str(fixtures / name) for name in ("agentinstruct", "agenttraj_l", "openmanus_rl")}
    corpus = work / "corpus"
    if not corpus.exists():
        t0 = time.perf_counter()
        counts = generate(fixtures, int(what), corpus)
        print(f"corpus: {what} trajectories in {time.perf_counter() - t0:.0f} s, {counts}")
    return {d.name: str(d) for d in sorted(corpus.iterdir())}


def run(sources: dict[str, str], out: Path) -> tuple[int, dict, float, float]:
    """(rows read, report, CPU seconds of the map, of finalize)."""
    config = BuildConfig()
    shutil.rmtree(out, ignore_errors=True)
    cpu0 = cpu_seconds()
    units = [process_unit(name, f, out / ".staging", config)
             for name, location in sources.items() for f in get_source(name).files(location)]
    cpu1 = cpu_seconds()
    report = second_half.finalize(units, out, config)
    return sum(u.read for u in units), report, cpu1 - cpu0, cpu_seconds() - cpu1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("n", help="trajectories in the generated corpus, or `fixtures`")
    p.add_argument("--work", type=Path, default=None, help="corpus and build folder (default: a temp dir, removed)")
    p.add_argument("--fixtures", type=Path, default=DEFAULT_FIXTURES)
    p.add_argument("--cprofile", type=Path, default=None, help="also write cProfile stats here")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()

    work = args.work or Path(tempfile.mkdtemp(prefix="profile_build_"))
    try:
        sources = sources_of(args.n, work, args.fixtures)
        clock = StageClock()
        instrument(clock)
        profiler = cProfile.Profile() if args.cprofile else None
        cpu0, wall0 = cpu_seconds(), time.perf_counter()
        if profiler:
            profiler.enable()
        read, report, map_cpu, global_cpu = run(sources, work / "build")
        if profiler:
            profiler.disable()
        cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
        total = report["total"]
        print(f"build of {args.n}: read {read}, written {total['written']}, quarantined {total['quarantined']}, "
              f"duplicates {total.get('duplicates', 0)}; CPU {cpu:.1f} s = {1000 * cpu / read:.3f} ms a record "
              f"(wall {wall:.1f} s)")
        print(f"{'stage':<22}{'CPU s':>9}{'ms/record':>11}{'share':>8}")
        for part, names, part_cpu in (("map", MAP, map_cpu), ("global", GLOBAL, global_cpu)):
            rest = part_cpu - sum(clock.totals[n] for n in names)
            for name, s in [*((n, clock.totals[n]) for n in names), ("other", rest), (f"{part} total", part_cpu)]:
                indent = "" if name.endswith("total") else "  "
                print(f"{indent}{name:<{22 - len(indent)}}{s:>9.2f}{1000 * s / read:>11.3f}{s / cpu:>8.1%}")
        if profiler:
            profiler.dump_stats(args.cprofile)
            pstats.Stats(str(args.cprofile)).sort_stats("tottime").print_stats(args.top)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
