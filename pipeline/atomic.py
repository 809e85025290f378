"""Atomic file writes: every file the pipeline writes goes through here.

A file is written under a hidden temp name beside its target, flushed to disk (fsync), then renamed
onto the target, and the folder is fsynced so the rename itself survives a crash. A reader sees
the old file or the new one, never half of one. The temp name carries the process id and a random
part, so two writers of one path (two synth jobs on one folder, two threads) never share a temp
file: the last rename wins, and the file is whole either way. A killed writer leaves only its temp
file, which `remove_stale_temp_files` deletes on the next run.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger("trajforge.atomic")

# Every temp file matches this glob: `.<name>.tmp-<pid>-<random>`.
TEMP_GLOB = ".*.tmp-*"


def temp_name(path: Path) -> Path:
    """Where `path` is written before its rename: hidden, named by the process and a random part."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temp path to write; on success it is fsynced and renamed onto `path`, on error removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        yield tmp
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def write_bytes(path: Path | str, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path | str, text: str, encoding: str = "utf-8") -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)


def write_json(path: Path | str, value, *, indent: int | None = 2, sort_keys: bool = True) -> None:
    """`value` as JSON text; indented (with a final newline) unless `indent` is None (compact)."""
    text = json.dumps(value, indent=indent, sort_keys=sort_keys)
    write_text(path, text + "\n" if indent is not None else text)


# A Parquet writer writes each page by itself and asks its file where it stands (a seek) before
# each: through this buffer, a write a MiB and no system call for a position. The same bytes.
PARQUET_SINK_BUFFER = 1 << 20


def parquet_sink(path: Path | str) -> pa.NativeFile:
    """A buffered stream to write a Parquet file at `path` through (`PARQUET_SINK_BUFFER`); closing
    it writes out what it holds."""
    return pa.output_stream(str(path), compression=None, buffer_size=PARQUET_SINK_BUFFER)


def write_table(table: pa.Table, path: Path | str, **options) -> None:
    """A Parquet file (zstd unless `options` say otherwise; they go to `pyarrow.parquet.write_table`)."""
    with atomic_path(path) as tmp, parquet_sink(tmp) as sink:
        pq.write_table(table, sink, **{"compression": "zstd", **options})


def write_parquet(rows: list[dict], schema: pa.Schema, path: Path | str) -> None:
    write_table(pa.Table.from_pylist(rows, schema=schema), path)


# Rows of a record batch a `StreamingTable` writes (and a `CountedTable` counts).
STREAMED_BATCH_ROWS = 1000

# A file of this suffix is written (`StreamingTable`) and read (`read_batches`) as an Arrow IPC
# file; any other as Parquet.
ARROW_SUFFIX = ".arrow"


def ipc_nbytes(array: pa.Array) -> int:
    """`nbytes` of `array` once written to Arrow IPC and read back (what `from_pylist` would make of
    its values): a validity bitmap only where a value is null, offsets and values only for its own
    rows (a slice or a take keeps bitmaps without nulls and buffers beyond its rows, which IPC
    drops). Counted from the layout, without the copy of every buffer that a round trip through
    `serialize` makes (~3 % of the unit writers' instructions); a type not laid out below takes the
    round trip."""
    n, kind = len(array), array.type
    size = (n + 7) // 8 if array.null_count else 0
    if pa.types.is_struct(kind):
        return size + sum(ipc_nbytes(array.field(i)) for i in range(kind.num_fields))
    if pa.types.is_list(kind) or pa.types.is_string(kind) or pa.types.is_binary(kind):
        # The offsets of its n rows (IPC's read-back arrays count n of them, not n + 1), and the
        # values between its first and its last offset.
        first = last = 0
        if n:
            offsets = np.frombuffer(array.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * array.offset)
            first, last = int(offsets[0]), int(offsets[n])
        values = ipc_nbytes(array.values.slice(first, last - first)) if pa.types.is_list(kind) else last - first
        return size + 4 * n + values
    if pa.types.is_boolean(kind):
        return size + (n + 7) // 8
    if pa.types.is_null(kind):
        return 0
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return size + n * kind.byte_width
    batch = pa.record_batch([array], names=["_"])
    return pa.ipc.read_record_batch(batch.serialize(), batch.schema).nbytes


