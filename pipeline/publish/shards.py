"""Parquet shards in the Hugging Face layout.

Layout: `data/<config>/<split>-NNNNN-of-MMMMM.parquet`, the names `datasets` and the Hub expect.
A split is cut into shards of a target size (rows, or uncompressed Arrow bytes), with zstd and
row groups small enough that a streaming reader holds one group at a time.

Same table + same ShardConfig -> same file names and byte-identical files: nothing in a shard
depends on time, host, runner or worker count.

Crash safety: every file is written to a temp name and renamed (a staged unit's completion marker:
pipeline/build/resume.py).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import atomic_path, batch_sizes, parquet_sink, read_batches

SHARD_RE = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.parquet$")


@dataclass(frozen=True)
class ShardConfig:
    # Rows per shard; when set it wins over max_bytes.
    max_rows: int | None = None
    # Target uncompressed (Arrow) size of a shard. The Hub viewer and `datasets` handle a few
    # hundred MB per file well; smaller shards parallelize better.
    max_bytes: int = 256 * 1024 * 1024
    # Trajectories are long (tens of KB): 256 rows keep a streaming reader's row group at a few MB.
    row_group_rows: int = 256
    compression_level: int = 3


def shard_name(split: str, index: int, count: int) -> str:
    return f"{split}-{index:05d}-of-{count:05d}.parquet"


def plan_shards(rows: int, nbytes: int, config: ShardConfig) -> list[tuple[int, int]]:
    """(offset, length) of each shard of a split of `rows` rows and `nbytes` Arrow bytes; at least
    one row per shard, none for an empty split."""
    if rows == 0:
        return []
    if config.max_rows is not None:
        per_shard = max(1, config.max_rows)
    else:
        per_shard = max(1, int(config.max_bytes // max(1, nbytes / rows)))
    return [(offset, min(per_shard, rows - offset)) for offset in range(0, rows, per_shard)]


# -- shards ------------------------------------------------------------------------------------

def layout(out: Path) -> dict[str, dict[str, list[str]]]:
    """config -> split -> shard paths (relative, sorted) found under `out/data`."""
    found: dict[str, dict[str, list[str]]] = {}
    data = out / "data"
    for folder in sorted(p for p in data.iterdir() if p.is_dir()) if data.exists() else []:
        for path in sorted(folder.iterdir()):
            match = SHARD_RE.match(path.name)
            if match:
                found.setdefault(folder.name, {}).setdefault(match["split"], []).append(
                    path.relative_to(out).as_posix())
    return found


# -- shards from a stream ----------------------------------------------------------------------

class StagedBatches(Protocol):
    """Rows a shard is cut from that are not a staged Arrow file (a build's kept records as they
    are: pipeline/build/kept.py), in record batches as a staged file would hold them."""

    def batch_sizes(self) -> list[int]: ...

    def batches(self, first: int) -> Iterable[pa.RecordBatch]:
        """The record batches from the one at index `first` on."""
        ...


# A shard's staged rows: an Arrow IPC file (`StreamingTable`), or batches read from elsewhere.
Staged = str | StagedBatches


class _StagedFile:
    """An Arrow IPC file (`StreamingTable`) as `StagedBatches` (its batch sizes read once)."""

    def __init__(self, path: str):
        self.path, self.sizes = path, batch_sizes(path)

    def batch_sizes(self) -> list[int]:
        return self.sizes

    def batches(self, first: int) -> Iterable[pa.RecordBatch]:
        return read_batches(self.path, batches=range(first, len(self.sizes)))


def _rows_of(staged: list[Staged], offset: int, length: int, batch_rows: int):
    """Record batches of rows [offset, offset + length) of the staged parts (files or `StagedBatches`)
    read as one table, reading only the record batches that hold them, each cut in pieces of
    `batch_rows` rows from its start (a shard's bytes depend on where its rows' pieces begin and end)."""
    for part in staged:
        if length <= 0:
            return
        part = _StagedFile(part) if isinstance(part, str) else part
        sizes = part.batch_sizes()
        first = 0
        while first < len(sizes) and offset >= sizes[first]:
            offset -= sizes[first]
            first += 1
        for written in part.batches(first):
            for start in range(0, written.num_rows, batch_rows):
                batch = written.slice(start, batch_rows)
                if offset >= batch.num_rows:
                    offset -= batch.num_rows
                    continue
                piece = batch.slice(offset, length)
                offset, length = 0, length - piece.num_rows
                yield piece
                if length <= 0:
                    return


def _row_groups(pieces, length: int, group_rows: int):
    """The pieces of each row group of `group_rows` rows (the last one shorter) of the first
    `length` rows of `pieces`: the pieces as they come, the one across a group's end cut in two."""
    group: list[pa.RecordBatch] = []
    need = min(length, group_rows)
    for piece in pieces:
        while piece.num_rows and need:
            head = piece.slice(0, need)
            group.append(head)
            need -= head.num_rows
            length -= head.num_rows
            piece = piece.slice(head.num_rows)
            if not need:
                yield group
                group, need = [], min(length, group_rows)
    if need:
        raise ValueError(f"the staged files end {length} rows short of the shard's last row")


