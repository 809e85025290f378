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
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from trajforge.pipeline.atomic import STREAMED_BATCH_ROWS, TableBatches, batch_sizes, read_batches


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


def kept_tables(records_path: str, kept: np.ndarray, repeats: dict[int, int], batches: range | None = None,
                start: int = 0) -> Iterator[tuple[pa.RecordBatch, int, pa.Table]]:
    """Per staged batch of a unit's records (every one, or those at the indices `batches`, the first
    of which begins at row `start`): (the batch as staged, the row it begins at, its kept records
    (`kept`: sorted rows) as a table, their ids made unique by `repeats`)."""
    for batch in read_batches(records_path, batches=batches):
        end = start + batch.num_rows
        rows = rows_within(kept, start, end)
        table = pa.Table.from_batches([batch])
        if len(rows) < batch.num_rows:  # else the batch as read, not a copy
            # A filter, not a take of the rows: the same table at half the CPU (strings are copied
            # in runs, their sizes known before, where a take appends them one at a time).
            table = table.filter(batch_mask(rows, start, batch.num_rows))
        yield batch, start, _unique_ids(table, rows, repeats)
        start = end


@dataclass(frozen=True)
class KeptRecords:
    """A unit's kept records (`kept`: sorted rows of its staged records; their ids made unique by
    `repeats`) in batches of `batch_rows`, as `StreamingTable.append_table` of each staged batch's
    kept records would write them: what a shard reads of them (pipeline/publish/shards.py, in place of
    a staged file). Only paths and row numbers: cheap to send to a worker."""
    records_path: str
    kept: np.ndarray
    repeats: dict[int, int]
    batch_rows: int = STREAMED_BATCH_ROWS

    def batch_sizes(self) -> list[int]:
        full, rest = divmod(len(self.kept), self.batch_rows)
        return [self.batch_rows] * full + ([rest] if rest else [])

    def batches(self, first: int) -> Iterator[pa.RecordBatch]:
        """The batches from the one at index `first` on."""
        if first * self.batch_rows >= len(self.kept):
            return
        kept = self.kept[first * self.batch_rows:]
        sizes = batch_sizes(self.records_path)
        starts = np.cumsum([0, *sizes])
        held = int(np.searchsorted(starts, kept[0], side="right")) - 1
        cut = TableBatches(self.batch_rows)
        for _, _, table in kept_tables(self.records_path, kept, self.repeats, range(held, len(sizes)), int(starts[held])):
            for batch in cut.add(table):
                yield from batch.to_batches()
        if (rest := cut.last()) is not None:
            yield from rest.to_batches()