class CountedTable:
    """The rows and Arrow bytes (`count`, `nbytes`) of the tables appended, in the batches a
    `StreamingTable` writes, counted without writing them: an output whose rows are already staged
    elsewhere (a build's `sft`, the kept records: pipeline/build/kept.py)."""

    def __init__(self, batch_rows: int = STREAMED_BATCH_ROWS):
        self.batch_rows = batch_rows
        self.pending_tables: list[pa.Table] = []
        self.pending_table_rows = 0
        self.count = self.nbytes = 0

    def append_table(self, table: pa.Table) -> None:
        """Rows already in Arrow, of this file's schema, cut into batches as `append`'s rows are."""
        self.pending_tables.append(table)
        self.pending_table_rows += table.num_rows
        while self.pending_table_rows >= self.batch_rows:
            self._flush_tables()

    def close(self) -> None:
        self._flush_tables()

    def _flush_tables(self) -> None:
        if not self.pending_table_rows:
            return
        pending = pa.concat_tables(self.pending_tables)
        # One record batch of each `batch_rows` rows, as `_flush` writes them (shards cut their row
        # groups from the staged batches' starts, so their bytes depend on where a batch ends).
        table = pending.slice(0, self.batch_rows).combine_chunks()
        rest = pending.slice(table.num_rows)
        self.pending_tables, self.pending_table_rows = [rest], rest.num_rows
        # Its size as `from_pylist` would make it, what the shards are planned by: a slice or a take
        # keeps validity bitmaps without nulls and buffers beyond its rows, which IPC drops.
        self._write(table, sum(ipc_nbytes(column.chunk(0)) for column in table.columns))

    def _write(self, table: pa.Table, nbytes: int) -> None:
        self.nbytes += nbytes
        self.count += table.num_rows


