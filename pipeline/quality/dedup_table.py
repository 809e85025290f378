"""Deduplication as group-bys over a compact key table, never over all records at once.

The same decisions as the tests' in-memory oracle (`deduplicate`, tests/support/oracles.py: same text,
same signatures, same keep preference, same verification by the true shingle Jaccard), split so that it scales:

- Map, per batch of records (`record_keys`): the exact hash, the LSH band keys of the MinHash
  signature (one 64-bit key per band), a one-permutation sketch of the shingle set (`sketches`),
  the keep-preference fields and the ids the duplicates map needs. A row of the key table is ~800
  bytes (512 of them the sketch); records and shingle sets are not kept.
- Exact (`exact_duplicates`): a group-by on (group, hash); the preferred record of each group is kept.
- Near (`near_duplicates_table`), among the records the exact stage kept: candidate pairs are
  records of the same group that share a band key, screened band by band (`screen_band`), bucket
  by bucket in batches of about SCREEN_ROWS rows (a larger bucket block by block). The screen
  (sketch_screen.py, compiled, ~10 ns a pair) keeps the pairs whose sketches may reach the
  threshold; a pair that shares several bands is screened in each (siblings at Jaccard ~0.7 share
  a given band with p ~ 0.06) and kept once. Only the kept pairs get their shingle sets re-computed (`shingles_of`,
  from the staged records, a bounded number of records at a time) for the true Jaccard. The keep
  choice walks the verified pairs in preference order: a record is dropped for the most similar
  better-ranked record that is itself kept (ties: the better-ranked), so a dropped record always
  points at a kept record with similarity >= the threshold (no chaining).

Memory is the key table plus, for the near stage, what a band step reads of the near table on
disk (`NearTable`: only the records that share a band key in their group): the band's keys and the
groups (~12 bytes a record), and the sketches of one batch of rows. Templated
trajectories make large buckets whose members are alike but below the threshold (siblings at
Jaccard ~0.7 give tens of millions of pairs per million records): the sketch screen is what keeps
them from being verified.

Band keys are a 64-bit hash of the band's values, where datasketch's MinHashLSH compares the bytes:
a collision only adds a candidate, which the screen and the Jaccard check then reject.
"""
from __future__ import annotations

import contextlib
import mmap
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trajforge.pipeline.quality.dedup import (
    DedupConfig,
    ShingleSets,
    dedup_tokens,
    exact_keys,
    hash_halves,
    permutations,
    signatures,
    word_shingle_hashes,
)
from trajforge.pipeline.stages import in_order
from trajforge.sources import keep_rank

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)

