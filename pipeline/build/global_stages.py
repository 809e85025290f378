"""The global stages of a build: each sees every unit's records that the stages before it kept.

A global stage is an object with a `name`, an `outcome` (where the records it drops go: the
quarantine, or the duplicates map) and `run(keys, build) -> (tally, dropped)`: `keys` is the key
table (pipeline/build/assemble.py `key_table`) of the records still in, `build` what else it may
read (the units' staged files, the config, the task runner's `map_units`). It returns its
`StageTally` (records in, kept, dropped by reason) and its dropped rows, a frame with at least the
build `order` and the `reason` of each, and `detail` for a quarantine (the quarantine row's detail),
or the duplicates map's columns (schemas/duplicates.schema.json, plus `kept_order`).

`GLOBAL_STAGES` lists them in the order they run; `run_global_stages` runs them and splits each
stage's tally per unit, which is where the report's per-file and per-source counts come from
(pipeline/build/report.py). Adding a stage is a class here and its line in `GLOBAL_STAGES`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trajforge.pipeline.atomic import batch_sizes, read_batches
from trajforge.pipeline.build.assemble import StagedRecords
from trajforge.pipeline.build.config import BuildConfig
from trajforge.pipeline.evaluation.splits import HeldOut, declared_held_out
from trajforge.pipeline.quality.dedup import Contamination, read_eval_tasks
from trajforge.pipeline.quality.dedup_table import RANK_COLUMNS, duplicates_table
from trajforge.pipeline.stages import StageTally, in_order

if TYPE_CHECKING:
    from trajforge.pipeline.build.units import UnitResult

# Where a global stage's dropped records go.
QUARANTINE, DUPLICATES = "quarantine", "duplicates"
QUARANTINE_COLUMNS = {"order": pl.Int64, "reason": pl.String, "detail": pl.String}


@dataclass(frozen=True)
class StagedBuild:
    """What a global stage may read besides the key table."""
    units: list[UnitResult]
    config: BuildConfig
    map_units: Callable = in_order
    # Scratch space for a stage's arrays (near dedup's band tables), under the build's staging folder.
    workdir: Path | None = None


class GlobalStage(Protocol):
    name: str
    outcome: str  # QUARANTINE or DUPLICATES

    def run(self, keys: pl.DataFrame, build: StagedBuild) -> tuple[StageTally, pl.DataFrame]: ...

    def report(self, tally: StageTally, config: BuildConfig) -> dict:
        """The stage's own sections of report.json, if any."""
        ...


def tally_of(name: str, keys: pl.DataFrame, dropped: pl.DataFrame) -> StageTally:
    """A stage's tally: the records of `keys` in, the `dropped` ones out by reason, the rest kept."""
    return StageTally.of(name, keys.height, dict(dropped.group_by("reason").len().sort("reason").iter_rows()))


# -- decontamination ---------------------------------------------------------------------------

def _eval_tasks(config: BuildConfig) -> tuple[Contamination | None, HeldOut | None]:
    """The n-gram index of the evaluation task texts (the `--decontaminate` file and, unless
    switched off, the declared splits' texts less the spared ones), and the declared splits."""
    texts = read_eval_tasks(Path(config.decontaminate)) if config.decontaminate else []
    held = declared_held_out() if config.decontaminate_splits else None
    spared = set(config.decontaminate_except)
    texts += [t for t in held.texts if t not in spared] if held else []
    return (Contamination(texts, config.decontaminate_ngram) if texts else None), held


# Tasks checked at once, at least (a unit's last chunk takes the rows after it): enough text for
# the compiled loops (dedup.COMPILED_TOKENS_FROM), a few MB, not a unit's. Rows, or bytes of task text,
# whichever comes first: 8192 of AgentTraj-L's wordle tasks (~6.4 KB each) took ~640 MB of a worker's
# memory as tokens, which set the 1M build's peak.
CONTAMINATION_CHUNK = 8192
CONTAMINATION_CHUNK_BYTES = 4 << 20


def unit_contamination(records_path: str, index: Contamination | None, held: HeldOut | None) -> list[str | None]:
    """Per record of one unit's staged records, in order: why its task overlaps an evaluation task
    (the n-gram `index`, the `held` out items), or null. Reads the `task`, `env` and `source_id`
    columns only."""
    details: list[str | None] = []
    chunk: list[pa.RecordBatch] = []
    previous: list[pa.RecordBatch] = []  # a full chunk, checked once another is full or with the rest
    rows = nbytes = 0
    for batch in read_batches(records_path, ["task", "env", "source_id"]):
        chunk.append(batch)
        rows += batch.num_rows
        nbytes += batch.column("task").nbytes
        if rows >= CONTAMINATION_CHUNK or nbytes >= CONTAMINATION_CHUNK_BYTES:
            details += _contamination(previous, index, held)
            previous, chunk, rows, nbytes = chunk, [], 0, 0
    return details + _contamination(previous + chunk, index, held)