def write_shard_from_files(path: str, staged: list[Staged], offset: int, length: int, schema: pa.Schema,
                           config: ShardConfig) -> Path:
    """One shard at `path` (returned): rows [offset, offset + length) of the staged files, in row groups of
    `config.row_group_rows` counted from the shard's first row. A row group is written as the
    pieces that hold it (a shard's bytes depend on them), cast only where the staged schema is not
    the shard's (at 100k, a cast of equal schemas took ~4 % of the step's CPU)."""
    with atomic_path(Path(path)) as tmp, parquet_sink(tmp) as sink, \
            pq.ParquetWriter(sink, schema, compression="zstd", compression_level=config.compression_level) as writer:
        pieces = _rows_of(staged, offset, length, config.row_group_rows)
        for group in _row_groups(pieces, length, config.row_group_rows):
            table = pa.Table.from_batches(group)
            if not table.schema.equals(schema, check_metadata=True):
                table = table.cast(schema)
            writer.write_table(table, row_group_size=config.row_group_rows)
    return Path(path)


@dataclass(frozen=True)
class SplitShards:
    """One split of one config planned as shards: each shard's `write_shard_from_files` arguments
    and its share of the split's Arrow bytes (what a task runner balances its tasks by)."""
    folder: Path
    split: str
    names: list[str]
    calls: list[tuple]
    sizes: list[int]

    def paths(self, out: Path) -> dict[str, list[str]]:
        """split -> shard paths relative to `out`."""
        return {self.split: [(self.folder / name).relative_to(out).as_posix() for name in self.names]}

    def remove_stale(self) -> None:
        """Shards of an earlier build that this one does not produce, so the folder holds one build."""
        if self.folder.exists():
            for stale in self.folder.iterdir():
                if SHARD_RE.match(stale.name) and stale.name not in self.names:
                    stale.unlink()


def _read_as(part: Path | Staged) -> Staged:
    """A staged part as a shard's call names it: a file by its path (a string), other batches as they are."""
    return str(part) if isinstance(part, (str, os.PathLike)) else part


def _parts_read(staged: list[Path | Staged], part_rows: list[int], offset: int, length: int) -> tuple[list[Staged], int]:
    """The staged parts that hold rows [offset, offset + length) of them read as one table (none
    without rows), and the offset of the first row in the first of them."""
    chosen, first, start = [], 0, 0
    for part, rows in zip(staged, part_rows):
        if rows and start + rows > offset and start < offset + length:
            first = first if chosen else offset - start
            chosen.append(_read_as(part))
        start += rows
    return chosen, first


def plan_split(out: Path, config_name: str, split: str, staged: list[Path | Staged], schema: pa.Schema, rows: int,
               nbytes: int, config: ShardConfig = ShardConfig(), part_rows: list[int] | None = None) -> SplitShards:
    """The shards of one split of one config, staged as Arrow IPC files or `StagedBatches` (their rows in order): each
    shard is one `write_shard_from_files` call (shards are independent, so a flow writes them, of
    every config at once, on its task runner), one row group of it in memory at a time. `rows` and
    `nbytes` are the split's rows and Arrow size as their writers counted them (what `plan_shards`
    divides). `schema` is the split's Arrow schema (a Parquet round trip renames list items, which
    would change the bytes). With `part_rows` (the rows of each staged file), a shard's call names
    only the staged files that hold its rows (`link_readers` then gives each its own links)."""
    folder = out / "data" / config_name
    # An empty split is one shard without rows: every config loads.
    plan = plan_shards(rows, nbytes, config) or [(0, 0)]
    names = [shard_name(split, index, len(plan)) for index in range(len(plan))]
    read = [_parts_read(staged, part_rows, offset, length) if part_rows is not None
            else ([_read_as(p) for p in staged], offset) for offset, length in plan]
    calls = [(str(folder / name), files, first, length, schema, config)
             for name, (_, length), (files, first) in zip(names, plan, read)]
    return SplitShards(folder, split, names, calls, [length * nbytes // max(1, rows) for _, length in plan])


# What `os.link` fails with where a filesystem has no hard links (FAT, some FUSE and network mounts).
NO_HARD_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS}


def link_readers(calls: list[tuple], within: Path) -> tuple[list[tuple], list[list[str]]]:
    """The shard calls (`SplitShards.calls`, of staged files named by `part_rows`), each reading
    its own hard links to its staged files under `within`, whose names are removed; and each
    call's links, which it removes once its shard is written. The call that removes a file's last
    link frees it, while the other shards are written, rather than the flow removing every staged
    file after the last shard (~24 GB at 1M). Files outside `within` (and batches that are no file)
    are read where they are; so is every file where `within` takes no hard links (freed with the
    staging folder, after the shards)."""
    linked, releases, originals, made = [], [], set(), []
    try:
        for index, (path, staged, *rest) in enumerate(calls):
            links, release = [], []
            for file in staged:
                if not isinstance(file, str) or not Path(file).resolve().is_relative_to(within.resolve()):
                    links.append(file)
                    continue
                link = f"{file}.reader-{index}"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(link)  # left by a run that failed before its shard was written
                os.link(file, link)
                made.append(link)
                links.append(link)
                release.append(link)
                originals.add(file)
            linked.append((path, links, *rest))
            releases.append(release)
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        for link in made:
            os.unlink(link)
        return calls, [[] for _ in calls]
    for file in originals:
        os.unlink(file)
    return linked, releases
