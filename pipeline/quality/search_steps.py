"""The step-level data of tree searches, carried into a build as the configs `step_pairs` and `step_values`.

A synthesis output folder given as the `synthetic` source holds, beside data/synthetic/<env>.parquet
(the best trajectory per task), search/step_pairs/<env>.parquet and search/step_values/<env>.parquet
(pipeline/synth/search.py). A step row belongs to its task's tree, and the tree to the task's
trajectory: the row is written when that trajectory is in `sft`, and otherwise dropped and counted
(report.json `search_steps`, the card) under the reason the trajectory is not there:

    contaminated          the trajectory was quarantined as contaminated (its task is an eval task)
    duplicate             the trajectory was dropped as a duplicate of a kept one
    <quarantine reason>   the trajectory was quarantined (its reason code: invalid_action, ...)
    no_trajectory         the search found no success for the task, so nothing of it was validated
    invalid               the row breaks its schema

So decontamination and dedup reach the step data through its trajectory, and a build never holds
step data of a task that it does not hold a trajectory of.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import StreamingTable, read_batches
from trajforge.schemas import arrow_schema, first_error
from trajforge.sources.synthetic import Synthetic, search_file

STEP_CONFIGS = ("step_pairs", "step_values")
BATCH_ROWS = 1024


def trajectory_fates(unit, kept_rows: np.ndarray, contaminated: dict[int, str]) -> dict[str, str | None]:
    """Task id -> None when a trajectory of the task from `unit` is in `sft`, else the reason none is."""
    fates: dict[str, str | None] = {}
    kept = set(kept_rows.tolist())
    staged = (meta for batch in read_batches(unit.records_path, ["meta"]) for meta in batch.column("meta").to_pylist())
    for row, meta in enumerate(staged):
        task = json.loads(meta).get("task_id")
        fate = None if row in kept else "contaminated" if row in contaminated else "duplicate"
        if fates.get(task, "") is not None:  # one kept trajectory of the task is enough
            fates[task] = fate
    # The input's records that never reached staging were quarantined by the map stages; an entry
    # names a record by its id (normalize) or its source_id (validate).
    quarantine = pq.read_table(unit.quarantine_path, columns=["source_id", "reason"]).to_pylist()
    reasons = {q["source_id"]: q["reason"] for q in quarantine if q["source_id"]}
    names = pq.read_schema(unit.input_path).names
    if {"id", "source_id", "meta"} <= set(names):
        for record in pq.read_table(unit.input_path, columns=["id", "source_id", "meta"]).to_pylist():
            task = json.loads(record["meta"] or "{}").get("task_id")
            fates.setdefault(task, reasons.get(record["source_id"]) or reasons.get(record["id"]) or "quarantined")
    return fates


def _search_units(units) -> list[tuple[int, object, dict[str, Path]]]:
    """(index, unit, config -> its search file) of each synthetic unit with search outputs."""
    found = [(u, unit, {name: search_file(Path(unit.input_path), name) for name in STEP_CONFIGS})
             for u, unit in enumerate(units) if unit.source == Synthetic.name and unit.input_path]
    return [(u, unit, {name: path for name, path in files.items() if path is not None})
            for u, unit, files in found if any(files.values())]


def _stage_file(name: str, path: Path, fates: dict[str, str | None], writer: StreamingTable, counts: dict) -> None:
    """The rows of one search file of config `name`: those of a kept trajectory to `writer`, counted."""
    for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
        for row in batch.to_pylist():
            counts["read"] += 1
            reason = "invalid" if first_error(name, row) else fates.get(row["task_id"], "no_trajectory")
            if reason is None:
                writer.append(row)
                counts["written"] += 1
            else:
                counts["dropped"][reason] += 1


def stage_step_rows(units, kept_rows: list[np.ndarray], contaminated: list[dict[int, str]],
                    staged: Path) -> tuple[dict[str, list[tuple[str, int, int]]], dict]:
    """The step rows of every synthetic unit with search outputs whose trajectory the build kept,
    staged under `staged` per config as (path, Arrow bytes, rows), and per config the rows read,
    written and dropped by reason. Nothing (two empty mappings) when no unit has search outputs."""
    found = _search_units(units)
    if not found:
        return {}, {}
    counts = {name: {"read": 0, "written": 0, "dropped": Counter()} for name in STEP_CONFIGS}
    writers = {name: StreamingTable(staged / f"{name}.arrow", arrow_schema(name), durable=False) for name in STEP_CONFIGS}
    for u, unit, files in found:
        fates = trajectory_fates(unit, kept_rows[u], contaminated[u])
        for name, path in files.items():
            _stage_file(name, path, fates, writers[name], counts[name])
    parts = {}
    for name, writer in writers.items():
        writer.close()
        parts[name] = [(str(writer.path), writer.nbytes, writer.count)]
    return parts, {name: {**c, "dropped": dict(sorted(c["dropped"].items()))} for name, c in counts.items()}
