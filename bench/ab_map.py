"""CPU of the map stages on rows held in memory, for A/B runs of two checkouts on the same input.

Usage: python bench/ab_map.py CORPUS [--share N] [--reps R] [--rows FILE]

Reads up to `--share` rows of each unit of CORPUS (a generated corpus, bench/profile_build.py's
`corpus` folder; the units' rows taken in the order they are read), or the rows pickled in `--rows`
(written there the first time, so two checkouts time the very same rows), then, `--reps` times:
`read` (the reader over the same files again, as far as the rows taken), `normalize`
(`normalize_stage`), `validate` (`validate_stage` of what normalize kept) and `keys`
(`stage_keys` of the kept records in the build's batches, with their staged Arrow tables made
beforehand), each timed by `time.process_time`.
Prints the least and the median CPU of each stage over the repetitions, in ms a record. Run it
with each checkout's code importable in turn (its editable install, or PYTHONPATH), alternating.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import pickle
import statistics
import sys
import time
from pathlib import Path

import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trajforge.pipeline.build import BuildConfig  # noqa: E402
from trajforge.pipeline.build import units as unit_map  # noqa: E402
from trajforge.pipeline.build.assemble import stage_keys  # noqa: E402
from trajforge.pipeline.build.config import BATCH_ROWS  # noqa: E402
from trajforge.pipeline.stages import Dropped  # noqa: E402
from trajforge.schemas import arrow_schema  # noqa: E402
from trajforge.sources import get_source, iter_rows  # noqa: E402


def units_of(corpus: Path) -> list[tuple[str, object]]:
    return [(d.name, f) for d in sorted(corpus.iterdir()) for f in get_source(d.name).files(str(d))]


def load(corpus: Path, share: int) -> list[tuple[str, object, list]]:
    return [(name, f, list(itertools.islice(iter_rows(f.path, f.label), share))) for name, f in units_of(corpus)]


def one_rep(units, config: BuildConfig) -> dict[str, float]:
    schema = arrow_schema("trajectory")
    cpu = dict.fromkeys(("read", "normalize", "validate", "keys"), 0.0)
    for name, f, rows in units:
        source = get_source(name)
        t0 = time.process_time()
        for _ in zip(iter_rows(f.path, f.label), range(len(rows))):
            pass
        t1 = time.process_time()
        normalized = [unit_map.normalize_stage(raw, source, f, config.normalize) for raw in rows if not raw.error]
        t2 = time.process_time()
        envs: dict = {}
        validated = [unit_map.validate_stage(r, config.validate, envs) for r in normalized if not isinstance(r, Dropped)]
        t3 = time.process_time()
        kept = [r for r in validated if not isinstance(r, Dropped)]
        # Staged as the stage write stages them (not timed here).
        batches = [(kept[start:start + BATCH_ROWS], pa.Table.from_pylist(kept[start:start + BATCH_ROWS], schema=schema))
                   for start in range(0, len(kept), BATCH_ROWS)]
        t4 = time.process_time()
        for start, (records, staged) in zip(range(0, len(kept), BATCH_ROWS), batches):
            stage_keys(records, staged, start, config)
        t5 = time.process_time()
        for stage, spent in zip(cpu, (t1 - t0, t2 - t1, t3 - t2, t5 - t4)):
            cpu[stage] += spent
    return cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("corpus", type=Path)
    p.add_argument("--share", type=int, default=3000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rows", type=Path, default=None)
    args = p.parse_args()
    if args.rows and args.rows.exists():
        units = pickle.loads(args.rows.read_bytes())
    else:
        units = load(args.corpus, args.share)
        if args.rows:
            args.rows.write_bytes(pickle.dumps(units))
    n = sum(len(rows) for _, _, rows in units)
    config = BuildConfig()
    one_rep(units, config)  # warm: caches, numba
    gc.freeze()
    gc.disable()
    reps = [one_rep(units, config) for _ in range(args.reps)]
    line = []
    for stage in reps[0]:
        values = [1000 * r[stage] / n for r in reps]
        line.append(f"{stage} {min(values):.4f}/{statistics.median(values):.4f}")
    total = [1000 * sum(r.values()) / n for r in reps]
    print(f"{n} rows: " + "  ".join(line) + f"  total {min(total):.4f}/{statistics.median(total):.4f} ms (min/median)")


if __name__ == "__main__":
    main()
