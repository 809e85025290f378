"""Deduplication as group-bys over a compact key table, never over all records at once.

The same decisions as `dedup.deduplicate` (same text, same signatures, same keep preference, same
verification by the true shingle Jaccard), split so that it scales:

- Map, per batch of records (`record_keys`): the exact hash, the LSH band keys of the MinHash
  signature (one 64-bit key per band), a one-permutation sketch of the shingle set (`sketches`),
  the keep-preference fields and the ids the duplicates map needs. A row of the key table is ~800
  bytes (512 of them the sketch); records and shingle sets are not kept.
- Exact (`exact_duplicates`): a group-by on (group, hash); the preferred record of each group is kept.
- Near (`near_duplicates_table`), among the records the exact stage kept: candidate pairs are
  records of the same group that share a band key, made band by band and bucket by bucket in
  batches of at most `PAIR_BATCH` pairs (`candidate_pairs`), each pair once (in the first band it
  shares). Each batch is screened by the sketches (numpy, `sketch_similarity`): only pairs that
  may reach the threshold get their shingle sets re-computed (`shingles_of`, from the staged
  records, a bounded number of records at a time) for the true Jaccard. The keep choice walks the
  verified pairs in preference order: a record is dropped for the most similar better-ranked
  record that is itself kept (ties: the better-ranked), so a dropped record always points at a
  kept record with similarity >= the threshold (no chaining).

Memory is the key table plus, for the near stage, the band keys and sketches of its records as
numpy matrices (~640 bytes a record) and one batch of pairs. Templated trajectories make large
buckets whose members are alike but below the threshold (siblings at Jaccard ~0.7 give tens of
millions of pairs per million records): the sketch screen is what keeps them from being verified.

Band keys are a 64-bit hash of the band's values, where datasketch's MinHashLSH compares the bytes:
a collision only adds a candidate, which the screen and the Jaccard check then reject.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import numpy as np
import polars as pl

from trajforge.pipeline.quality.dedup import (DedupConfig, dedup_tokens, exact_key, jaccard, shingle_hashes,
                                              shingles, signatures)
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
# Candidate pairs screened at once (two int64 indices and 2 x 512 sketch bytes each, in chunks).
PAIR_BATCH = 1 << 21
# Records whose shingle sets are held at once while verifying.
VERIFY_BATCH = 20_000


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
    cells = np.repeat(np.arange(n, dtype=np.int64), sizes) * SKETCH_BINS + (
        hashed % np.uint64(SKETCH_BINS)).astype(np.int64)
    smallest = np.full(n * SKETCH_BINS, np.iinfo(np.uint32).max, dtype=np.uint32)
    np.minimum.at(smallest, cells, (hashed >> np.uint64(32)).astype(np.uint32))
    out = (smallest % np.uint32(255) + 1).astype(np.uint8)
    out[smallest == np.iinfo(np.uint32).max] = 0
    return out.reshape(n, SKETCH_BINS)


def sketch_similarity(sketch: np.ndarray, a: np.ndarray, b: np.ndarray, chunk: int = 1 << 13) -> np.ndarray:
    """Estimated Jaccard of rows a[i] and b[i]: agreeing bins among those either set fills."""
    out = np.empty(len(a), dtype=np.float64)
    for start in range(0, len(a), chunk):
        left, right = sketch[a[start:start + chunk]], sketch[b[start:start + chunk]]
        same = left == right
        both_empty = (same & (left == 0)).sum(axis=1)
        out[start:start + chunk] = (same.sum(axis=1) - both_empty) / np.maximum(1, sketch.shape[1] - both_empty)
    return out


def record_keys(records: Sequence[dict], start_order: int, config: DedupConfig = DedupConfig()) -> pl.DataFrame:
    """The key table rows of `records`, whose build order starts at `start_order`."""
    bands, rows = band_params(config)
    n = len(records)
    sets = [shingles(dedup_tokens(r), config.shingle_size) for r in records]
    hashes = shingle_hashes(sets, config.seed)
    keys = band_keys(signatures(sets, config, hashes), bands, rows)
    columns = {
        "order": pl.Series(range(start_order, start_order + n), dtype=pl.Int64),
        "group": pl.Series([f"{r['kind']}:{r['negative_type'] or ''}" for r in records], dtype=pl.String),
        "exact": pl.Series([exact_key(r) for r in records], dtype=pl.String),
        # The keep preference of dedup.keep_rank, as columns (smaller is kept).
        "not_upstream": pl.Series([r["loss_flags"] != "upstream" for r in records], dtype=pl.Boolean),
        "source_rank": pl.Series([int(keep_rank(r["source"])) for r in records], dtype=pl.Int8),
        "unknown": pl.Series([-sum(r[k] is not None for k in ("answer", "reward", "success")) for r in records],
                             dtype=pl.Int8),
        **{name: pl.Series([r[name] for r in records], dtype=pl.String)
           for name in ("id", "source", "source_id", "source_file")},
        **{f"band{b}": pl.Series(keys[:, b], dtype=pl.UInt64) for b in range(bands)},
        "sketch": pl.Series([row.tobytes() for row in sketches(*hashes)], dtype=pl.Binary),
    }
    return pl.DataFrame(columns)


def band_columns(config: DedupConfig) -> list[str]:
    return [f"band{b}" for b in range(band_params(config)[0])]


def near_matrices(frame: pl.DataFrame, config: DedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """The band keys (n, bands) and sketches (n, SKETCH_BINS) of a key table's rows, as numpy."""
    bands = frame.select(band_columns(config)).to_numpy().astype(np.uint64, copy=False)
    sketch = np.frombuffer(b"".join(frame["sketch"].to_list()), dtype=np.uint8).reshape(frame.height, -1)
    return bands, sketch


