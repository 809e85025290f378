"""The second half of a build: the staged units merged into the dataset, quarantine, report and card.

`finalize` is a short sequence: the key tables of the units (pipeline/build/assemble.py), the global
stages on them (pipeline/build/global_stages.py, each reporting its tally and dropped rows), unique
ids, the outputs (pipeline/build/outputs.py: each unit's kept records through the row makers, then
shards), the duplicates map and the quarantine, the report (pipeline/build/report.py), and last the
card and the manifest.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import StreamingTable, remove_stale_temp_files, write_json, write_table
from trajforge.pipeline.build.assemble import (
    StagedRecords,
    key_table,
    unique_ids,
    unit_pools,
    with_unique_ids,
    write_unit,
)
from trajforge.pipeline.build.config import BuildConfig
from trajforge.pipeline.build.global_stages import DUPLICATES, QUARANTINE, StagedBuild, StageRun, run_global_stages
from trajforge.pipeline.build.outputs import OUTPUTS, BuildOutputs, card_notes
from trajforge.pipeline.build.report import source_counts, stage_tallies
from trajforge.pipeline.build.units import UnitResult
from trajforge.pipeline.ingest.validate import merge_env_figures
from trajforge.pipeline.publish.card import load_card_classes, shard_stats, write_card
from trajforge.pipeline.publish.manifest import (
    GENERATOR,
    build_id,
    code_version,
    file_entry,
    remove_earlier_files,
    set_manifest_aside,
    write_manifest,
)
from trajforge.pipeline.publish.report import report_extras, value_counts, write_html
from trajforge.pipeline.publish.shards import SplitShards, link_readers, plan_split, write_shard_from_files
from trajforge.pipeline.quality.dedup_table import DUPLICATE_COLUMNS
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.pipeline.stages import cyclic_gc_paused, in_order, release_freed_memory
from trajforge.schemas import arrow_schema

log = logging.getLogger("trajforge.build")
DUPLICATES_FILE = "duplicates.parquet"
QUARANTINE_FILE = "quarantine/quarantine.parquet"


def finalize(units: list[UnitResult], out: Path, config: BuildConfig = BuildConfig(), map_units=in_order) -> dict:
    """Merge staged units (in the given order) into the dataset, quarantine and report.

    Global stages run on the units' key tables; the outputs are written by streaming each unit's
    staged records: memory stays one batch of records plus the key tables. The per-unit steps
    (pools, outputs) and then every shard of every output with the quarantine, in one step, go
    through `map_units(function, calls, sizes, meanwhile)`, which returns the results in the calls'
    order: `in_order` here, or a flow's task runner (processes, a Dask or Ray cluster), which runs
    `meanwhile` (the duplicates map, the report and its plots, the card's classes) here while its
    workers write the shards. The output bytes do not depend on it.

    The manifest of an earlier build in `out` is set aside first and the new one written last, so
    a folder with a manifest always holds the files of the build it names. Files of the earlier
    build that this one does not write are removed; nothing else in `out` is touched.
    """
    remove_stale_temp_files(out)
    earlier = set_manifest_aside(out)
    # The whole key table goes with the first stage that drops records: held here, it would double the flow's memory.
    runs, kept_keys = run_global_stages(key_table(units, config), StagedBuild(units, config, map_units, out / ".staging"))
    release_freed_memory()
    mix, outputs_plan = KeptMix.of(kept_keys), plan_outputs(units, kept_keys, runs, config, map_units)
    # Only `mix` of the key table is needed from here: held through the unit writers and the shards
    # (about half the build), the table was ~45 MiB of the flow's memory at 1M.
    del kept_keys
    release_freed_memory()
    outputs, shards = write_outputs(out, units, outputs_plan, config, map_units)
    release_freed_memory()
    quarantine = (file_entry, [], write_quarantine, out, [unit.quarantine_path for unit in units],
                  [written.quarantined for written in outputs.build.written])
    calls, releases = link_readers([call for plan in shards for call in plan.calls], outputs.build.staged)
    # The report needs no shard: it is written here while the task runner writes them; then the
    # card's classes are loaded, which the card, written after the shards, would otherwise wait on.
    reported: list[tuple[dict, list[str]]] = []

    def meanwhile() -> None:
        reported.append(write_report_files(out, units, runs, outputs_plan.repeats, mix, outputs, config))
        load_card_classes()

    with cyclic_gc_paused():
        written = map_units(write_file, [*((shard_facts, release, write_shard_from_files, *call)
                                           for call, release in zip(calls, releases)), quarantine],
                            [*(size for plan in shards for size in plan.sizes), _quarantine_bytes(units)],
                            meanwhile=meanwhile)
        report, owned = reported[0]
        for plan in shards:
            plan.remove_stale()
        # What is left of the staged outputs (the shards' calls freed their files) is removed while the
        # card and the manifest are written.
        with ThreadPoolExecutor(1, thread_name_prefix="remove-staged-outputs") as pool:
            removed = pool.submit(shutil.rmtree, outputs.build.staged)
            write_release_files(out, report, units, config, owned,
                                {Path(path).relative_to(out).as_posix(): facts for path, facts in written})
            remove_earlier_files(out, earlier - set(owned) - {"README.md"})
            removed.result()
    return report


def write_file(facts, release: list[str], writer, *args) -> tuple[str, dict]:
    """One file of the build by `writer` (which returns its path): the step of `map_units` that
    writes the shards of every output and the quarantine, which are independent of one another.
    Then the files it read that no other call reads (`release`: its links to them) are removed.
    Returns the path and `facts(path)`, what the manifest (and the card) say of the file, taken
    here, on every worker, while the file is in the page cache."""
    path = Path(writer(*args))
    for link in release:
        os.unlink(link)
    return str(path), facts(path)


def shard_facts(path: Path) -> dict:
    """A shard's manifest entry and the card's figures of it."""
    return {**file_entry(path), **shard_stats(path)}


def write_report_files(out: Path, units: list[UnitResult], runs: list[StageRun], repeats: pl.DataFrame,
                       mix: KeptMix, outputs: WrittenOutputs, config: BuildConfig) -> tuple[dict, list[str]]:
    """duplicates.parquet, report.json, report.html and its plots. Returns the report and the files
    the build owns so far (the outputs' shards included), relative to `out`."""
    duplicates = write_duplicates(out, runs, repeats)
    report = build_report(units, runs, mix, outputs, duplicates, config)
    html_files = write_html(out, report, duplicates, mix.turns, mix.chars)
    write_json(out / "report.json", report)
    owned = [path for paths in report["outputs"].values() for path in paths]
    return report, owned + [p.relative_to(out).as_posix() for p in html_files] + ["report.json"]


# The columns of the key table whose value counts the report gives, and its section of each.
MIX_COLUMNS = {"rendering": "renderings", "domain": "domains", "env": "envs", "kind": "kinds"}


@dataclass
class KeptMix:
    """What the report says of the kept records, taken from the key table after the global stages:
    the value counts of `MIX_COLUMNS` (report section -> counts) and, per kept record, its turns and
    characters."""
    counts: dict[str, dict]
    turns: np.ndarray
    chars: np.ndarray

    @classmethod
    def of(cls, kept_keys: pl.DataFrame) -> KeptMix:
        return cls({name: value_counts(kept_keys[column]) for column, name in MIX_COLUMNS.items()},
                   kept_keys["turns"].to_numpy(), kept_keys["chars"].to_numpy())


@dataclass
class OutputsPlan:
    """What the unit writers are given, found from the key table: each unit's kept rows (sorted), the records
    whose id repeats (`unique_ids`) and per unit their repeat number, per unit the records a global
    stage quarantined, and the negatives' pools."""
    kept_rows: list[np.ndarray]
    repeats: pl.DataFrame
    unit_repeats: list[dict[int, int]]
    quarantined: list[dict[int, tuple[str, str]]]
    pools: EnvPools


@dataclass
class WrittenOutputs:
    """What the outputs wrote: each written output's shard paths, and the outputs' view of the build."""
    files: dict[str, list[str]]
    build: BuildOutputs


def _by_unit(frame: pl.DataFrame, units: int, value) -> list[dict[int, object]]:
    """{row: value} per unit of the `unit`, `row` rows of `frame`; `value` an expression of its columns."""
    found: list[dict[int, object]] = [{} for _ in range(units)]
    for u, row, v in frame.select("unit", "row", value).iter_rows():
        found[u][row] = v
    return found


def _quarantined(runs: list[StageRun], units: int) -> list[dict[int, tuple[str, str]]]:
    """Per unit, {row: (reason, detail)} of the records a quarantining global stage dropped."""
    dropped = [run.dropped.select("unit", "row", "reason", "detail") for run in runs if run.stage.outcome == QUARANTINE]
    frame = pl.concat(dropped) if dropped else pl.DataFrame(schema={"unit": pl.Int32, "row": pl.Int64,
                                                                   "reason": pl.String, "detail": pl.String})
    found = _by_unit(frame, units, pl.concat_list("reason", "detail"))
    return [{row: tuple(pair) for row, pair in unit.items()} for unit in found]


def _quarantine_bytes(units: list[UnitResult]) -> int:
    """The Arrow bytes of the units' quarantine rows (what `write_quarantine` copies)."""
    metas = [pq.read_metadata(unit.quarantine_path) for unit in units]
    return sum(meta.row_group(g).total_byte_size for meta in metas for g in range(meta.num_row_groups))


def plan_outputs(units: list[UnitResult], kept_keys: pl.DataFrame, runs: list[StageRun], config: BuildConfig,
                 map_units) -> OutputsPlan:
    """Each unit's kept rows, and the pools of the negatives (per unit on `map_units`); the records
    whose id repeats (`unique_ids`) are found while the workers fill the pools (neither needs the other)."""
    kept_rows = [np.sort(kept_keys.filter(pl.col("unit") == u)["row"].to_numpy()) for u in range(len(units))]
    found: list[tuple] = []

    def ids() -> None:
        repeats = unique_ids(kept_keys, pl.concat([run.dropped.select("order", "unit", "row") for run in runs]),
                             StagedRecords.of(units, config.dedup))
        found.append((repeats, _by_unit(repeats, len(units), "repeat"), _quarantined(runs, len(units))))

    pools = EnvPools()
    for unit_pool in map_units(unit_pools, [(unit.records_path, rows) for unit, rows in zip(units, kept_rows)],
                               _unit_sizes(kept_rows), meanwhile=ids):
        pools.merge(unit_pool)
    return OutputsPlan(kept_rows, *found[0], pools)


def _unit_sizes(kept_rows: list[np.ndarray]) -> list[int]:
    """A unit step's work goes with its kept records (at 20k: 0.26-0.62 ms a record, 0.03-0.20 s a MB)."""
    return [len(rows) for rows in kept_rows]


def write_outputs(out: Path, units: list[UnitResult], plan: OutputsPlan, config: BuildConfig,
                  map_units) -> tuple[WrittenOutputs, list[SplitShards]]:
    """Every output of the registry: the kept records of each unit through the row makers
    (`write_unit`, per unit on `map_units`), then each output's staged parts planned as shards
    (written by `finalize`, all outputs in one step)."""
    staged = out / ".staging" / "outputs"
    written = map_units(write_unit, [(unit.records_path, str(staged / f"{u:05d}"), plan.kept_rows[u],
                                      plan.unit_repeats[u], plan.quarantined[u], plan.pools, config.negatives)
                                     for u, unit in enumerate(units)], _unit_sizes(plan.kept_rows))
    build = BuildOutputs(units, written, plan.kept_rows, plan.quarantined, config, staged, plan.unit_repeats)
    files, shards = {}, []
    for output in OUTPUTS.values():
        parts = output.staged_parts(build)
        if parts is None:
            continue
        build.rows[output.name] = sum(rows for _, _, rows in parts)
        build.counts[output.name] = sum((Counter(w.counts.get(output.name, {})) for w in written), Counter())
        shards.append(plan_split(out, output.name, "train", [part for part, _, _ in parts],
                                 arrow_schema(output.schema), build.rows[output.name],
                                 sum(nbytes for _, nbytes, _ in parts), config.shards, [rows for _, _, rows in parts]))
        files[output.name] = shards[-1].paths(out)["train"]
    return WrittenOutputs(files, build), shards


def write_duplicates(out: Path, runs: list[StageRun], repeats: pl.DataFrame) -> pl.DataFrame:
    """duplicates.parquet: the rows every dedup stage dropped, in build order, with their unique ids
    (`repeats`: `unique_ids`). Returns them (with the build `order` of the dropped and the kept
    record) for the report. Held as a frame: as dicts, the map of a 1M build (~110k rows) took
    ~200 MB of the flow's memory while its workers wrote the shards."""
    frames = [run.dropped.drop("reason", "unit", "row") for run in runs if run.stage.outcome == DUPLICATES]
    duplicates = with_unique_ids(pl.concat(frames).sort("order") if frames else pl.DataFrame(schema=DUPLICATE_COLUMNS),
                                 repeats)
    schema = arrow_schema("duplicates")
    write_table(duplicates.select(schema.names).to_arrow().cast(schema).combine_chunks(), out / DUPLICATES_FILE)
    return duplicates


def write_quarantine(out: Path, unit_quarantine: list[str], global_quarantine: list[list[dict]]) -> Path:
    """The units' quarantine rows (their files, in unit order, a batch at a time, never through
    Python), then those of the global stages. Returns the file's path."""
    schema = arrow_schema("quarantine")
    with StreamingTable(out / QUARANTINE_FILE, schema) as quarantine:
        for path in unit_quarantine:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=quarantine.batch_rows):
                quarantine.append_table(pa.Table.from_batches([batch]).cast(schema))
        for entries in global_quarantine:
            quarantine.append_table(pa.Table.from_pylist(entries, schema=schema))
    return out / QUARANTINE_FILE


def build_report(units: list[UnitResult], runs: list[StageRun], mix: KeptMix, outputs: WrittenOutputs,
                 duplicates: pl.DataFrame, config: BuildConfig) -> dict:
    """report.json: the counts from the stages' tallies, the stages' and the outputs' own sections,
    the mix of what was kept."""
    report = {**source_counts(units, runs), "generator": GENERATOR, "config": asdict(config),
              "outputs": {**outputs.files, "quarantine": [QUARANTINE_FILE], "duplicates": [DUPLICATES_FILE]}}
    report.update(mix.counts)
    report["validation_by_env"] = merge_env_figures([u.envs for u in units])
    for run in runs:
        report.update(run.stage.report(run.tally, config))
    report["stages"] = [t.as_dict() for t in stage_tallies(units, runs)]
    report_extras(report, duplicates, mix.turns, mix.chars)
    for name in outputs.files:
        if OUTPUTS[name].report is not None:
            report.update(OUTPUTS[name].report(outputs.build))
    if not len(mix.turns):
        report["warnings"] = ["no record made it into data/sft: every input record was quarantined or a duplicate"]
    for warning in report.get("warnings", []):
        log.warning(warning)
    return report


def write_release_files(out: Path, report: dict, units: list[UnitResult], config: BuildConfig,
                        files: list[str], known: dict[str, dict] | None = None) -> str:
    """Dataset card and manifest, last: they describe the files written before them (`files`,
    relative to `out`; the card is added). `known`: relative path -> what the writers took of a
    file once it was in place (`shard_facts`, `file_entry`), not read again. Returns the build id."""
    code = code_version()
    build = build_id([(u.source, u.source_file, u.input_sha256) for u in units],
                     {**asdict(config), "held_out": report["held_out"]["splits"]}, code)
    provenance = [{"source": u.source, "source_file": u.source_file, "sha256": u.input_sha256,
                   "revision": u.revision, "looks_like": u.looks_like} for u in units]
    write_card(out, report, provenance, build, code, card_notes(), known)
    write_manifest(out, build, [*files, "README.md"], known)
    return build

