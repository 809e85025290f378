"""Shards: HF layout, size targets, zstd and streaming row groups, determinism, resume markers."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.oracles import write_config
from trajforge.pipeline.atomic import StreamingTable
from trajforge.pipeline.publish.manifest import file_sha256, read_manifest
from trajforge.pipeline.publish.shards import (
    SHARD_RE,
    ShardConfig,
    layout,
    link_readers,
    plan_shards,
    plan_split,
    write_shard_from_files,
)


@pytest.fixture(scope="module")
def sft_table(fixtures_build) -> pa.Table:
    return pq.read_table(fixtures_build / "data" / "sft" / "train-00000-of-00001.parquet")


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(folder.rglob("*.parquet"))}


def test_rows_target_gives_hf_names_zstd_and_small_row_groups(sft_table, tmp_path):
    config = ShardConfig(max_rows=50, row_group_rows=16)
    written = write_config(tmp_path, "sft", {"train": sft_table}, config)
    n = -(-sft_table.num_rows // 50)
    assert written == {"train": [f"data/sft/train-{i:05d}-of-{n:05d}.parquet" for i in range(n)]}
    back = pa.concat_tables(pq.read_table(tmp_path / p) for p in written["train"])
    assert back.to_pylist() == sft_table.to_pylist()
    for rel in written["train"]:
        meta = pq.read_metadata(tmp_path / rel)
        assert meta.num_rows <= 50
        assert all(meta.row_group(i).num_rows <= 16 for i in range(meta.num_row_groups))
        assert {meta.row_group(0).column(c).compression for c in range(meta.num_columns)} == {"ZSTD"}
    assert layout(tmp_path) == {"sft": written}


def test_shards_cut_from_staged_files_are_those_of_the_whole_table(sft_table, tmp_path):
    """Staged in three Arrow files of 5-row batches, the rows give the same shard files, byte for
    byte, as the table written whole: shards and row groups begin and end inside batches and files."""
    rows = sft_table.to_pylist()
    staged = []
    for k, (start, stop) in enumerate([(0, 7), (7, 8), (8, len(rows))]):
        with StreamingTable(tmp_path / "staged" / f"{k}.arrow", sft_table.schema, batch_rows=5) as part:
            for row in rows[start:stop]:
                part.append(row)
        staged.append(part.path)
    config = ShardConfig(max_rows=9, row_group_rows=4)
    plan = plan_split(tmp_path / "streamed", "sft", "train", staged, sft_table.schema, sft_table.num_rows,
                      sft_table.nbytes, config)
    for call in plan.calls:
        write_shard_from_files(*call)
    streamed = plan.paths(tmp_path / "streamed")
    whole = write_config(tmp_path / "whole", "sft", {"train": sft_table}, config)
    assert streamed == whole and len(whole["train"]) == -(-len(rows) // 9) > 2
    for rel in whole["train"]:
        assert (tmp_path / "streamed" / rel).read_bytes() == (tmp_path / "whole" / rel).read_bytes(), rel


def test_shards_that_read_only_their_staged_files_free_each_once_read(sft_table, tmp_path):
    """Planned with each staged file's rows, a shard reads only the files that hold its rows, through
    its own links (the files' names are gone): the same bytes, and once every shard has removed its
    links, no staged file is left; a file outside the staged folder is read where it is and kept."""
    rows = sft_table.to_pylist()
    bounds = [(0, 7), (7, 7), (7, 8), (8, 30), (30, len(rows))]
    staged = []
    for k, (start, stop) in enumerate(bounds):
        folder = tmp_path / ("outside" if k == len(bounds) - 1 else "staged")
        with StreamingTable(folder / f"{k}.arrow", sft_table.schema, batch_rows=5) as part:
            for row in rows[start:stop]:
                part.append(row)
        staged.append(part.path)
    config = ShardConfig(max_rows=9, row_group_rows=4)
    plan = plan_split(tmp_path / "streamed", "sft", "train", staged, sft_table.schema, sft_table.num_rows,
                      sft_table.nbytes, config, [stop - start for start, stop in bounds])
    assert all(len(call[1]) < len(staged) for call in plan.calls) and str(staged[1]) not in plan.calls[0][1]
    calls, releases = link_readers(plan.calls, tmp_path / "staged")
    assert [path.exists() for path in staged] == [False, True, False, False, True]
    for call, release in zip(calls, releases):
        write_shard_from_files(*call)
        for link in release:
            (tmp_path / link).unlink()
    assert [p.name for p in (tmp_path / "staged").iterdir()] == ["1.arrow"] and staged[-1].exists()
    whole = write_config(tmp_path / "whole", "sft", {"train": sft_table}, config)
    for rel in whole["train"]:
        assert (tmp_path / "streamed" / rel).read_bytes() == (tmp_path / "whole" / rel).read_bytes(), rel


def test_where_the_staging_folder_takes_no_hard_links_shards_read_the_staged_files_in_place(sft_table, tmp_path,
                                                                                            monkeypatch):
    """A filesystem without hard links (os.link fails with EPERM, as on FAT): the calls read the
    staged files where they are, release nothing, and the shards' bytes are the same."""
    import errno
    import os

    staged = []
    for k, (start, stop) in enumerate([(0, 12), (12, sft_table.num_rows)]):
        with StreamingTable(tmp_path / "staged" / f"{k}.arrow", sft_table.schema, batch_rows=5) as part:
            part.append_table(sft_table.slice(start, stop - start))
        staged.append(part.path)
    config = ShardConfig(max_rows=9, row_group_rows=4)
    plan = plan_split(tmp_path / "streamed", "sft", "train", staged, sft_table.schema, sft_table.num_rows,
                      sft_table.nbytes, config, [12, sft_table.num_rows - 12])

    def no_link(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted", dst)

    monkeypatch.setattr(os, "link", no_link)
    calls, releases = link_readers(plan.calls, tmp_path / "staged")
    assert calls == plan.calls and releases == [[] for _ in plan.calls]
    assert sorted(p.name for p in (tmp_path / "staged").iterdir()) == ["0.arrow", "1.arrow"]
    for call in calls:
        write_shard_from_files(*call)
    whole = write_config(tmp_path / "whole", "sft", {"train": sft_table}, config)
    for rel in whole["train"]:
        assert (tmp_path / "streamed" / rel).read_bytes() == (tmp_path / "whole" / rel).read_bytes(), rel


def test_a_shard_takes_its_schema_and_its_rows_from_staged_files(sft_table, tmp_path):
    """Staged without the schema's metadata, the rows are cast to the shard's schema; staged files
    that end before the shard's last row are an error, not a short shard."""
    bare = sft_table.schema.remove_metadata()
    assert not bare.equals(sft_table.schema, check_metadata=True)
    with StreamingTable(tmp_path / "staged.arrow", bare, batch_rows=5) as part:
        part.append_table(sft_table.cast(bare))
    config = ShardConfig(row_group_rows=4)
    write_shard_from_files(str(tmp_path / "a.parquet"), [str(part.path)], 3, 10, sft_table.schema, config)
    back = pq.read_table(tmp_path / "a.parquet")
    assert back.schema.equals(sft_table.schema, check_metadata=True)
    assert back.to_pylist() == sft_table.slice(3, 10).to_pylist()
    with pytest.raises(ValueError, match="short"):
        write_shard_from_files(str(tmp_path / "b.parquet"), [str(part.path)], 3, sft_table.num_rows, sft_table.schema,
                               config)
    assert not (tmp_path / "b.parquet").exists()


def test_bytes_target_bounds_each_shard(sft_table):
    target = sft_table.nbytes // 5
    plan = plan_shards(sft_table.num_rows, sft_table.nbytes, ShardConfig(max_bytes=target))
    assert len(plan) >= 5 and sum(length for _, length in plan) == sft_table.num_rows
    for offset, length in plan:
        # Sizes are planned on the average row, so a shard may exceed the target by a few long rows.
        assert sft_table.slice(offset, length).nbytes < 2 * target
    assert plan_shards(0, 0, ShardConfig()) == []


def _three_shards(table) -> ShardConfig:
    return ShardConfig(max_rows=-(-table.num_rows // 3))


def test_same_input_same_bytes(sft_table, tmp_path):
    config = _three_shards(sft_table)
    write_config(tmp_path / "a", "sft", {"train": sft_table}, config)
    write_config(tmp_path / "b", "sft", {"train": sft_table}, config)
    a, b = _snapshot(tmp_path / "a"), _snapshot(tmp_path / "b")
    assert {k: v[2] for k, v in a.items()} == {k: v[2] for k, v in b.items()} and len(a) == 3


def test_markers_skip_done_shards_and_repair_damaged_ones(sft_table, tmp_path):
    config = _three_shards(sft_table)
    write_config(tmp_path, "sft", {"train": sft_table}, config)
    before = _snapshot(tmp_path)
    write_config(tmp_path, "sft", {"train": sft_table}, config)
    assert _snapshot(tmp_path) == before  # same inode and mtime: nothing rewritten

    damaged = tmp_path / "data/sft/train-00001-of-00003.parquet"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    write_config(tmp_path, "sft", {"train": sft_table}, config)
    after = _snapshot(tmp_path)
    assert after["data/sft/train-00001-of-00003.parquet"][2] == before["data/sft/train-00001-of-00003.parquet"][2]
    assert after["data/sft/train-00000-of-00003.parquet"][:2] == before["data/sft/train-00000-of-00003.parquet"][:2]

    # Fewer shards next time: the old ones go, so the folder never mixes two builds.
    write_config(tmp_path, "sft", {"train": sft_table}, ShardConfig(max_rows=1000))
    assert sorted(p.name for p in (tmp_path / "data/sft").iterdir()) == ["train-00000-of-00001.parquet"]


def test_build_folder_loads_like_the_hub_and_manifest_lists_every_file(fixtures_build, tmp_path):
    import datasets

    configs = layout(fixtures_build)
    assert {"sft", "negatives", "preference", "grpo"} <= set(configs)
    for name, splits in configs.items():
        ds = datasets.load_dataset(str(fixtures_build), name, split="train", cache_dir=str(tmp_path / "cache"))
        table = pa.concat_tables(pq.read_table(fixtures_build / p) for p in splits["train"])
        assert ds.num_rows == table.num_rows > 0, name
        assert ds.to_list() == table.to_pylist(), name

    manifest = read_manifest(fixtures_build)
    published = sorted(p.relative_to(fixtures_build).as_posix() for p in fixtures_build.rglob("*")
                       if p.is_file() and not p.relative_to(fixtures_build).as_posix().startswith(".")
                       and p.name != "manifest.json")
    assert sorted(manifest["files"]) == published
    assert "README.md" in published and all(not p.startswith(".staging") for p in published)
    for rel, entry in manifest["files"].items():
        assert entry == {"size": (fixtures_build / rel).stat().st_size, "sha256": file_sha256(fixtures_build / rel)}
    assert all(SHARD_RE.match(p.split("/")[-1]) for p in published if p.startswith("data/"))