# One-permutation sketch (Li, Owen & Zhang 2012): each shingle's 64-bit hash picks one of
# SKETCH_BINS bins by its low bits; a bin keeps the smallest of its high 32 bits, stored as one byte
# (1..255; 0 is an empty bin). Two sets agree on a bin both fill with probability ~ their Jaccard;
# the one-byte cut only adds agreements (1 in 255), so the screen stays on the safe side.
SKETCH_BINS = 512
# A candidate whose sketch similarity falls below threshold - SKETCH_MARGIN is not verified. The
# estimate's standard deviation is <= sqrt(J(1-J)/512) = 0.016 at J = 0.85 for sets larger than
# the sketch, and smaller for smaller sets (nearly every shingle has a bin of its own): a pair at
# the threshold is screened out with a probability under 1e-6; siblings at 0.7 pass with ~1e-4.
SKETCH_MARGIN = 0.08
# Rows of the near table written through one mapping of its arrays (each row dirties a page: <= 32 MB).
NEAR_WRITE_ROWS = 8192
# Rows of a band's buckets screened at once, with their sketches in memory (512 bytes a row: 8 MB);
# a larger bucket is screened in blocks of half as many rows.
SCREEN_ROWS = 1 << 14
# Rows read through the near table's mappings before their pages are dropped (each read maps up to
# 64 KB of cached pages around it: <= 32 MB).
SKETCH_ROWS_MAPPED = 512
# Records whose shingle sets are held at once while verifying (a few KB to a few hundred KB each): a
# chunk is one call of its step, which the workers claim one at a time, so chunks are kept small for
# the last one not to run alone for long (at 10k records, a 1M build had 4 chunks on 2 workers, the
# last alone for 3.6 s of the step's 7.1).
VERIFY_BATCH = 2_500


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: a 64-bit FNV-1a-style hash of each band's `rows` signature values."""
    n = sigs.shape[0]
    values = sigs[:, :bands * rows].reshape(n, bands, rows).astype(np.uint64)
    keys = np.full((n, bands), _FNV_OFFSET, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(rows):
            keys ^= values[:, :, k]
            keys *= _FNV_PRIME
    return keys


def band_params(config: DedupConfig) -> tuple[int, int]:
    if config.bands is not None:
        return config.bands, config.rows
    from datasketch.lsh import _optimal_param

    return _optimal_param(config.threshold, config.num_perm, 0.5, 0.5)


def sketches(sizes: np.ndarray, hashed: np.ndarray) -> np.ndarray:
    """(n, SKETCH_BINS) uint8 one-permutation sketches of the sets whose `shingle_hashes` these are."""
    n = len(sizes)
    halves = hash_halves(hashed)
    # SKETCH_BINS is a power of two: the low bits by a mask, not a (slower) 64-bit modulo.
    cells = np.repeat(np.arange(0, n * SKETCH_BINS, SKETCH_BINS, dtype=np.intp), sizes)
    cells += halves[:, 0] & np.uint32(SKETCH_BINS - 1)
    smallest = np.full(n * SKETCH_BINS, np.iinfo(np.uint32).max, dtype=np.uint32)
    np.minimum.at(smallest, cells, halves[:, 1])
    out = (smallest % np.uint32(255) + 1).astype(np.uint8)
    out[smallest == np.iinfo(np.uint32).max] = 0
    return out.reshape(n, SKETCH_BINS)


def signatures_and_sketches(sets: ShingleSets, config: DedupConfig,
                            hashes: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(`signatures`, `sketches`) of sets whose `shingle_hashes` these are: for the numpy backend in
    one compiled pass (keys_kernel.py: the same bits, ~2.4x faster), else each as its backend
    computes it."""
    sizes, hashed = hashes
    if config.backend != "numpy" or not len(sizes):
        return signatures(sets, config, hashes), sketches(sizes, hashed)
    from trajforge.pipeline.quality.keys_kernel import signatures_and_sketches as compiled

    halves = hash_halves(hashed)
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    a, b = permutations(config.num_perm, config.seed)
    sigs, sketch = compiled(np.ascontiguousarray(halves[:, 1]), np.ascontiguousarray(halves[:, 0]), starts, a, b,
                            SKETCH_BINS)
    return sigs, sketch.reshape(-1)


def record_keys(records: Sequence[dict], staged: pa.Table, start_order: int,
                config: DedupConfig = DedupConfig()) -> pl.DataFrame:
    """The key table rows of `records`, whose build order starts at `start_order`; `staged`: the
    same records as the unit staged them (Arrow, the trajectory schema), from whose columns the
    rows are made (no Python object a record; the dicts serve only the texts the compiled join
    leaves to them: dedup.dedup_tokens)."""
    bands, rows = band_params(config)
    n = len(records)
    tokens = dedup_tokens(records, staged)
    groups = _groups(staged)
    hashes = word_shingle_hashes(tokens.words, tokens.word_bounds, config.shingle_size, config.seed)
    sigs, sketch = signatures_and_sketches(ShingleSets(tokens, config.shingle_size), config, hashes)
    keys = band_keys(sigs, bands, rows)
    columns = {
        "order": pl.Series(range(start_order, start_order + n), dtype=pl.Int64),
        "group": pl.Series(groups, dtype=pl.String),
        "exact": pl.Series(exact_keys(groups, tokens), dtype=pl.String),
        # The keep preference (dedup.py's docstring), as columns (smaller is kept).
        **_preference(staged),
        **{name: pl.Series(name, staged.column(name), dtype=pl.String) for name in ("id", "source", "source_id", "source_file")},
        **{f"band{b}": pl.Series(keys[:, b], dtype=pl.UInt64) for b in range(bands)},
        "sketch": pl.Series(pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(SKETCH_BINS), n, [None, pa.py_buffer(sketch)])).cast(pl.Binary),
    }
    return pl.DataFrame(columns)


def _preference(staged: pa.Table) -> dict[str, pl.Series]:
    """The keep-preference columns of staged records: upstream loss flags, the source's rank, the
    known outcome fields (answer, reward, success) negated."""
    source = staged.column("source")
    sources = pc.unique(source)
    ranks = np.array([int(keep_rank(name)) for name in sources.to_pylist()], dtype=np.int8)
    known = sum(staged.column(name).is_valid().to_numpy(zero_copy_only=False).astype(np.int8)
                for name in ("answer", "reward", "success"))
    return {
        "not_upstream": pl.Series(pc.not_equal(staged.column("loss_flags"), "upstream"), dtype=pl.Boolean),
        "source_rank": pl.Series(ranks[pc.index_in(source, value_set=sources).to_numpy()], dtype=pl.Int8),
        "unknown": pl.Series(-known, dtype=pl.Int8),
    }


def _groups(staged: pa.Table) -> list[str]:
    """The dedup group of each staged record: only records of the same group are compared, the
    same kind and negative type (`kind:negative_type`, empty without one)."""
    kind, negative = staged.column("kind"), pc.fill_null(staged.column("negative_type"), "")
    return pc.binary_join_element_wise(kind, negative, ":").to_pylist()


def band_columns(config: DedupConfig) -> list[str]:
    return [f"band{b}" for b in range(band_params(config)[0])]


def near_matrices(frame: pl.DataFrame, config: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """The band keys (n, bands) and sketches (n, SKETCH_BINS) of a key table's rows, as numpy."""
    bands = frame.select(band_columns(config)).to_numpy().astype(np.uint64, copy=False)
    sketch = np.frombuffer(b"".join(frame["sketch"].to_list()), dtype=np.uint8).reshape(frame.height, -1)
    return bands, sketch


# What the dedup stages read of the key table; the rest (ids, file names) only for the map's rows.
RANK_COLUMNS = ["order", "group", "exact", "not_upstream", "source_rank", "unknown", "unit", "row"]


def _ranked(keys: pl.DataFrame) -> pl.DataFrame:
    """The dedup columns of the key table with `pos`, the position in keep-preference order (0 is
    the most preferred)."""
    return (keys.select(RANK_COLUMNS).sort(["not_upstream", "source_rank", "unknown", "order"])
            .with_row_index("pos").with_columns(pl.col("pos").cast(pl.Int64)))


def exact_duplicates(ranked: pl.DataFrame) -> pl.DataFrame:
    """(pos, kept_pos) of every record whose (group, hash) a better-ranked record has."""
    # A window, not a group-by joined back: at 1M records ~2.5x less CPU, and no joined copy.
    return (ranked.select("pos", kept_pos=pl.col("pos").min().over("group", "exact"))
            .filter(pl.col("pos") != pl.col("kept_pos")).sort("pos"))


def _buckets(groups: np.ndarray, keys: np.ndarray) -> Iterator[np.ndarray]:
    """The rows (sorted) of each bucket of rows of the same group and key that holds more than one,
    in the order of their first rows. A sort (~30 bytes a row), not a group-by (polars': ~200)."""
    order = np.lexsort((keys, groups))  # stable: a bucket's rows stay in order
    sorted_keys, sorted_groups = keys[order], groups[order]
    starts = np.ones(len(order) + 1, dtype=bool)
    starts[1:-1] = (sorted_keys[1:] != sorted_keys[:-1]) | (sorted_groups[1:] != sorted_groups[:-1])
    del sorted_keys, sorted_groups
    bounds = np.flatnonzero(starts)
    first, end = bounds[:-1], bounds[1:]
    shared = end - first > 1
    first, end = first[shared], end[shared]
    by_first_row = np.argsort(order[first])
    for start, stop in zip(first[by_first_row].tolist(), end[by_first_row].tolist()):
        yield order[start:stop]


def resolve(pairs: Iterable[tuple[int, int, float]], threshold: float) -> dict[int, tuple[int, float]]:
    """Keep choice over verified pairs (a, b, similarity), a better-ranked than b.

    Walks the records in preference order: b is dropped for its most similar kept partner a with
    similarity >= threshold (ties: the smallest a). Returns {dropped pos: (kept pos, similarity)}.
    """
    partners: dict[int, list[tuple[int, float]]] = {}
    for a, b, sim in pairs:
        if sim >= threshold:
            partners.setdefault(b, []).append((a, sim))
    dropped: dict[int, tuple[int, float]] = {}
    for b in sorted(partners):
        best: tuple[int, float] | None = None
        for a, sim in sorted(partners[b]):
            if a not in dropped and (best is None or sim > best[1]):
                best = (a, sim)
        if best is not None:
            dropped[b] = best
    return dropped


def _npy_layout(file) -> tuple[tuple[int, ...], np.dtype, int]:
    """(shape, dtype, offset of the data) of the C-order .npy array in the open binary `file`."""
    header = {(1, 0): np.lib.format.read_array_header_1_0,
              (2, 0): np.lib.format.read_array_header_2_0}[np.lib.format.read_magic(file)]
    shape, _, dtype = header(file)
    return shape, dtype, file.tell()


@dataclass(frozen=True)
class BandKeys:
    """`[j]`: band j's keys of a NearTable's rows (a row of its bands x rows array), read into
    memory (8 bytes a row), not mapped."""
    path: str

    def __getitem__(self, band: int) -> np.ndarray:
        with open(self.path, "rb") as file:
            # After the header: `offset` counts from there.
            (_, rows), dtype, _ = _npy_layout(file)
            return np.fromfile(file, dtype=dtype, count=rows, offset=band * rows * dtype.itemsize)


@dataclass(frozen=True)
class NearTable:
    """The near stage's inputs on disk, in keep-preference order, for only the rows that share a
    band key with another row of their group (the others can be in no candidate pair: 84 % of the
    generated 20k corpus's rows): their row indices in the table they came from, group codes, band keys
    (bands x rows: a band's keys are contiguous) and sketches, as .npy files. Band steps in other
    processes or on cluster workers read them instead of receiving copies: the groups and one
    band's keys at a time, the sketch rows of one batch of buckets at a time."""
    folder: str

    def rows(self) -> np.ndarray:
        return np.load(Path(self.folder) / "rows.npy")

    def groups(self) -> np.ndarray:
        return np.load(Path(self.folder) / "groups.npy")

    @property
    def bands(self) -> BandKeys:
        return BandKeys(str(Path(self.folder) / "bands.npy"))

    def sketch_reader(self) -> Callable[[np.ndarray], np.ndarray]:
        """`words_of(rows)`: the sketches of `rows` as 64-bit words ((len(rows), SKETCH_BINS / 8)),
        read through one mapping of the file (unmapped with the reader) whose pages leave this
        process every SKETCH_ROWS_MAPPED rows (a read maps the cached pages around it too: kept
        mapped, the whole file would count in its memory)."""
        with open(Path(self.folder) / "sketch.npy", "rb") as file:
            shape, dtype, offset = _npy_layout(file)
            mapping = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        sketch = np.frombuffer(mapping, dtype=dtype, count=shape[0] * shape[1], offset=offset).reshape(shape)

        def words_of(rows: np.ndarray) -> np.ndarray:
            words = np.empty((len(rows), shape[1] // 8), dtype=np.uint64)
            for start in range(0, len(rows), SKETCH_ROWS_MAPPED):
                part = rows[start:start + SKETCH_ROWS_MAPPED]
                words[start:start + len(part)] = sketch[part].view(np.uint64)
                mapping.madvise(mmap.MADV_DONTNEED)
            return words

        return words_of


def _write_rows(path: Path, at, values: np.ndarray) -> None:
    """`values` into the rows `at` of the .npy array at `path`, through a mapping of their own: the
    pages a mapping dirties count in this process's memory until it is dropped (the page cache keeps them)."""
    target = np.load(path, mmap_mode="r+")
    target[at] = values
    del target


# An odd 64-bit constant (the golden ratio's): a group's code times it, mixed into a band key.
_GROUP_SALT = np.uint64(0x9E3779B97F4A7C15)


def _shares_a_band(groups: np.ndarray, keys: Callable[[int], np.ndarray], bands: int) -> np.ndarray:
    """Which rows have, in some band, the key of another row of their group (`keys(band)`: a band's
    keys of every row): a sort of each band's keys mixed with the group (~40 bytes a row at a time).
    A collision of the mix only keeps a row that could have gone (band_pairs compares the group and
    the key themselves).

    Only the rows whose mix shares its low bits, and then its high bits, with another row's are
    sorted (each told by a count of the rows in each of ~2n slots, `_in_shared_slots`): a row
    that shares its mix shares both, and the sort, 85 % of the check's CPU at 1M, sees a fraction
    of the rows."""
    shared = np.zeros(len(groups), dtype=bool)
    salt = groups.astype(np.uint64) * _GROUP_SALT
    bits = max(1, (2 * len(groups) - 1).bit_length())
    for band in range(bands):
        mixed = keys(band) ^ salt
        rows = np.flatnonzero(_in_shared_slots(mixed, bits, 0))
        ordered = mixed[rows]
        high = _in_shared_slots(ordered, bits, 64 - bits)
        rows, ordered = rows[high], ordered[high]
        order = np.argsort(ordered)
        ordered, rows = ordered[order], rows[order]
        same = ordered[1:] == ordered[:-1]
        shared[rows[1:][same]] = True
        shared[rows[:-1][same]] = True
    return shared


def _in_shared_slots(mixed: np.ndarray, bits: int, shift: int) -> np.ndarray:
    """Whether each value's `bits` bits from bit `shift` are another value's too (a count per slot)."""
    slot = ((mixed >> np.uint64(shift)) & np.uint64((1 << bits) - 1)).astype(np.intp)
    return np.bincount(slot, minlength=1 << bits)[slot] > 1


# `parts(name, wanted)`: the band keys ("bands": (k, bands) uint64) or the sketches ("sketch": (k,
# SKETCH_BINS) uint8) of a table's rows in parts, (row indices of the table, their values) each, of
# every row or only of the `wanted` ones (sorted row indices); read anew at each call.
NearParts = Callable[[str, np.ndarray | None], Iterable[tuple[np.ndarray, np.ndarray]]]


def parts_in_memory(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> NearParts:
    """The NearParts of (row indices, band keys (k, bands), sketches (k, SKETCH_BINS)) parts held in memory."""
    def column(name: str, wanted: np.ndarray | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for at, bands, sketch in parts:
            inside = np.isin(at, wanted) if wanted is not None else slice(None)
            yield at[inside], (sketch if name == "sketch" else bands)[inside]
    return column


def _every_band(path: Path, parts: NearParts, rows: int, bands: int) -> Callable[[int], np.ndarray]:
    """The band keys of every row written to `path` a band after the other (a part's keys of a band
    contiguous, in the parts' order: no write out of order); returns `keys(band)`, a band's keys of
    every row in the table's order, read back (8 bytes a row)."""
    found = []
    with open(path, "wb") as file:
        file.truncate(bands * rows * 8)
        start = 0
        for at, keys in parts("bands", None):
            for band in range(bands):
                file.seek((band * rows + start) * 8)
                file.write(np.ascontiguousarray(keys[:, band]).tobytes())
            found.append(at)
            start += len(at)
    at = np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def keys(band: int) -> np.ndarray:
        ordered = np.empty(rows, dtype=np.uint64)
        ordered[at] = np.fromfile(path, dtype=np.uint64, count=rows, offset=band * rows * 8)
        return ordered

    return keys


def write_near_table(folder: Path, table: pl.DataFrame, parts: NearParts, config: DedupConfig) -> NearTable:
    """The NearTable of `table`'s rows (in its order), from their band keys and sketches (`parts`):
    every row's band keys written a band after the other (no write out of order) to find the rows
    that share a band key in their group, then those rows' band keys, a band at a time, and their
    sketches (read for them only), a part at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    bands = band_params(config)[0]
    groups = table["group"].rank("dense").cast(pl.Int32).to_numpy()
    every = _every_band(folder / "every.bin", parts, table.height, bands)
    kept = np.flatnonzero(_shares_a_band(groups, every, bands))
    np.save(folder / "rows.npy", kept)
    np.save(folder / "groups.npy", groups[kept])
    np.lib.format.open_memmap(folder / "bands.npy", mode="w+", dtype=np.uint64, shape=(bands, len(kept))).flush()
    for band in range(bands):
        _write_rows(folder / "bands.npy", band, every(band)[kept])
    (folder / "every.bin").unlink()
    np.lib.format.open_memmap(folder / "sketch.npy", mode="w+", dtype=np.uint8, shape=(len(kept), SKETCH_BINS)).flush()
    for at, sketch in parts("sketch", kept):
        to = np.searchsorted(kept, at)
        for start in range(0, len(to), NEAR_WRITE_ROWS):
            _write_rows(folder / "sketch.npy", to[start:start + NEAR_WRITE_ROWS], sketch[start:start + NEAR_WRITE_ROWS])
    return NearTable(str(folder))


def _bucket_batches(buckets: Iterable[np.ndarray]) -> Iterator[list[np.ndarray]]:
    """The buckets in batches of about SCREEN_ROWS rows; a bucket larger than that alone."""
    batch: list[np.ndarray] = []
    held = 0
    for members in buckets:
        if held and held + len(members) > SCREEN_ROWS:
            yield batch
            batch, held = [], 0
        batch.append(members)
        held += len(members)
    if batch:
        yield batch


def _screen_batch(words_of, batch: list[np.ndarray], min_similarity: float) -> np.ndarray:
    """(m, 2) rows of the pairs of a batch of buckets that pass the screen."""
    from trajforge.pipeline.quality.sketch_screen import pairs_within

    members = np.concatenate(batch)
    bounds = np.cumsum([0] + [len(bucket) for bucket in batch])
    return members[pairs_within(words_of(members), bounds, min_similarity)]


def _screen_large_bucket(words_of, members: np.ndarray, min_similarity: float) -> Iterator[np.ndarray]:
    """The pairs of one bucket larger than SCREEN_ROWS that pass the screen, block against block."""
    from trajforge.pipeline.quality.sketch_screen import pairs_across, pairs_within

    blocks = [members[start:start + SCREEN_ROWS // 2] for start in range(0, len(members), SCREEN_ROWS // 2)]
    for at, left in enumerate(blocks):
        words = words_of(left)
        yield left[pairs_within(words, np.array([0, len(left)]), min_similarity)]
        for right in blocks[at + 1:]:
            local = pairs_across(words, words_of(right), min_similarity)
            yield np.stack([left[local[:, 0]], right[local[:, 1]]], axis=1)


def screen_band(table: NearTable, band: int, threshold: float) -> np.ndarray:
    """(m, 2) rows (of the table the NearTable came from), a < b, of the candidate pairs of one
    band (rows of the same group with the same key in it) whose sketches may reach the threshold."""
    words_of = table.sketch_reader()
    min_similarity = threshold - SKETCH_MARGIN
    kept = [np.empty((0, 2), dtype=np.int64)]
    for batch in _bucket_batches(_buckets(table.groups(), table.bands[band])):
        if len(batch[0]) > SCREEN_ROWS:
            kept.extend(_screen_large_bucket(words_of, batch[0], min_similarity))
        else:
            kept.append(_screen_batch(words_of, batch, min_similarity))
    return table.rows()[np.concatenate(kept)]


def verify_chunks(pairs: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The pairs in chunks of at most VERIFY_BATCH distinct records: (those records' rows, the
    chunk's pairs as indices into them)."""
    start = 0
    while start < len(pairs):
        members: set[int] = set()
        end = start
        while end < len(pairs) and len(members) < VERIFY_BATCH:
            members.update(pairs[end].tolist())
            end += 1
        rows = np.array(sorted(members), dtype=np.int64)
        yield rows, np.searchsorted(rows, pairs[start:end])
        start = end


def shingle_set_hashes(records: Sequence[dict], shingle_size: int) -> list[np.ndarray]:
    """Each record's shingle set as its sorted 64-bit hashes: a tenth of the memory of the
    strings, and the same Jaccard unless two of its shingles collide (~n^2 / 2^64)."""
    tokens = dedup_tokens(records)
    sizes, hashed = word_shingle_hashes(tokens.words, tokens.word_bounds, shingle_size, seed=0)
    return [np.unique(part) for part in np.split(hashed, np.cumsum(sizes)[:-1])]


def hashed_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    common = np.intersect1d(a, b, assume_unique=True).size
    return common / (a.size + b.size - common)


def chunk_similarities(records, refs: list[tuple[int, int]], pairs: np.ndarray, shingle_size: int) -> list[float]:
    """True Jaccard of each pair (indices into `refs`) of the records at `refs`, (unit, row) each;
    `records.shingle_sets(refs, shingle_size)` gives their `shingle_set_hashes`."""
    sets = records.shingle_sets(refs, shingle_size)
    return [hashed_jaccard(sets[a], sets[b]) for a, b in pairs.tolist()]


def screened_pairs(table: NearTable, config: DedupConfig, map_units=in_order) -> np.ndarray:
    """(m, 2) rows (a, b) of the distinct candidate pairs of every band that pass the screen, by b
    then a; the band steps go through `map_units`."""
    steps = [(table, band, config.threshold) for band in range(band_params(config)[0])]
    # A pair that shares several bands came from each of them. Each pair as one integer, b above a
    # (rows are below 2**31): the distinct ones sorted by b then a, at a quarter of the CPU of
    # distinct rows of the (m, 2) array and their sort.
    pairs = np.concatenate(map_units(screen_band, steps))
    codes = np.unique(pairs[:, 1] << 32 | pairs[:, 0])
    return np.stack([codes & 0xFFFFFFFF, codes >> 32], axis=1)


def near_duplicates_table(unique: pl.DataFrame, table: NearTable, records, config: DedupConfig,
                          map_units=in_order) -> dict[int, tuple[int, float]]:
    """Near duplicates among `unique` (the records the exact stage kept, sorted by `pos`, with
    `unit` and `row`; `table` holds their near-stage rows in that order): {pos: (kept pos, Jaccard)}.

    The band screens and the verification chunks go through `map_units` (one step per band, one
    per chunk); `records` (picklable) reads shingle sets where a chunk runs.
    """
    if len(table.rows()) < 2:
        return {}
    pairs = screened_pairs(table, config, map_units)
    units, unit_rows = unique["unit"].to_numpy(), unique["row"].to_numpy()
    chunks = list(verify_chunks(pairs))
    similarities = map_units(chunk_similarities, [(records, list(zip(units[rows].tolist(), unit_rows[rows].tolist())),
                                                   local, config.shingle_size) for rows, local in chunks],
                            [len(rows) for rows, _ in chunks])
    verified = ((int(rows[a]), int(rows[b]), sim) for (rows, local), sims in zip(chunks, similarities)
                for (a, b), sim in zip(local.tolist(), sims))
    positions = unique["pos"].to_numpy()
    found = resolve(verified, config.threshold)
    return {int(positions[b]): (int(positions[a]), sim) for b, (a, sim) in found.items()}


# The duplicates map's columns (schemas/duplicates.schema.json) with the build `order` of the
# dropped and of the kept record.
DUPLICATE_COLUMNS = {"id": pl.String, "source": pl.String, "source_id": pl.String, "source_file": pl.String,
                     "kept_id": pl.String, "kept_source": pl.String, "match": pl.String, "similarity": pl.Float64,
                     "order": pl.Int64, "kept_order": pl.Int64}


def duplicates_table(keys: pl.DataFrame, records, config: DedupConfig = DedupConfig(), map_units=in_order,
                     workdir: Path | None = None) -> pl.DataFrame:
    """The duplicates map of the key table (with `unit` and `row`): a frame of DUPLICATE_COLUMNS,
    in build order of the dropped records.

    `records` gives what the key table leaves out: `near_parts(table)`, the band keys and sketches
    of a table's rows in parts (`NearParts`), `key_columns(table, columns)`, the `id`
    and `source_id` of a table's rows, and `shingle_sets(refs, size)`. The near
    stage's arrays go to `workdir` (default: a temporary folder)."""
    ranked = _ranked(keys)
    exact = exact_duplicates(ranked)
    # What the near stage and the map's rows read: the exact hash (16 bytes a record) and the keep
    # preference are not held through the near stage.
    ranked = ranked.select("pos", "order", "group", "unit", "row")
    found = [exact.select("pos", "kept_pos", match=pl.lit("exact"), similarity=pl.lit(1.0))]
    if config.near:
        # The near stage runs after the exact one, which left no exact pair: no copy of the table then.
        unique = ranked.filter(~pl.col("pos").is_in(exact["pos"].implode())) if exact.height else ranked
        with _scratch(workdir) as folder:
            table = write_near_table(folder, unique, records.near_parts(unique), config)
            near = near_duplicates_table(unique, table, records, config, map_units)
        found.append(pl.DataFrame({"pos": list(near), "kept_pos": [kept for kept, _ in near.values()],
                                   "match": "near", "similarity": [round(sim, 4) for _, sim in near.values()]},
                                  schema={"pos": pl.Int64, "kept_pos": pl.Int64, "match": pl.String, "similarity": pl.Float64}))
    pairs = pl.concat(found)
    if pairs.is_empty():
        return pl.DataFrame(schema=DUPLICATE_COLUMNS)
    # A frame, not a dict a row: at 1M (~110k duplicates) the rows and their records as dicts took
    # ~250 MB of the flow's memory.
    involved = (ranked.filter(pl.col("pos").is_in(pl.concat([pairs["pos"], pairs["kept_pos"]]).unique().implode()))
                .select("pos", "order", "unit", "row").join(keys.select("order", "source", "source_file"), on="order"))
    info = (involved.with_columns(records.key_columns(involved, ["id", "source_id"]))
            .select("pos", "order", "id", pl.col("source", "source_file").cast(pl.String), "source_id"))
    kept = info.select(kept_pos="pos", kept_id="id", kept_source="source", kept_order="order")
    return (pairs.join(info, on="pos").join(kept, on="kept_pos")
            .select(*DUPLICATE_COLUMNS).cast(DUPLICATE_COLUMNS).sort("order"))


@contextlib.contextmanager
def _scratch(workdir: Path | None) -> Iterator[Path]:
    """`workdir`/near, emptied first (a killed run's arrays go) and removed after; else a temp folder."""
    if workdir is None:
        with tempfile.TemporaryDirectory() as folder:
            yield Path(folder)
        return
    folder = workdir / "near"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
