"""The second half of a build, in bounded memory: key tables, staged records, per-unit writers.

Each unit stages, next to its records, a key table (`KeysWriter`, built where the records are read):
per record the dedup keys (dedup_table.record_keys), and the fields the report counts.
`finalize` (pipeline/build/second_half.py) then

1. concatenates the key tables in build order, without the near-dedup columns and the ids, the
   strings of few values as categories (`key_table`);
2. runs the global stages on that table (pipeline/build/global_stages.py: decontamination, exact
   and near dedup, `StagedRecords` reading what the table leaves out), then makes ids unique, the
   published records first (`unique_ids`, a window over the ids that may repeat, read back);
3. fills the bounded per-env pools of the negative makers, one pool per unit of its kept positives
   (`unit_pools`, merged in unit order; pools.py);
4. streams each unit's staged records once more (`write_unit`), skipping the dropped ones: each
   staged batch's kept records go through the makers of the outputs (pipeline/build/outputs.py:
   `sft`, their negatives, preference pairs, GRPO prompts, grpo_env rows, step labels) into the
   unit's file of each. Shards are cut from those files in unit order (shards.plan_split);
   the report, the card and the manifest come from the key table and the tallies already in memory.

Steps 2-4 are per band, per chunk or per unit: `finalize` hands them to its `map_units`, so a
flow runs them on its task runner (other cores, or a cluster's workers). Peak memory of the
driver is the narrow key table (~80 bytes a record) and the duplicates map; of a worker, one
batch of records or one band's pairs. The outputs are those of the in-memory build: same
records, same order, same duplicates map, negatives, pairs and prompts.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import CountedTable, StreamingTable, atomic_path, batch_sizes, parquet_sink, read_batches
from trajforge.pipeline.build.config import BATCH_ROWS, BuildConfig
from trajforge.pipeline.build.kept import batch_mask, kept_tables, rows_within
from trajforge.pipeline.build.outputs import OUTPUTS, Output, UnitContext, UnitOutputs
from trajforge.pipeline.quality.dedup import DedupConfig, string_buffers
from trajforge.pipeline.quality.dedup_table import SKETCH_BINS, NearParts, band_columns, record_keys, shingle_set_hashes
from trajforge.pipeline.quality.negatives import NegativesConfig
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.pipeline.quarantine import quarantine_entry, shown
from trajforge.pipeline.stages import cyclic_gc_paused
from trajforge.schemas import arrow_schema

if TYPE_CHECKING:
    from trajforge.pipeline.build.units import UnitResult

# The codec of the units' staged outputs (`write_unit`).
STAGED_OUTPUTS_CODEC = "lz4"


def stage_keys(records: list[dict], staged: pa.Table, start: int, config: BuildConfig) -> pl.DataFrame:
    """The key table rows of a batch of one unit's records (`staged`: the same records as staged, in
    Arrow, whose columns give the rows; `start`: the batch's row in the unit)."""
    keys = record_keys(records, staged, start, config.dedup)
    turns = staged.column("conversations")
    return keys.with_columns(
        *(pl.Series(name, staged.column(name), dtype=pl.String) for name in ("kind", "rendering", "domain", "env")),
        pl.Series("turns", pc.list_value_length(turns), dtype=pl.Int32),
        pl.Series("chars", _chars(turns), dtype=pl.Int64),
    )


def _chars(turns: pa.ChunkedArray) -> np.ndarray:
    """Per record, the characters (`len`) of its turns' contents, summed."""
    chunks = [chunk for chunk in turns.chunks if len(chunk)]
    if not chunks:  # no rows (a key file's schema): the compiled loop is not loaded for them
        return np.zeros(0, dtype=np.int64)
    from trajforge.pipeline.quality.keys_kernel import record_chars

    return np.concatenate([record_chars(chunk.offsets.to_numpy(), *string_buffers(chunk.values.field("content")))
                           for chunk in chunks])