def _ranked(keys: pl.DataFrame) -> pl.DataFrame:
    """The key table with `pos`, the position in keep-preference order (0 is the most preferred)."""
    return (keys.sort(["not_upstream", "source_rank", "unknown", "order"])
            .with_row_index("pos").with_columns(pl.col("pos").cast(pl.Int64)))


def exact_duplicates(ranked: pl.DataFrame) -> pl.DataFrame:
    """(pos, kept_pos) of every record whose (group, hash) a better-ranked record has."""
    kept = ranked.group_by(["group", "exact"]).agg(pl.col("pos").min().alias("kept_pos"))
    return (ranked.select("pos", "group", "exact").join(kept, on=["group", "exact"])
            .filter(pl.col("pos") != pl.col("kept_pos")).select("pos", "kept_pos").sort("pos"))


def _bucket_pairs(members: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every (a, b), a < b, of one bucket's sorted members; a large bucket in blocks of rows of
    about PAIR_BATCH pairs each."""
    size = len(members)
    rows = max(1, PAIR_BATCH // size)
    for top in range(0, size - 1, rows):
        block = np.arange(top, min(top + rows, size - 1))
        counts = size - 1 - block
        starts = np.cumsum(counts) - counts
        left = np.repeat(block, counts)
        right = np.repeat(block + 1, counts) + np.arange(int(counts.sum())) - np.repeat(starts, counts)
        yield members[left], members[right]


def _first_shared_band(bands: np.ndarray, band: int, a: np.ndarray, b: np.ndarray,
                       chunk: int = 1 << 13) -> np.ndarray:
    """Which pairs share no band before `band` (so `band` is the first they share)."""
    first = np.ones(len(a), dtype=bool)
    for start in range(0, len(a) if band else 0, chunk):
        end = start + chunk
        first[start:end] = ~(bands[a[start:end], :band] == bands[b[start:end], :band]).any(axis=1)
    return first


def candidate_pairs(groups: np.ndarray, bands: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches of (a, b) row indices, a < b, of rows of the same group that share a band key.

    A pair sharing several bands comes once, from the first band it shares. Batches hold at most
    about PAIR_BATCH pairs (a bucket larger than that comes in blocks of rows)."""
    n = len(groups)
    for band in range(bands.shape[1]):
        buckets = (pl.DataFrame({"row": np.arange(n, dtype=np.int64), "group": groups, "key": bands[:, band]})
                   .filter(pl.len().over(["group", "key"]) > 1)
                   .group_by(["group", "key"]).agg(pl.col("row").sort())
                   .sort(pl.col("row").list.first())["row"])
        pending: list[tuple[np.ndarray, np.ndarray]] = []
        held = 0
        for members in buckets:
            for a, b in _bucket_pairs(members.to_numpy()):
                pending.append((a, b))
                held += len(a)
                if held >= PAIR_BATCH:
                    a, b = np.concatenate([p[0] for p in pending]), np.concatenate([p[1] for p in pending])
                    first = _first_shared_band(bands, band, a, b)
                    yield a[first], b[first]
                    pending, held = [], 0
        if pending:
            a, b = np.concatenate([p[0] for p in pending]), np.concatenate([p[1] for p in pending])
            first = _first_shared_band(bands, band, a, b)
            yield a[first], b[first]


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


def screened_pairs(groups: np.ndarray, bands: np.ndarray, sketch: np.ndarray,
                   config: DedupConfig) -> np.ndarray:
    """(m, 2) row indices of the candidate pairs whose sketches may reach the threshold, sorted."""
    kept = []
    for a, b in candidate_pairs(groups, bands):
        likely = sketch_similarity(sketch, a, b) >= config.threshold - SKETCH_MARGIN
        kept.append(np.stack([a[likely], b[likely]], axis=1))
    if not kept:
        return np.empty((0, 2), dtype=np.int64)
    pairs = np.concatenate(kept)
    return pairs[np.lexsort((pairs[:, 0], pairs[:, 1]))]


def verified_pairs(pairs: np.ndarray, orders: np.ndarray,
                   shingles_of: Callable[[list[int]], dict[int, set[str]]]) -> Iterator[tuple[int, int, float]]:
    """(a, b, true Jaccard) of each pair of rows, the shingle sets of at most VERIFY_BATCH records at a time."""
    start = 0
    while start < len(pairs):
        members: set[int] = set()
        end = start
        while end < len(pairs) and len(members) < VERIFY_BATCH:
            members.update(pairs[end].tolist())
            end += 1
        sets = shingles_of(sorted(int(orders[m]) for m in members))
        for a, b in pairs[start:end].tolist():
            yield a, b, jaccard(sets[int(orders[a])], sets[int(orders[b])])
        start = end


def near_duplicates_table(unique: pl.DataFrame, bands: np.ndarray, sketch: np.ndarray,
                          shingles_of: Callable[[list[int]], dict[int, set[str]]],
                          config: DedupConfig) -> dict[int, tuple[int, float]]:
    """Near duplicates among `unique` (the records the exact stage kept, sorted by `pos`; `bands`
    and `sketch` are their rows in that order): {pos: (kept pos, Jaccard)}.

    `shingles_of(orders)` gives the shingle sets of the records with these build orders.
    """
    if unique.height < 2:
        return {}
    groups = unique["group"].rank("dense").cast(pl.Int32).to_numpy()
    pairs = screened_pairs(groups, bands, sketch, config)
    positions = unique["pos"].to_numpy()
    found = resolve(verified_pairs(pairs, unique["order"].to_numpy(), shingles_of), config.threshold)
    return {int(positions[b]): (int(positions[a]), sim) for b, (a, sim) in found.items()}


def duplicates_table(keys: pl.DataFrame, shingles_of: Callable[[list[int]], dict[int, set[str]]],
                     config: DedupConfig = DedupConfig(),
                     near_rows: Callable[[pl.DataFrame], tuple[np.ndarray, np.ndarray]] | None = None) -> list[dict]:
    """The duplicates map (schemas/duplicates.schema.json) of the key table, in build order of the
    dropped records; each row also has the build `order` of the dropped and of the kept record.

    `near_rows(table)` gives the band keys and sketches of the table's rows, in its order; by
    default they are the key table's own columns (a caller with a narrow key table loads them)."""
    ranked = _ranked(keys)
    exact = exact_duplicates(ranked)
    found = {pos: (kept, "exact", 1.0) for pos, kept in exact.iter_rows()}
    if config.near:
        unique = ranked.filter(~pl.col("pos").is_in(exact["pos"].implode()))
        bands, sketch = near_rows(unique) if near_rows else near_matrices(unique, config)
        found.update({pos: (kept, "near", sim) for pos, (kept, sim) in
                      near_duplicates_table(unique, bands, sketch, shingles_of, config).items()})
    if not found:
        return []
    info = ranked.filter(pl.col("pos").is_in(list({p for pos, (k, _, _) in found.items() for p in (pos, k)})))
    by_pos = {row["pos"]: row for row in info.select("pos", "order", "id", "source", "source_id",
                                                     "source_file").iter_rows(named=True)}
    rows = []
    for pos, (kept, match, sim) in found.items():
        r, k = by_pos[pos], by_pos[kept]
        rows.append({"id": r["id"], "source": r["source"], "source_id": r["source_id"],
                     "source_file": r["source_file"], "kept_id": k["id"], "kept_source": k["source"],
                     "match": match, "similarity": round(sim, 4), "order": r["order"], "kept_order": k["order"]})
    return sorted(rows, key=lambda row: row["order"])


def deduplicate_in_memory(records: list[dict], config: DedupConfig = DedupConfig(),
                          batch: int = 4096) -> tuple[list[dict], list[dict]]:
    """`dedup.deduplicate` through the key table: (kept records in build order, duplicates map)."""
    keys = pl.concat([record_keys(records[i:i + batch], i, config) for i in range(0, max(1, len(records)), batch)])

    def shingles_of(orders: list[int]) -> dict[int, set[str]]:
        return {o: shingles(dedup_tokens(records[o]), config.shingle_size) for o in orders}

    rows = duplicates_table(keys, shingles_of, config)
    dropped = {row["order"] for row in rows}
    kept = [r for i, r in enumerate(records) if i not in dropped]
    return kept, [{k: v for k, v in row.items() if k not in ("order", "kept_order")} for row in rows]
