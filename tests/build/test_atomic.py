"""The one file writer: concurrent writers of one path never corrupt it; a killed writer leaves only
a temp file that the next run's cleanup removes."""
import json
import multiprocessing
import os
import random
import signal
import string
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajforge.pipeline.atomic import (
    PARQUET_SINK_BUFFER,
    TEMP_GLOB,
    StreamingTable,
    atomic_path,
    batch_sizes,
    ipc_nbytes,
    read_batches,
    remove_stale_temp_files,
    write_json,
    write_parquet,
    write_text,
)

SCHEMA = pa.schema([("writer", pa.int64()), ("payload", pa.string())])


def _write_many(path: str, writer: int, times: int) -> None:
    from pathlib import Path
    for _ in range(times):
        rows = [{"writer": writer, "payload": str(writer) * 1000} for _ in range(200)]
        write_parquet(rows, SCHEMA, Path(path))


def test_concurrent_processes_writing_one_path_leave_one_whole_file(tmp_path):
    path = tmp_path / "out" / "data.parquet"
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_write_many, args=(str(path), n, 15)) for n in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    table = pq.read_table(path).to_pylist()
    # One writer's file, whole: every row from the same writer, all 200 of them.
    assert len(table) == 200 and len({r["writer"] for r in table}) == 1
    assert table[0]["payload"] == str(table[0]["writer"]) * 1000
    assert list(path.parent.glob(TEMP_GLOB)) == []


def test_concurrent_threads_writing_one_path_use_distinct_temp_files(tmp_path):
    path = tmp_path / "report.json"
    errors = []

    def write(n: int) -> None:
        try:
            for i in range(50):
                write_json(path, {"writer": n, "i": i, "pad": "x" * 10_000})
        except Exception as exc:  # a shared temp name shows as a missing file on rename
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text())["pad"] == "x" * 10_000
    assert list(tmp_path.glob(TEMP_GLOB)) == []


def test_killed_writer_leaves_only_a_temp_file_that_cleanup_removes(tmp_path):
    path = tmp_path / "data" / "card.md"
    write_text(path, "the earlier, finished file\n")
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from trajforge.pipeline.atomic import atomic_path
        with atomic_path(Path({str(path)!r})) as tmp:
            with open(tmp, "w") as f:
                f.write("half of a new")
                f.flush()
                print("writing", flush=True)
                time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    left = list(path.parent.glob(TEMP_GLOB))
    assert len(left) == 1 and left[0].read_text() == "half of a new"
    assert path.read_text() == "the earlier, finished file\n"
    assert remove_stale_temp_files(tmp_path) == left
    assert list(path.parent.iterdir()) == [path]


def test_cleanup_keeps_this_process_temp_files(tmp_path):
    with atomic_path(tmp_path / "a.txt") as tmp:
        tmp.write_text("in progress")
        assert remove_stale_temp_files(tmp_path) == [] and tmp.exists()
    assert (tmp_path / "a.txt").read_text() == "in progress"


def test_failed_write_removes_its_temp_file_and_keeps_the_target(tmp_path):
    path = tmp_path / "x.json"
    write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}
    with pytest.raises(RuntimeError), StreamingTable(tmp_path / "s.arrow", SCHEMA) as stream:
        stream.append({"writer": 1, "payload": "p"})
        raise RuntimeError("stage failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_a_streamed_table_is_parquet_or_arrow_by_its_suffix(tmp_path):
    rows = [{"writer": i, "payload": "same text " * 20} for i in range(2500)]
    written = {}
    for suffix in ("parquet", "arrow"):
        with StreamingTable(tmp_path / f"t.{suffix}", SCHEMA) as stream:
            for row in rows:
                stream.append(row)
        written[suffix] = stream
    parquet = pq.ParquetFile(tmp_path / "t.parquet")
    assert [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)] == [1000, 1000, 500]
    assert {parquet.metadata.row_group(g).column(c).compression for g in range(3) for c in range(2)} == {"ZSTD"}
    assert parquet.read().to_pylist() == rows
    arrow = pa.ipc.open_file(tmp_path / "t.arrow")
    assert arrow.schema == SCHEMA and arrow.read_all().to_pylist() == rows
    assert batch_sizes(tmp_path / "t.arrow") == [1000, 1000, 500]
    # Shards are planned by the Arrow size of what was written, whatever the file's format.
    assert written["parquet"].nbytes == written["arrow"].nbytes == pa.Table.from_pylist(rows, schema=SCHEMA).nbytes
    assert (tmp_path / "t.arrow").stat().st_size > 2 * (tmp_path / "t.parquet").stat().st_size  # no codec


def test_parquet_through_the_buffered_sink_is_the_file_pyarrow_writes_to_a_path(tmp_path):
    # Text that compresses little: the files are several times the sink's buffer, which is written out more than once.
    rng = random.Random(0)
    rows = [{"writer": i, "payload": "".join(rng.choices(string.ascii_letters, k=2000))} for i in range(3000)]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    write_parquet(rows, SCHEMA, tmp_path / "whole.parquet")
    pq.write_table(table, tmp_path / "whole_by_pyarrow.parquet", compression="zstd")
    with StreamingTable(tmp_path / "streamed.parquet", SCHEMA) as stream:
        stream.extend(rows)
    with pq.ParquetWriter(tmp_path / "streamed_by_pyarrow.parquet", SCHEMA, compression="zstd") as writer:
        for start in range(0, len(rows), 1000):
            writer.write_table(table.slice(start, 1000))
    for ours, theirs in (("whole", "whole_by_pyarrow"), ("streamed", "streamed_by_pyarrow")):
        written = (tmp_path / f"{ours}.parquet").read_bytes()
        assert len(written) > 2 * PARQUET_SINK_BUFFER
        assert written == (tmp_path / f"{theirs}.parquet").read_bytes()