class StreamingTable(CountedTable):
    """Append rows in batches to a table file written under a temp name, renamed on close.

    The file's suffix says its format: `.arrow` an Arrow IPC file, one record batch per batch of
    rows, its buffers compressed by `codec` (None: raw; a build's staged files, written once, read
    back and deleted: writing and reading them costs a fraction of Parquet's encoding and zstd);
    anything else Parquet with zstd, one row group per batch.

    Rows come as dicts (`append`, `extend`) or already in Arrow (`append_table`, of the file's
    schema: written as they are, never through Python), cut into batches of `batch_rows` either way.
    Memory stays one batch deep however many rows go through. A batch of dicts that Arrow refuses is
    written row by row: each row it still refuses goes to `on_refused(row, exc)` (a build unit
    quarantines it), and the rest of the batch is kept; `on_written(rows, table)` sees the rows of
    every batch written, and the Arrow table they were written as. As a context manager, it is renamed into place on a clean exit and its temp
    file removed on an error. `durable` False skips the fsyncs, for a file that only the run writing
    it reads back (after a crash the rerun writes it again): the writer does not wait for the disk.
    """

    def __init__(self, path: Path, schema: pa.Schema, batch_rows: int = STREAMED_BATCH_ROWS, on_refused=None, on_written=None,
                 durable: bool = True, codec: str | None = None):
        super().__init__(batch_rows)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.schema, self.durable = path, schema, durable
        self.on_refused = on_refused
        self.on_written = on_written
        self.tmp = temp_name(path)
        self.sink = pa.OSFile(str(self.tmp), "wb") if path.suffix == ARROW_SUFFIX else parquet_sink(self.tmp)
        # Buffers compressed on this thread: Arrow's pool compresses a batch's buffers in parallel, and
        # hands each (most are small) to another thread at more CPU than the compression saves in
        # wall time where the cores are busy (~10 % of the write's CPU).
        options = pa.ipc.IpcWriteOptions(compression=codec, use_threads=False)
        self.writer = (pa.ipc.new_file(self.sink, schema, options=options)
                       if path.suffix == ARROW_SUFFIX else pq.ParquetWriter(self.sink, schema, compression="zstd"))
        self.pending: list[dict] = []

    def __enter__(self) -> StreamingTable:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def append(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.batch_rows:
            self._flush()

    def extend(self, rows: list[dict]) -> None:
        """`append` of each of `rows`: the batches are cut where `append` would cut them."""
        self.pending.extend(rows)
        while len(self.pending) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        rows, self.pending = self.pending[:self.batch_rows], self.pending[self.batch_rows:]
        try:
            table = pa.Table.from_pylist(rows, schema=self.schema)
        except Exception:
            if self.on_refused is None:
                raise
            rows = self._convertible(rows)
            table = pa.Table.from_pylist(rows, schema=self.schema)
        self._write(table, table.nbytes)
        if self.on_written is not None:
            self.on_written(rows, table)

    def _write(self, table: pa.Table, nbytes: int) -> None:
        self.writer.write_table(table)
        super()._write(table, nbytes)

    def _convertible(self, rows: list[dict]) -> list[dict]:
        kept = []
        for row in rows:
            try:
                pa.Table.from_pylist([row], schema=self.schema)
            except Exception as exc:
                self.on_refused(row, exc)
                continue
            kept.append(row)
        return kept

    def close(self) -> None:
        self._flush()
        self._flush_tables()
        self.writer.close()
        self.sink.close()
        if self.durable:
            _fsync(self.tmp)
        os.replace(self.tmp, self.path)
        if self.durable:
            _fsync(self.path.parent)

    def abort(self) -> None:
        """Drop what was written: close the writer and remove the temp file."""
        self.writer.close()
        self.sink.close()
        self.tmp.unlink(missing_ok=True)


def batch_sizes(path: Path | str) -> list[int]:
    """The rows of each record batch of an Arrow IPC file (`StreamingTable`): the file is
    memory-mapped and only its first column is read (of a compressed file, only that column's
    buffers are decompressed)."""
    with pa.memory_map(str(path)) as source:
        reader = pa.ipc.open_file(source, options=pa.ipc.IpcReadOptions(included_fields=[0]))
        return [reader.get_batch(i).num_rows for i in range(reader.num_record_batches)]


def read_batches(path: Path | str, columns: list[str] | None = None,
                 batches: Iterable[int] | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of an Arrow IPC file (`StreamingTable`) as written, or those at the
    indices `batches`; with only `columns` (in that order), of which alone the bytes are read.
    Read into memory a batch at a time, not memory-mapped: the pages of a mapped file count in the
    process's memory until the file is closed, a whole file for a whole pass."""
    with pa.OSFile(str(path)) as source:
        # Buffers decompressed on this thread, as `StreamingTable` compresses them: Arrow's pool
        # hands each buffer of a batch to another thread, at about twice the CPU of reading a staged
        # lz4 output on one (where the cores are busy, no sooner).
        options = pa.ipc.IpcReadOptions(use_threads=False)
        reader = pa.ipc.open_file(source, options=options)
        if columns is not None:
            options.included_fields = [reader.schema.get_field_index(name) for name in columns]
            reader = pa.ipc.open_file(source, options=options)
        # Not held here while the caller has it: a caller that drops a batch frees it.
        for i in range(reader.num_record_batches) if batches is None else batches:
            yield reader.get_batch(i) if columns is None else reader.get_batch(i).select(columns)


def remove_stale_temp_files(out: Path) -> list[Path]:
    """Delete the temp files killed earlier writers left under `out` (this process's are kept:
    they are being written now)."""
    mine = f".tmp-{os.getpid()}-"
    stale = [p for p in out.rglob(TEMP_GLOB) if p.is_file() and mine not in p.name] if out.exists() else []
    for path in stale:
        path.unlink(missing_ok=True)
    if stale:
        log.info("removed %d temp files of an earlier, interrupted run", len(stale))
    return stale
