"""A unit's kept records, read from its staged records: what the unit writers make the outputs
from, and what the `sft` shards are cut from.

The global stages leave each unit a set of kept rows of its staged records file, some of whose ids
repeat an earlier record's (`assemble.unique_ids`: such a record takes the id `<id>~<n>` and
`meta.id_repeat`). `kept_tables` reads them a staged batch at a time, as Arrow. `KeptRecords` is the
same rows cut into the batches a `StreamingTable` of them would hold, without writing them: the
`sft` output is the kept records as they are, so its shards read them from the staged records
rather than from a copy of them (~5 GB of Arrow at 1M trajectories, and a fifth of the unit
writers' lz4 compression).
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from trajforge.pipeline.atomic import STREAMED_BATCH_ROWS, batch_sizes, read_batches


def rows_within(kept: np.ndarray, start: int, end: int) -> np.ndarray:
    """The rows of `kept` (sorted) in [start, end): a staged batch's kept rows."""
    return kept[np.searchsorted(kept, start):np.searchsorted(kept, end)]


def batch_mask(rows: np.ndarray, start: int, num_rows: int) -> pa.Array:
    """A batch's filter mask (the batch starts at row `start`): true at `rows`."""
    keep = np.zeros(num_rows, dtype=bool)
    keep[rows - start] = True
    return pa.array(keep)


def repeated_id(record_id: str, meta: str, repeat: int) -> tuple[str, str]:
    """The id and meta of a record whose id repeats an earlier one's (`repeat`: its number)."""
    fields = json.loads(meta)
    fields["id_repeat"] = repeat
    return f"{record_id}~{repeat}", json.dumps(fields, sort_keys=True)


def _unique_ids(table: pa.Table, rows: np.ndarray, repeats: dict[int, int]) -> pa.Table:
    """`table` (the kept records at `rows`) with the ids `repeats` gives the repeated ones."""
    repeated = [(i, repeats[row]) for i, row in enumerate(rows.tolist()) if row in repeats] if repeats else []
    if not repeated:
        return table
    ids, metas = table["id"].to_pylist(), table["meta"].to_pylist()
    for i, repeat in repeated:
        ids[i], metas[i] = repeated_id(ids[i], metas[i], repeat)
    for name, values in (("id", ids), ("meta", metas)):
        at = table.schema.get_field_index(name)
        table = table.set_column(at, table.schema.field(at), pa.array(values, pa.string()))
    return table


def _kept_of(batch: pa.RecordBatch, start: int, rows: np.ndarray, repeats: dict[int, int], share: bool = False,
             own: bool = False) -> pa.Table:
    """The records at `rows` (sorted) of a staged batch that begins at row `start`, their ids made
    unique by `repeats`: the batch itself where it is all of them, else a copy of them; with
    `share`, a slice of the batch where they are a run; with `own`, a copy always (one that holds no
    buffer of the batch, which it may outlive)."""
    table = pa.Table.from_batches([batch])
    if own or len(rows) < batch.num_rows:
        if share and not own and rows[-1] - rows[0] + 1 == len(rows):
            table = table.slice(int(rows[0]) - start, len(rows))
        else:
            # A filter, not a take of the rows: the same table at half the CPU (strings are copied
            # in runs, their sizes known before, where a take appends them one at a time).
            table = table.filter(batch_mask(rows, start, batch.num_rows))
    return _unique_ids(table, rows, repeats)


def kept_tables(records_path: str, kept: np.ndarray, repeats: dict[int, int],
                on_batch: Callable[[pa.RecordBatch, int], None] | None = None) -> Iterator[pa.Table]:
    """Per staged batch of a unit's records, its kept records (`kept`: sorted rows) as a table,
    their ids made unique by `repeats`; `on_batch(batch, start)` sees each staged batch as read
    first (`start`: the unit's row it begins at)."""
    start = 0
    for batch in read_batches(records_path):
        if on_batch is not None:
            on_batch(batch, start)
        end = start + batch.num_rows
        yield _kept_of(batch, start, rows_within(kept, start, end), repeats)
        start = end


@dataclass(frozen=True)
class KeptRecords:
    """A unit's kept records (`kept`: sorted rows of its staged records; their ids made unique by
    `repeats`) in batches of `batch_rows`, as `StreamingTable.append_table` of `kept_tables` would
    write them: what a shard reads of them (pipeline/publish/shards.py, in place of a staged file).
    Only paths and row numbers: cheap to send to a worker."""
    records_path: str
    kept: np.ndarray
    repeats: dict[int, int]
    batch_rows: int = STREAMED_BATCH_ROWS

    def batch_sizes(self) -> list[int]:
        full, rest = divmod(len(self.kept), self.batch_rows)
        return [self.batch_rows] * full + ([rest] if rest else [])

    def batches(self, first: int) -> Iterator[pa.RecordBatch]:
        """The batches from the one at index `first` on, each made of the staged batches' kept
        records that fall in it (not of whole kept tables cut, as `CountedTable` does: a staged
        batch's kept records stay in memory only while a batch takes some of them)."""
        kept = self.kept[first * self.batch_rows:]
        if not len(kept):
            return
        sizes = batch_sizes(self.records_path)
        starts = np.cumsum([0, *sizes])
        held = int(np.searchsorted(starts, kept[0], side="right")) - 1
        pieces: list[pa.Table] = []
        need = self.batch_rows
        for batch, start in zip(read_batches(self.records_path, batches=range(held, len(sizes))), starts[held:].tolist()):
            rows, done = rows_within(kept, start, start + batch.num_rows), []
            while len(rows):
                taken, rows = rows[:need], rows[need:]
                # The last piece of this staged batch, when a batch after it is to complete the one it begins, a copy.
                pieces.append(_kept_of(batch, start, taken, self.repeats, share=True, own=len(taken) < need))
                need -= len(taken)
                if not need:
                    done.append(pa.concat_tables(pieces).combine_chunks())
                    pieces, need = [], self.batch_rows
            del batch  # freed before the batches it completed are written (~16 MB at 1M)
            for table in done:
                yield from table.to_batches()
        if pieces:
            yield from pa.concat_tables(pieces).combine_chunks().to_batches()