def test_staged_batches_read_back_as_written_with_only_the_columns_asked(tmp_path):
    rows = [{"writer": i, "payload": f"row {i}"} for i in range(25)]
    # Not fsynced (a file only the run writing it reads), it is just as whole once renamed into place.
    with StreamingTable(tmp_path / "t.arrow", SCHEMA, batch_rows=10, durable=False) as stream:
        for row in rows:
            stream.append(row)
    assert [b.num_rows for b in read_batches(tmp_path / "t.arrow")] == batch_sizes(tmp_path / "t.arrow") == [10, 10, 5]
    assert pa.ipc.open_file(tmp_path / "t.arrow").read_all().to_pylist() == rows
    (second,) = read_batches(tmp_path / "t.arrow", ["payload", "writer"], [1])
    assert second.schema.names == ["payload", "writer"] and second.to_pylist() == [
        {"payload": f"row {i}", "writer": i} for i in range(10, 20)]


def test_rows_as_lists_or_arrow_tables_are_cut_and_sized_as_rows_appended_one_by_one(tmp_path):
    rows = [{"writer": i, "payload": None if i % 7 == 3 else f"row {i}"} for i in range(45)]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    with StreamingTable(tmp_path / "one.arrow", SCHEMA, batch_rows=10, durable=False) as one_by_one:
        for row in rows:
            one_by_one.append(row)
    with StreamingTable(tmp_path / "lists.arrow", SCHEMA, batch_rows=10, durable=False) as lists:
        for start in (0, 3, 26, 40):
            lists.extend(rows[start:{0: 3, 3: 26, 26: 40, 40: 45}[start]])
    # Arrow pieces that are slices and takes (validity bitmaps where their rows have no null, buffers
    # beyond their rows): the size counted is the one of the rows themselves.
    with StreamingTable(tmp_path / "tables.arrow", SCHEMA, batch_rows=10, durable=False) as tables:
        tables.append_table(table.slice(0, 4).take(pa.array([0, 1, 2, 3])))
        tables.append_table(table.slice(4, 20))
        tables.append_table(table.slice(24, 21))
    for stream in (lists, tables):
        assert batch_sizes(stream.path) == batch_sizes(one_by_one.path) == [10, 10, 10, 10, 5]
        assert pa.ipc.open_file(stream.path).read_all().to_pylist() == rows
        assert (stream.nbytes, stream.count) == (one_by_one.nbytes, one_by_one.count) == (
            sum(pa.Table.from_pylist(rows[i:i + 10], schema=SCHEMA).nbytes for i in range(0, 45, 10)), 45)


NESTED = pa.schema([
    ("id", pa.string()), ("n", pa.int64()), ("score", pa.float64()), ("ok", pa.bool_()), ("none", pa.null()),
    ("tags", pa.list_(pa.string())), ("raw", pa.large_string()),
    ("turns", pa.list_(pa.struct([pa.field("role", pa.string(), nullable=False), ("content", pa.string()),
                                  ("loss", pa.bool_()), ("n", pa.int64())]))),
])


def _nested_rows(count: int) -> list[dict]:
    return [{"id": f"r{i}" * (i % 4), "n": None if i % 5 == 1 else i, "score": None if i % 3 == 0 else i / 3,
             "ok": None if i % 6 == 2 else i % 2 == 0, "none": None, "tags": None if i % 4 == 3 else ["a"] * (i % 3),
             "raw": "x" * i, "turns": None if i % 9 == 4 else [
                 {"role": "user", "content": None if (i + k) % 5 == 0 else "c" * (i + k), "loss": k % 2 == 0,
                  "n": None if k == 1 else k} for k in range(i % 4)]}
            for i in range(count)]


@pytest.mark.parametrize("rows", [_nested_rows(37), [r for r in _nested_rows(37) if r["turns"] is not None][:5]])
def test_ipc_nbytes_is_the_size_of_the_rows_as_read_back_whatever_their_layout(rows):
    table = pa.Table.from_pylist(rows, schema=NESTED)
    pieces = [table, table.slice(3, 20), table.slice(5, 0), table.take(pa.array([i % table.num_rows for i in (8, 2, 2, 30, 0)])),
              table.filter(pa.array([i % 3 != 1 for i in range(table.num_rows)])),
              pa.concat_tables([table.slice(1, 7), table.slice(20, 9)]).combine_chunks()]
    for piece in pieces:
        batch = piece.combine_chunks().to_batches()[0] if piece.num_rows else pa.RecordBatch.from_pylist([], schema=NESTED)
        read_back = pa.ipc.read_record_batch(batch.serialize(), NESTED)
        assert sum(ipc_nbytes(column) for column in batch.columns) == read_back.nbytes
        assert [ipc_nbytes(column) for column in batch.columns] == [column.nbytes for column in read_back.columns]
