"""A unit's kept records as the `sft` shards read them (pipeline/build/kept.py): the same batches,
counts and shard bytes as a staged copy of them."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajforge.pipeline.atomic import CountedTable, StreamingTable, batch_sizes, read_batches
from trajforge.pipeline.build.kept import KeptRecords, kept_tables
from trajforge.pipeline.publish.shards import ShardConfig, plan_split, write_shard_from_files
from trajforge.schemas import arrow_schema


@pytest.fixture(scope="module")
def records(fixtures_build) -> list[dict]:
    return pq.read_table(fixtures_build / "data" / "sft" / "train-00000-of-00001.parquet").to_pylist()


@pytest.fixture
def unit(records, tmp_path):
    """A unit's staged records (batches of 7), its kept rows (two of every three) and two repeated ids."""
    with StreamingTable(tmp_path / "records.arrow", arrow_schema("trajectory"), batch_rows=7) as staged:
        for record in records:
            staged.append(record)
    kept = np.array([row for row in range(len(records)) if row % 3 != 1], dtype=np.int64)
    return str(staged.path), kept, {int(kept[2]): 1, int(kept[9]): 2}


def _staged_copy(unit, path, batch_rows: int) -> tuple[StreamingTable, CountedTable]:
    """The unit's kept records staged as the unit writers stage an output's rows, and counted."""
    counted = CountedTable(batch_rows)
    with StreamingTable(path, arrow_schema("trajectory"), batch_rows=batch_rows) as copy:
        for table in kept_tables(*unit):
            copy.append_table(table)
            counted.append_table(table)
    counted.close()
    return copy, counted


def test_kept_records_are_the_batches_of_a_staged_copy(records, unit, tmp_path):
    records_path, kept, repeats = unit
    copy, counted = _staged_copy(unit, tmp_path / "copy.arrow", batch_rows=5)
    view = KeptRecords(records_path, kept, repeats, batch_rows=5)
    sizes = batch_sizes(copy.path)
    assert view.batch_sizes() == sizes and sum(sizes) == len(kept) > 20
    assert (counted.count, counted.nbytes) == (copy.count, copy.nbytes)
    for first in range(len(sizes) + 1):  # from every batch on, as a shard that begins there reads them
        expected = list(read_batches(copy.path, batches=range(first, len(sizes))))
        got = list(view.batches(first))
        assert [b.num_rows for b in got] == [b.num_rows for b in expected]
        assert all(a.equals(b) for a, b in zip(got, expected)), first
    rows = pa.Table.from_batches(list(view.batches(0))).to_pylist()
    by_row = dict(zip(kept.tolist(), rows))
    renamed = {row: (got["id"], json.loads(got["meta"]).get("id_repeat")) for row, got in by_row.items()
               if got["id"] != records[row]["id"]}
    assert renamed == {row: (f"{records[row]['id']}~{n}", n) for row, n in repeats.items()}


def test_shards_of_kept_records_are_those_of_a_staged_copy(unit, tmp_path):
    """Shards and row groups that begin and end inside the kept records' batches: the same bytes
    read from the kept records as from a staged copy of them, next to another staged file."""
    records_path, kept, repeats = unit
    copy, counted = _staged_copy(unit, tmp_path / "copy.arrow", batch_rows=5)
    other, _ = _staged_copy((records_path, kept[:11], {}), tmp_path / "other.arrow", batch_rows=5)
    schema, config = arrow_schema("trajectory"), ShardConfig(max_rows=8, row_group_rows=3)
    rows, nbytes = copy.count + other.count, copy.nbytes + other.nbytes
    written = {}
    for name, first in (("copy", copy.path), ("kept", KeptRecords(records_path, kept, repeats, batch_rows=5))):
        plan = plan_split(tmp_path / name, "sft", "train", [first, other.path], schema, rows, nbytes, config,
                          [counted.count, other.count])
        written[name] = [write_shard_from_files(*call).read_bytes() for call in plan.calls]
    assert len(written["kept"]) == -(-rows // 8) > 3
    assert written["kept"] == written["copy"]
