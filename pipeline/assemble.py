"""The second half of a build, in bounded memory: global stages over key tables, per-unit writers.

Each unit stages, next to its records, a key table (`KeysWriter`, built where the records are read):
per record the dedup keys (dedup_table.record_keys), and the fields the report counts.
`build.finalize` then

1. concatenates the key tables in build order, without the near-dedup columns (`key_table`), and
   adds the contamination verdict (the `task` column only);
2. runs the global stages on that table: exact dedup (a group-by), near dedup (band screens and
   Jaccard checks as steps, `StagedRecords` reading what the table leaves out; dedup_table), then
   makes ids unique, the published records first (`unique_ids`, a window over `id`);
3. fills the bounded per-env pools of the negative makers, one pool per unit of its kept positives
   (`unit_pools`, merged in unit order; pools.py);
4. streams each unit's staged records once more (`write_unit`), skipping the dropped ones: each
   kept record goes to the unit's `sft` file, its negatives, their preference pairs (the parent is
   the record at hand), its GRPO prompt, its grpo_env row and the step labels of it and of its
   negatives to theirs. Shards are cut from those files in unit order (shards.write_config_from_file);
   the report, the card and the manifest come from the key table and the counts already in memory.

Steps 2-4 are per band, per chunk or per unit: `finalize` hands them to its `map_units`, so a
flow runs them on its task runner (other cores, or a cluster's workers). Peak memory of the
driver is the narrow key table (~300 bytes a record) and the duplicates map; of a worker, one
batch of records or one band's pairs. The outputs are those of the in-memory build: same
records, same order, same duplicates map, negatives, pairs and prompts.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import StreamingParquet, atomic_path
from trajforge.pipeline.evaluation.splits import declared_held_out
from trajforge.pipeline.quality.dedup import Contamination, DedupConfig, read_eval_tasks
from trajforge.pipeline.quality.dedup_table import (
    RANK_COLUMNS,
    band_columns,
    duplicates_table,
    near_matrices,
    record_keys,
    shingle_set_hashes,
)
from trajforge.pipeline.quality.derived import (
    grpo_env_row,
    grpo_prompt,
    negative_step_labels,
    preference_pair,
    record_task,
    step_labels_of,
)
from trajforge.pipeline.quality.negatives import NegativesConfig, negatives_of
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.pipeline.quarantine import quarantine_entry, shown
from trajforge.pipeline.stages import in_order
from trajforge.schemas import arrow_schema

BATCH_ROWS = 1024


def _contamination_detail(task: str, index: Contamination) -> str | None:
    hit = index.match(task)
    if hit is None:
        return None
    return f"task shares {len(hit[1].split())} words with evaluation task #{hit[0]}: {hit[1]!r}"[:500]


def contamination(units, config) -> pl.Series:
    """Per record in build order: why its task overlaps an evaluation task, or null. Reads the
    `task`, `env` and `source_id` columns only; done here, not per unit, because the evaluation
    tasks are a setting of this step: the `--decontaminate` file and, unless switched off, the
    declared eval splits (pipeline/evaluation/splits.py: task text n-grams, AgentGym items)."""
    details: list[str | None] = []
    texts = read_eval_tasks(Path(config.decontaminate)) if config.decontaminate else []
    held = declared_held_out() if config.decontaminate_splits else None
    spared = set(config.decontaminate_except)
    texts += [t for t in held.texts if t not in spared] if held else []
    index = Contamination(texts, config.decontaminate_ngram) if texts else None
    for unit in units:
        if index is None and held is None:
            details.extend([None] * pq.ParquetFile(unit.records_path).metadata.num_rows)
            continue
        for batch in pq.ParquetFile(unit.records_path).iter_batches(batch_size=BATCH_ROWS,
                                                                    columns=["task", "env", "source_id"]):
            for task, env, source_id in zip(*(batch.column(c).to_pylist() for c in ("task", "env", "source_id"))):
                details.append((held and held.item_match(env, source_id))
                               or (index and _contamination_detail(task, index)) or None)
    return pl.Series("contaminated", details, dtype=pl.String)


def stage_keys(records: list[dict], start: int, config) -> pl.DataFrame:
    """The key table rows of a batch of one unit's records (`start`: the batch's row in the unit)."""
    keys = record_keys(records, start, config.dedup)
    return keys.with_columns(
        pl.Series("kind", [r["kind"] for r in records], dtype=pl.String),
        pl.Series("rendering", [r["rendering"] for r in records], dtype=pl.String),
        pl.Series("domain", [r["domain"] for r in records], dtype=pl.String),
        pl.Series("env", [r["env"] for r in records], dtype=pl.String),
        pl.Series("turns", [len(r["conversations"]) for r in records], dtype=pl.Int32),
        pl.Series("chars", [sum(len(t["content"]) for t in r["conversations"]) for r in records], dtype=pl.Int64),
    )


class KeysWriter:
    """Stages a unit's key table as its records are written, one batch (one row group) at a time:
    memory stays one batch of keys, whatever the unit's size."""

    def __init__(self, path: Path, config, batch_rows: int = BATCH_ROWS):
        self.path, self.config, self.batch_rows = path, config, batch_rows
        self.pending: list[dict] = []
        self.count = 0
        self._file = atomic_path(path)
        self._writer = pq.ParquetWriter(self._file.__enter__(), stage_keys([], 0, config).to_arrow().schema,
                                        compression="zstd")

    def extend(self, records: list[dict]) -> None:
        """Records as their unit writes them (StreamingParquet's `on_written`): the key table
        stays row for row in step with the staged records."""
        self.pending.extend(records)
        if len(self.pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self._writer.write_table(stage_keys(self.pending, self.count, self.config).to_arrow())
            self.count += len(self.pending)
            self.pending = []

    def close(self) -> None:
        self._flush()
        self._writer.close()
        self._file.__exit__(None, None, None)


def key_table(units, config) -> pl.DataFrame:
    """Every unit's key table in build order, without the near-dedup columns (`near_rows` loads
    those for the records that need them), with the global `order`, the `unit` and its `row`, and
    the contamination verdict. Ids are as read; `unique_ids` makes them unique after dedup."""
    near = set(band_columns(config.dedup)) | {"sketch"}
    frames, offset = [], 0
    for u, unit in enumerate(units):
        columns = [c for c in pq.read_schema(unit.keys_path).names if c not in near]
        frame = pl.read_parquet(unit.keys_path, columns=columns)
        frames.append(frame.with_columns(pl.col("order").alias("row"), (pl.col("order") + offset).alias("order"),
                                         pl.lit(u, dtype=pl.Int32).alias("unit")))
        offset += frame.height
    return pl.concat(frames).with_columns(contamination(units, config))


def unique_ids(keys: pl.DataFrame, published: pl.Series) -> pl.DataFrame:
    """`keys` with every repeated id given a stable `~n` suffix (`repeat` n = 2, 3, ...; never
    overwritten), counted after the global stages: first over the `published` records (kept by
    dedup and decontamination) in build order, then over the others. A published id so carries
    `~n` only when n - 1 published records before it have the same upstream id, never because a
    dropped copy was counted, and a dropped copy's id in the duplicates map is never a published one."""
    repeat = pl.col("id").cum_count().over("id", order_by=[~published, "order"])
    return keys.with_columns(repeat.cast(pl.Int32).alias("repeat")).with_columns(
        pl.when(pl.col("repeat") > 1).then(pl.col("id") + "~" + pl.col("repeat").cast(pl.String))
        .otherwise(pl.col("id")).alias("id"))


def with_unique_ids(duplicates: list[dict], keys: pl.DataFrame) -> list[dict]:
    """The duplicates map with the ids `unique_ids` gave the dropped and the kept records (by the
    build `order` of each)."""
    involved = {o for d in duplicates for o in (d["order"], d["kept_order"])}
    ids = dict(keys.filter(pl.col("order").is_in(list(involved))).select("order", "id").iter_rows())
    return [{**d, "id": ids[d["order"]], "kept_id": ids[d["kept_order"]]} for d in duplicates]


def read_rows(paths: Sequence[str], wanted: dict[int, list[int]], columns: list[str] | None = None,
              convert: Callable[[list[dict]], list] = lambda records: records) -> dict[tuple[int, int], object]:
    """What `convert` makes of the staged records at {unit: [rows]} of the units' record files
    `paths` (one result per record), by (unit, row); reads only the row groups that hold them, one
    at a time (a group's records are converted together before the next group is read, so only
    what `convert` keeps stays in memory)."""
    out = {}
    for u, rows in wanted.items():
        staged = pq.ParquetFile(paths[u])
        sizes = [staged.metadata.row_group(g).num_rows for g in range(staged.num_row_groups)]
        starts = np.concatenate([[0], np.cumsum(sizes)])
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        groups = np.searchsorted(starts, rows, side="right") - 1
        for g in np.unique(groups).tolist():
            inside = rows[groups == g]
            taken = staged.read_row_group(g, columns=columns).take(pa.array(inside - starts[g]))
            out.update({(u, int(r)): value for r, value in zip(inside.tolist(), convert(taken.to_pylist()))})
    return out


@dataclass(frozen=True)
class StagedRecords:
    """The staged units as `dedup_table.duplicates_table` reads them: near-stage columns from the
    key files, shingle sets from the records. Only paths: cheap to send to a worker."""
    records_paths: tuple[str, ...]
    keys_paths: tuple[str, ...]
    config: DedupConfig

    def near_rows(self, table: pl.DataFrame):
        """(row indices of `table`, band keys, sketches), one unit's key file at a time."""
        columns = band_columns(self.config) + ["sketch"]
        index = table.select("unit", "row").with_row_index("at")
        for (u,), part in sorted(index.partition_by("unit", as_dict=True).items()):
            rows = pl.read_parquet(self.keys_paths[u], columns=columns)[part["row"].to_numpy()]
            yield part["at"].to_numpy(), *near_matrices(rows, self.config)

    def shingle_sets(self, refs: list[tuple[int, int]], size: int) -> list[np.ndarray]:
        wanted: dict[int, list[int]] = {}
        for u, row in refs:
            wanted.setdefault(u, []).append(row)
        found = read_rows(self.records_paths, wanted, columns=["task", "conversations"],
                          convert=lambda records: shingle_set_hashes(records, size))
        return [found[ref] for ref in refs]


def global_duplicates(keys: pl.DataFrame, units, config, map_units=in_order, workdir: Path | None = None) -> list[dict]:
    """The duplicates map of the clean records (the band screens and verification chunks on `map_units`)."""
    records = StagedRecords(tuple(u.records_path for u in units), tuple(u.keys_path for u in units), config.dedup)
    clean = keys.select(*RANK_COLUMNS, "id", "source", "source_id", "source_file").filter(keys["contaminated"].is_null())
    return duplicates_table(clean, records, config.dedup, map_units, workdir)


def unit_pools(records_path: str, kept_rows: np.ndarray) -> EnvPools:
    """The pools of one unit's kept positives, in order; reads four small columns and the first turn."""
    pools = EnvPools()
    kept = set(kept_rows.tolist())
    row = 0
    for batch in pq.ParquetFile(records_path).iter_batches(
            batch_size=BATCH_ROWS, columns=["kind", "env", "domain", "answer", "conversations"]):
        first = pc.list_slice(batch.column("conversations"), 0, 1)
        small = pa.RecordBatch.from_arrays([batch.column("kind"), batch.column("env"), batch.column("domain"),
                                            batch.column("answer"), first],
                                           names=["kind", "env", "domain", "answer", "conversations"])
        for i, record in enumerate(small.to_pylist()):
            if row + i in kept:
                pools.add(record)
        row += batch.num_rows
    return pools


# The outputs a unit's kept records make, staged per unit and cut into shards in unit order.
OUTPUTS = {"sft": "trajectory", "negatives": "trajectory", "preference": "preference", "grpo": "grpo",
           "grpo_env_records": "grpo_env", "step_labels": "step_labels"}


@dataclass
class UnitOutputs:
    """What `write_unit` staged and counted for one unit; small enough to pass between processes."""
    paths: dict[str, str]
    nbytes: dict[str, int]
    rows: dict[str, int]
    # Quarantine rows of the unit's contaminated records, in order.
    contaminated: list[dict] = field(default_factory=list)
    negatives_by_type: dict[str, int] = field(default_factory=dict)
    unpaired: int = 0
    # (label source, label) -> labelled steps of the unit's step_labels rows.
    step_labels: dict[tuple[str, int], int] = field(default_factory=dict)
    # task id -> the first answer of a synthetic trajectory of it (for the task files' grpo_env rows).
    synthetic_answers: dict[str, str] = field(default_factory=dict)


def write_unit(records_path: str, staged: str, kept_rows: np.ndarray, repeats: dict[int, int],
               contaminated: dict[int, str], pools: EnvPools, negatives: NegativesConfig,
               task_ids: frozenset[str]) -> UnitOutputs:
    """Stream one unit's staged records once: each kept record goes to `sft` (its id made unique,
    `repeats`), its negatives, their preference pairs (the parent is the record at hand) and the
    step labels of both, its GRPO prompt, and the grpo_env row of its resettable task unless
    `task_ids` (the task files') or an earlier record of the unit has it. Contaminated rows become quarantine rows."""
    writers = {name: StreamingParquet(Path(staged) / f"{name}.parquet", arrow_schema(schema))
               for name, schema in OUTPUTS.items()}
    kept = set(kept_rows.tolist())
    seen_tasks = set(task_ids)
    out = UnitOutputs({}, {}, {})
    negatives_by_type: Counter[str] = Counter()
    step_labels: Counter[tuple[str, int]] = Counter()
    row = 0
    for batch in pq.ParquetFile(records_path).iter_batches(batch_size=BATCH_ROWS):
        for i, record in enumerate(batch.to_pylist()):
            at = row + i
            if at in repeats:
                meta = json.loads(record["meta"])
                meta["id_repeat"] = repeats[at]
                record = {**record, "id": f"{record['id']}~{repeats[at]}", "meta": json.dumps(meta, sort_keys=True)}
            if at in contaminated:
                out.contaminated.append(quarantine_entry(
                    record["source"], record["source_file"], json.loads(record["meta"]).get("source_index", -1),
                    record["source_id"], "contaminated", contaminated[at], shown(record)))
            if at not in kept:
                continue
            writers["sft"].append(record)
            label_rows = [step_labels_of(record)]
            for negative in negatives_of(record, pools, negatives):
                writers["negatives"].append(negative)
                negatives_by_type[negative["negative_type"]] += 1
                pair = preference_pair(negative, record)
                if pair is None:
                    out.unpaired += 1
                else:
                    writers["preference"].append(pair)
                label_rows.append(negative_step_labels(negative, record))
            for labelled in filter(None, label_rows):
                writers["step_labels"].append(labelled)
                step_labels.update((m["label_source"], m["label"]) for m in labelled["messages"] if m["label"] is not None)
            if record["kind"] != "positive":
                continue
            prompt = grpo_prompt(record)
            if prompt is not None:
                writers["grpo"].append(prompt)
            task_id = json.loads(record["meta"]).get("task_id") if record["source"] == "synthetic" else None
            if task_id is not None and record["answer"] is not None:
                out.synthetic_answers.setdefault(task_id, record["answer"])
            task = record_task(record)
            if task is not None and task.id not in seen_tasks:
                seen_tasks.add(task.id)
                writers["grpo_env_records"].append(grpo_env_row(task, record["source"], row_id=task.id,
                                                                env=record["env"], answer=record["answer"]))
        row += batch.num_rows
    for name, writer in writers.items():
        writer.close()
        out.paths[name], out.nbytes[name], out.rows[name] = str(writer.path), writer.nbytes, writer.count
    out.negatives_by_type = dict(negatives_by_type)
    out.step_labels = dict(step_labels)
    return out


def first_task_rows(parts: list[str], path: Path) -> tuple[str, int, int]:
    """The units' grpo_env rows (`parts`, in unit order) without the tasks an earlier unit already
    gave, staged at `path`: (path, Arrow bytes, rows)."""
    seen: set[str] = set()
    with StreamingParquet(path, arrow_schema("grpo_env")) as writer:
        for part in parts:
            for batch in pq.ParquetFile(part).iter_batches(batch_size=BATCH_ROWS):
                for row in batch.to_pylist():
                    if row["id"] not in seen:
                        seen.add(row["id"])
                        writer.append(row)
    return str(writer.path), writer.nbytes, writer.count