def _contamination(batches: list[pa.RecordBatch], index: Contamination | None, held: HeldOut | None) -> list[str | None]:
    """`unit_contamination` of these records: the tasks from their Arrow buffers (`Contamination.
    matches`), the items of the records whose env has held out items."""
    if not batches:
        return []
    column = {name: pa.concat_arrays([batch.column(name) for batch in batches]) for name in ("task", "env", "source_id")}
    details = index.details(column["task"]) if index else [None] * len(column["task"])
    if held and held.items:
        envs = pa.array(sorted({env for env, _ in held.items}), type=column["env"].type)
        candidates = pc.indices_nonzero(pc.is_in(column["env"], value_set=envs))
        for i, env, source_id in zip(candidates.to_pylist(), column["env"].take(candidates).to_pylist(),
                                     column["source_id"].take(candidates).to_pylist()):
            details[i] = held.item_match(env, source_id) or details[i]
    return details


def contamination(units: list[UnitResult], config: BuildConfig, map_units=in_order) -> pl.Series:
    """Per record in build order: why its task overlaps an evaluation task, or null. Decided here,
    not per unit in the map, because the evaluation tasks are a setting of this step: the
    `--decontaminate` file and, unless switched off, the declared eval splits
    (pipeline/evaluation/splits.py: task text n-grams, AgentGym items). The index is built once and
    each unit checked on `map_units` (the check is ~0.01 ms a record: on the task runner's workers
    rather than alone in the flow's process), dealt by the units' record counts so that a large
    unit does not end the step alone."""
    index, held = _eval_tasks(config)
    if index is None and held is None:
        return pl.Series("detail", [None] * sum(sum(batch_sizes(u.records_path)) for u in units), dtype=pl.String)
    per_unit = map_units(unit_contamination, [(unit.records_path, index, held) for unit in units],
                         [unit.written for unit in units])
    return pl.Series("detail", [detail for details in per_unit for detail in details], dtype=pl.String)


@dataclass(frozen=True)
class Decontaminate:
    """Records whose task is an evaluation task go to the quarantine as `contaminated`."""
    name: str = "decontaminate"
    outcome: str = QUARANTINE

    def run(self, keys: pl.DataFrame, build: StagedBuild) -> tuple[StageTally, pl.DataFrame]:
        details = contamination(build.units, build.config, build.map_units)
        dropped = (keys.select("order").with_columns(details.gather(keys["order"]), reason=pl.lit("contaminated"))
                   .filter(pl.col("detail").is_not_null()).select(*QUARANTINE_COLUMNS))
        return tally_of(self.name, keys, dropped), dropped

    def report(self, tally: StageTally, config: BuildConfig) -> dict:
        """Which eval splits (and which version of each) this build holds out: `trajforge eval` reads it."""
        return {"held_out": {"splits": declared_held_out().splits if config.decontaminate_splits else {},
                             "spared": len(config.decontaminate_except), "file": config.decontaminate,
                             "contaminated": tally.dropped["contaminated"]}}


# -- dedup -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dedup:
    """Records that repeat a better-ranked one go to the duplicates map (pipeline/quality/dedup_table.py):
    `near` False, the exact stage; True, the near stage (on what the exact stage kept, so no exact
    pair is left and only near ones are found)."""
    name: str
    near: bool
    outcome: str = DUPLICATES

    def run(self, keys: pl.DataFrame, build: StagedBuild) -> tuple[StageTally, pl.DataFrame]:
        config = replace(build.config.dedup, near=self.near and build.config.dedup.near)
        dropped = duplicates_table(keys.select(*RANK_COLUMNS, "source", "source_file"), StagedRecords.of(build.units, config),
                                   config, build.map_units, build.workdir).with_columns(reason=pl.col("match"))
        return tally_of(self.name, keys, dropped), dropped

    def report(self, tally: StageTally, config: BuildConfig) -> dict:
        return {}


GLOBAL_STAGES: list[GlobalStage] = [Decontaminate(), Dedup("dedup_exact", near=False), Dedup("dedup_near", near=True)]


# -- running them ------------------------------------------------------------------------------

@dataclass
class StageRun:
    """A global stage's result: its tally, its dropped rows (with their `unit` and `row`), and its
    tally split per unit (in unit order)."""
    stage: GlobalStage
    tally: StageTally
    dropped: pl.DataFrame
    unit_tallies: list[StageTally]


def _unit_tallies(name: str, keys: pl.DataFrame, dropped: pl.DataFrame, units: int) -> list[StageTally]:
    seen = dict(keys.group_by("unit").len().iter_rows())
    by_unit: list[dict[str, int]] = [{} for _ in range(units)]
    for u, reason, n in dropped.group_by("unit", "reason").len().sort("unit", "reason").iter_rows():
        by_unit[u][reason] = n
    return [StageTally.of(name, seen.get(u, 0), by_unit[u]) for u in range(units)]


def run_global_stages(keys: pl.DataFrame, build: StagedBuild,
                      stages: list[GlobalStage] = GLOBAL_STAGES) -> tuple[list[StageRun], pl.DataFrame]:
    """Each stage on the records the stages before it kept: (each stage's run, the key rows kept by all)."""
    runs = []
    for stage in stages:
        tally, dropped = stage.run(keys, build)
        dropped = dropped.join(keys.select("order", "unit", "row"), on="order", how="left", maintain_order="left")
        runs.append(StageRun(stage, tally, dropped, _unit_tallies(stage.name, keys, dropped, len(build.units))))
        keys = keys.filter(~pl.col("order").is_in(dropped["order"].implode()))
    return runs, keys