class KeysWriter:
    """Stages a unit's key table as its records are written, one batch (one row group) at a time:
    memory stays one batch of keys, whatever the unit's size."""

    def __init__(self, path: Path, config: BuildConfig, batch_rows: int = BATCH_ROWS):
        self.path, self.config, self.batch_rows = path, config, batch_rows
        self.pending: list[dict] = []
        self.pending_staged: list[pa.Table] = []
        self.count = 0
        schema = stage_keys([], arrow_schema("trajectory").empty_table(), 0, config).to_arrow().schema
        # Hash values (the band keys, the exact hash) and the row counter neither repeat nor compress:
        # written without the dictionary that Parquet tries first. The strings of few values take a
        # dictionary. No column is compressed: zstd was ~2/3 of the writer's CPU (most of it the
        # sketches', 2.7 -> 0.9 us a record) for a file ~60 % larger (~770 bytes a record), which
        # the build reads back no slower.
        plain = {"order", "exact", *band_columns(config.dedup)}
        # The temp file renamed into place and its buffered sink, closed in turn by `close`; the temp
        # file removed at once if the writer cannot start.
        with ExitStack() as files:
            sink = files.enter_context(parquet_sink(files.enter_context(atomic_path(path))))
            self._writer = pq.ParquetWriter(
                sink, schema, compression="none",
                use_dictionary=[name for name in schema.names if name not in plain and name != "sketch"])
            self._open = files.pop_all()

    def extend(self, records: list[dict], staged: pa.Table) -> None:
        """Records as their unit writes them, and as it staged them (StreamingTable's `on_written`):
        the key table stays row for row in step with the staged records."""
        self.pending.extend(records)
        self.pending_staged.append(staged)
        if len(self.pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            staged = pa.concat_tables(self.pending_staged)
            self._writer.write_table(stage_keys(self.pending, staged, self.count, self.config).to_arrow())
            self.count += len(self.pending)
            self.pending, self.pending_staged = [], []

    def close(self) -> None:
        self._flush()
        self._writer.close()
        self._open.close()


# Key table columns of few distinct values (the group, a source's and a file's name, the kind, the
# env...): categorical in the flow, 4 bytes a record each instead of a string of 12 to 40.
CATEGORICAL = ["group", "source", "source_file", "kind", "rendering", "domain", "env"]


def key_table(units: list[UnitResult], config: BuildConfig) -> pl.DataFrame:
    """Every unit's key table in build order, narrowed for the flow, with the global `order`, the
    `unit` and its `row`. The near-dedup columns stay in the key files (`near_rows` loads them for
    the records that need them), and so do `id` and `source_id` (`StagedRecords.key_columns`, for
    the records of the duplicates map and those that may repeat an id: `repeated_id`, their id's
    64-bit hash is another record's too): at a million records the strings would be most of the
    table. `exact` is held as its first 128 bits. Ids are as read; `unique_ids` makes them unique
    after the global stages."""
    left_out = set(band_columns(config.dedup)) | {"sketch", "source_id"}
    frames, offset = [], 0
    for u, unit in enumerate(units):
        columns = [c for c in pq.read_schema(unit.keys_path).names if c not in left_out]
        frame = pl.read_parquet(unit.keys_path, columns=columns)
        frames.append(frame.with_columns(
            pl.col(CATEGORICAL).cast(pl.Categorical),
            pl.col("exact").str.slice(0, 32).str.to_integer(base=16, dtype=pl.UInt128),
            pl.col("order").alias("row"), (pl.col("order") + offset).alias("order"),
            pl.lit(u, dtype=pl.Int32).alias("unit"), id_hash=pl.col("id").hash()).drop("id"))
        offset += frame.height
    return pl.concat(frames).with_columns(repeated_id=pl.col("id_hash").is_duplicated()).drop("id_hash")


def unique_ids(kept: pl.DataFrame, dropped: pl.DataFrame, records: StagedRecords) -> pl.DataFrame:
    """The records whose id repeats an earlier one, with the `~n` suffix each gets (`repeat` n = 2,
    3, ...; never overwritten): (order, unit, row, repeat). Counted after the global stages, over
    the key rows they `kept` (the published records) in build order, then over those they
    `dropped` (order, unit, row). A published id so carries `~n` only when n - 1 published records
    before it have the same upstream id, never because a dropped copy was counted, and a dropped
    copy's id in the duplicates map is never a published one."""
    # Only a repeated id needs counting, and few are: the ids of the kept records whose id hash
    # repeats and of the dropped ones (a few percent) are read back (`records`), and the window
    # runs on their rows alone.
    rows = pl.concat([kept.filter(pl.col("repeated_id")).select("order", "unit", "row", later=pl.lit(False)),
                      dropped.select("order", "unit", "row", later=pl.lit(True))])
    if rows.is_empty():
        return rows.select("order", "unit", "row", repeat=pl.lit(0, dtype=pl.UInt32))
    return (rows.with_columns(records.key_columns(rows, ["id"]))
            .select("order", "unit", "row", repeat=pl.col("id").cum_count().over("id", order_by=["later", "order"]))
            .filter(pl.col("repeat") > 1))


def with_unique_ids(duplicates: pl.DataFrame, repeats: pl.DataFrame) -> pl.DataFrame:
    """The duplicates map with the ids `unique_ids` gave the dropped and the kept records (by the
    build `order` and `kept_order` of each; `repeats` as `unique_ids` returns them)."""
    repeat = repeats.select("order", pl.col("repeat").cast(pl.String))
    kept_repeat = repeat.rename({"order": "kept_order", "repeat": "kept_repeat"})

    def unique(upstream: str, suffix: str) -> pl.Expr:
        return pl.when(pl.col(suffix).is_null()).then(pl.col(upstream)).otherwise(pl.concat_str(upstream, pl.lit("~"), suffix))

    return (duplicates.join(repeat, on="order", how="left", maintain_order="left")
            .join(kept_repeat, on="kept_order", how="left", maintain_order="left")
            .with_columns(id=unique("id", "repeat"), kept_id=unique("kept_id", "kept_repeat"))
            .drop("repeat", "kept_repeat"))


def read_rows(paths: Sequence[str], wanted: dict[int, list[int]], columns: list[str] | None = None,
              convert: Callable[[list[dict]], list] = lambda records: records) -> dict[tuple[int, int], object]:
    """What `convert` makes of the staged records at {unit: [rows]} of the units' record files
    `paths` (one result per record), by (unit, row); reads only the record batches that hold them,
    one at a time (a batch's records are converted together before the next batch is read, so only
    what `convert` keeps stays in memory)."""
    out = {}
    for u, rows in wanted.items():
        starts = np.concatenate([[0], np.cumsum(batch_sizes(paths[u]))])
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        at = np.searchsorted(starts, rows, side="right") - 1
        held = np.unique(at).tolist()
        for b, batch in zip(held, read_batches(paths[u], columns, held)):
            inside = rows[at == b]
            taken = batch.take(pa.array(inside - starts[b]))
            out.update({(u, int(r)): value for r, value in zip(inside.tolist(), convert(taken.to_pylist()))})
    return out


@dataclass(frozen=True)
class StagedRecords:
    """The staged units as `dedup_table.duplicates_table` reads them: near-stage columns from the
    key files, shingle sets from the records. Only paths: cheap to send to a worker."""
    records_paths: tuple[str, ...]
    keys_paths: tuple[str, ...]
    config: DedupConfig

    @classmethod
    def of(cls, units: Sequence[UnitResult], config: DedupConfig) -> StagedRecords:
        return cls(tuple(u.records_path for u in units), tuple(u.keys_path for u in units), config)

    def near_parts(self, table: pl.DataFrame) -> NearParts:
        """The band keys and sketches of `table`'s rows (dedup_table.NearParts), one unit's key file
        at a time."""
        index = [(part["at"].to_numpy(), u, part["row"].to_numpy())
                 for (u,), part in sorted(table.select("unit", "row").with_row_index("at")
                                          .partition_by("unit", as_dict=True).items())]
        bands = band_columns(self.config)

        def column(name: str, wanted: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for at, u, rows in index:
                if wanted is not None:
                    inside = np.isin(at, wanted)
                    at, rows = at[inside], rows[inside]
                read = pq.ParquetFile(self.keys_paths[u]).read(columns=bands if name == "bands" else [name])
                if name == "sketch":
                    yield at, _sketch_rows(read.column(0).take(pa.array(rows)).combine_chunks())
                else:
                    yield at, np.stack([read.column(c).to_numpy() for c in bands], axis=1)[rows]

        return column

    def key_columns(self, table: pl.DataFrame, columns: list[str]) -> pl.DataFrame:
        """The key files' `columns` (left out of the key table: ids) at the `unit`, `row` of each
        row of the non-empty `table`, in its order."""
        parts = list(self._unit_parts(table, columns))
        at = np.concatenate([a for a, _ in parts])
        return pl.concat([rows for _, rows in parts])[np.argsort(at)]

    def _unit_parts(self, table: pl.DataFrame, columns: list[str]) -> Iterator[tuple[np.ndarray, pl.DataFrame]]:
        """(row indices of `table`, the key files' `columns` at their `unit`, `row`), a unit at a time."""
        index = table.select("unit", "row").with_row_index("at")
        for (u,), part in sorted(index.partition_by("unit", as_dict=True).items()):
            yield part["at"].to_numpy(), pl.read_parquet(self.keys_paths[u], columns=columns)[part["row"].to_numpy()]

    def shingle_sets(self, refs: list[tuple[int, int]], size: int) -> list[np.ndarray]:
        wanted: dict[int, list[int]] = {}
        for u, row in refs:
            wanted.setdefault(u, []).append(row)
        found = read_rows(self.records_paths, wanted, columns=["task", "conversations"],
                          convert=lambda records: shingle_set_hashes(records, size))
        return [found[ref] for ref in refs]


def _sketch_rows(values: pa.Array) -> np.ndarray:
    """(n, SKETCH_BINS) uint8 of a key file's `sketch` values (each SKETCH_BINS bytes), from the
    array's data, without a Python object a row."""
    offsets = np.frombuffer(values.buffers()[1], dtype=np.int64, count=len(values) + 1, offset=values.offset * 8)
    if not (np.diff(offsets) == SKETCH_BINS).all():
        raise ValueError(f"a sketch is not {SKETCH_BINS} bytes")
    data = np.frombuffer(values.buffers()[2], dtype=np.uint8)
    return data[offsets[0]:offsets[-1]].reshape(len(values), SKETCH_BINS)


def unit_pools(records_path: str, kept_rows: np.ndarray) -> EnvPools:
    """The pools of one unit's kept positives, in order; reads four small columns and the first turn
    of the tool domain's positives (the only first turns `EnvPools.add` reads: converting every
    record's, a task's whole instructions, was half of this step's CPU). `kept_rows`: sorted."""
    pools = EnvPools()
    start = 0
    for batch in read_batches(records_path, ["kind", "env", "domain", "answer", "conversations"]):
        end = start + batch.num_rows
        keep = batch_mask(rows_within(kept_rows, start, end), start, batch.num_rows)
        positives = batch.filter(pc.and_(keep, pc.equal(batch.column("kind"), "positive")))
        tool = pc.equal(positives.column("domain"), "tool")
        firsts = iter(pc.list_slice(positives.column("conversations").filter(tool), 0, 1).to_pylist())
        for record, is_tool in zip(positives.drop_columns(["conversations"]).to_pylist(), tool.to_pylist()):
            record["conversations"] = next(firsts) if is_tool else []
            pools.add(record)
        start = end
    return pools


def _read_fields(outputs: list[Output]) -> list[str]:
    """The fields of a kept record that `outputs`' makers read from its dict (`Output.reads`, the
    turns when a row maker reads them), with the id and meta, in schema order."""
    read = {"id", "meta"}.union(*(output.reads for output in outputs))
    if any(output.rows is not None and output.reads_turns for output in outputs):
        read.add("conversations")
    return [name for name in arrow_schema("trajectory").names if name in read]


def _kept_records(records_path: str, kept_rows: np.ndarray, repeats: dict[int, int],
                  quarantined: dict[int, tuple[str, str]], out: UnitOutputs,
                  fields: list[str] | None = None) -> Iterator[tuple[pa.Table, list[dict]]]:
    """Per staged batch, its kept records (their ids made unique, `repeats`) as an Arrow table and
    as dicts (of `fields` only, with id and meta, when given); the quarantine rows of its records a
    global stage quarantined go to `out`."""
    def quarantine(batch: pa.RecordBatch, start: int) -> None:
        held = sorted(row for row in quarantined if start <= row < start + batch.num_rows)
        if held:
            records = batch.take(pa.array(np.asarray(held) - start)).to_pylist()
            out.quarantined.extend(_quarantine_row(record, *quarantined[row]) for row, record in zip(held, records))

    for table in kept_tables(records_path, kept_rows, repeats, on_batch=quarantine if quarantined else None):
        # Only the fields the makers read (`Output.reads`; the turns only when a row maker reads
        # them, `Output.reads_turns`: a batch's maker converts those it reads, `Output.batch`).
        yield table, (table if fields is None else table.select(fields)).to_pylist()


def _quarantine_row(record: dict, reason: str, detail: str) -> dict:
    return quarantine_entry(record["source"], record["source_file"], json.loads(record["meta"]).get("source_index", -1),
                            record["source_id"], reason, detail, shown(record))


def _made_rows(table: pa.Table, records: list[dict], makers: list[Output],
               unit: UnitContext) -> dict[str, list[list[dict]]]:
    """Per row maker, the rows it made of each of `records` (`table` as dicts), in their order: a
    batch's maker (`Output.batch`) first, then each per-record maker on each record in turn."""
    rows: dict[str, list[list[dict]]] = {output.name: [] for output in makers}
    batched = [output for output in makers if output.batch is not None]
    for output in batched:
        rows[output.name] = output.batch(table, records, unit)
    per_record = [output for output in makers if output.batch is None]
    for i, record in enumerate(records):
        made: dict[str, list[dict]] = {output.name: rows[output.name][i] for output in batched}
        for output in per_record:
            made[output.name] = output.rows(record, made, unit)
            rows[output.name].append(made[output.name])
    return rows


def _write_batch(output: Output, table: pa.Table, records: list[dict], made: dict[str, list[list[dict]]],
                 writer: CountedTable, counts: dict[str, Counter]) -> None:
    """What `output` makes of a staged batch (its kept records as `table` and as `records`, what the
    row makers `made` of each): the kept records themselves (`Output.staged` False), its table
    maker's table, or its row maker's rows of each record in turn."""
    if output.staged and output.table is None:
        rows = [row for of_record in made[output.name] for row in of_record]
        writer.extend(rows)
    else:
        rows = output.table(table, records, made) if output.staged else table
        writer.append_table(rows)
    if output.count is not None:
        counts[output.name].update(output.count(rows))


def write_unit(records_path: str, staged: str, kept_rows: np.ndarray, repeats: dict[int, int],
               quarantined: dict[int, tuple[str, str]], pools: EnvPools, negatives: NegativesConfig) -> UnitOutputs:
    """Stream one unit's staged records once: each kept record (`kept_rows`, sorted; their ids made unique, `repeats`)
    goes through the row maker of every output that has one, then each staged batch's kept records
    and those rows through the table maker of every other (pipeline/build/outputs.py, in the
    registry's order), into the unit's file of that output; the records a global stage quarantined
    (`quarantined`: row -> reason, detail) become quarantine rows."""
    written = [output for output in OUTPUTS.values() if not output.staged or output.table is not None
               or output.rows is not None or output.batch is not None]
    makers = [output for output in written if output.rows is not None or output.batch is not None]
    # Read once by this run, into the shards, and deleted: Arrow IPC files, not fsynced, lz4 (a fifth
    # of the raw size: ~24 GB at 1M trajectories outgrew the page cache, and the shards waited on the disk).
    # An output whose rows are the kept records as they are is counted, not staged (`Output.staged`).
    writers = {o.name: StreamingTable(Path(staged) / f"{o.name}.arrow", arrow_schema(o.schema), durable=False,
                                      codec=STAGED_OUTPUTS_CODEC) if o.staged else CountedTable()
               for o in written}
    counts: dict[str, Counter] = {o.name: Counter() for o in written if o.count is not None}
    unit = UnitContext(pools, negatives)
    out = UnitOutputs()
    with cyclic_gc_paused():
        for table, records in _kept_records(records_path, kept_rows, repeats, quarantined, out, _read_fields(written)):
            made = _made_rows(table, records, makers, unit)
            for output in written:
                _write_batch(output, table, records, made, writers[output.name], counts)
    for name, writer in writers.items():
        writer.close()
        out.nbytes[name], out.rows[name] = writer.nbytes, writer.count
        if isinstance(writer, StreamingTable):
            out.paths[name] = str(writer.path)
    out.counts, out.synthetic_answers = counts, unit.synthetic_answers
    return out
