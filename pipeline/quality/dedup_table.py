"""Deduplication as group-bys over a compact key table, never over all records at once.

The same decisions as `dedup.deduplicate` (same text, same signatures, same keep preference, same
verification by the true shingle Jaccard), split so that it scales:

- Map, per batch of records (`record_keys`): the exact hash, the MinHash signature and its LSH band
  keys (one 64-bit key per band), the keep-preference fields and the ids the duplicates map needs.
  A row of the key table is ~800 bytes (512 of them the signature); records and shingle sets are
  not kept.
- Exact (`exact_duplicates`): a group-by on (group, hash); the preferred record of each group is kept.
- Near (`near_duplicates_table`): candidate pairs are records of the same group that share a band
  key (a polars self-join per band), among the records the exact stage kept. Pairs whose signatures
  agree far below the threshold are dropped (numpy, `plausible`); for the rest only their shingle sets
  are re-computed (`shingles_of`, from the staged records) to get the true Jaccard, and the keep
  choice walks the verified pairs in preference order: a record is dropped for the most similar
  better-ranked record that is itself kept (ties: the better-ranked), so a dropped record always
  points at a kept record with similarity >= the threshold (no chaining).

Band keys are a 64-bit hash of the band's values, where datasketch's MinHashLSH compares the bytes:
a collision only adds a candidate, which the Jaccard check then rejects.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np
import polars as pl

from trajforge.pipeline.quality.dedup import (DedupConfig, dedup_tokens, exact_key, jaccard, shingles,
                                              signatures)
from trajforge.sources import keep_rank

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


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


def record_keys(records: Sequence[dict], start_order: int, config: DedupConfig = DedupConfig()) -> pl.DataFrame:
    """The key table rows of `records`, whose build order starts at `start_order`."""
    bands, rows = band_params(config)
    n = len(records)
    sets = [shingles(dedup_tokens(r), config.shingle_size) for r in records]
    sigs = signatures(sets, config)
    keys = band_keys(sigs, bands, rows)
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
        # The whole signature, for a cheap first check of candidate pairs.
        "signature": pl.Series([row.tobytes() for row in sigs], dtype=pl.Binary),
    }
    return pl.DataFrame(columns)


def _ranked(keys: pl.DataFrame) -> pl.DataFrame:
    """The key table with `pos`, the position in keep-preference order (0 is the most preferred)."""
    return (keys.sort(["not_upstream", "source_rank", "unknown", "order"])
            .with_row_index("pos").with_columns(pl.col("pos").cast(pl.Int64)))


def exact_duplicates(ranked: pl.DataFrame) -> pl.DataFrame:
    """(pos, kept_pos) of every record whose (group, hash) a better-ranked record has."""
    kept = ranked.group_by(["group", "exact"]).agg(pl.col("pos").min().alias("kept_pos"))
    return (ranked.select("pos", "group", "exact").join(kept, on=["group", "exact"])
            .filter(pl.col("pos") != pl.col("kept_pos")).select("pos", "kept_pos").sort("pos"))


def candidate_pairs(ranked: pl.DataFrame, bands: int) -> pl.DataFrame:
    """(a, b) positions, a < b, of records of the same group that share at least one band key."""
    pairs = []
    for b in range(bands):
        side = ranked.select("pos", "group", pl.col(f"band{b}").alias("key"))
        # Only keys held by two or more records can make a pair: the self-join stays small.
        shared = side.filter(pl.len().over(["group", "key"]) > 1)
        pairs.append(shared.join(shared, on=["group", "key"], suffix="_b")
                     .filter(pl.col("pos") < pl.col("pos_b"))
                     .select(pl.col("pos").alias("a"), pl.col("pos_b").alias("b")))
    if not pairs:
        return pl.DataFrame({"a": [], "b": []}, schema={"a": pl.Int64, "b": pl.Int64})
    return pl.concat(pairs).unique().sort(["b", "a"])


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


# Candidates whose signature agreement (an estimate of their Jaccard, standard deviation <= 0.045 at
# 128 permutations) falls this far below the threshold are not re-read: a pair at the threshold
# estimates that low with a probability under 1e-6.
SIGNATURE_MARGIN = 0.25


def plausible(pairs: pl.DataFrame, ranked: pl.DataFrame, config: DedupConfig) -> pl.DataFrame:
    """The candidate pairs whose MinHash signatures agree on >= threshold - SIGNATURE_MARGIN of
    their values (vectorized); only those get the true Jaccard."""
    members = pl.concat([pairs["a"], pairs["b"]]).unique().sort()
    rows = ranked.filter(pl.col("pos").is_in(members.implode())).select("pos", "signature").sort("pos")
    sigs = np.frombuffer(b"".join(rows["signature"].to_list()), dtype=np.uint32).reshape(rows.height, -1)
    index = {pos: i for i, pos in enumerate(rows["pos"].to_list())}
    a = np.fromiter((index[p] for p in pairs["a"].to_list()), dtype=np.int64, count=pairs.height)
    b = np.fromiter((index[p] for p in pairs["b"].to_list()), dtype=np.int64, count=pairs.height)
    agree = np.empty(pairs.height, dtype=np.float64)
    for start in range(0, pairs.height, 1 << 16):
        end = start + (1 << 16)
        agree[start:end] = (sigs[a[start:end]] == sigs[b[start:end]]).mean(axis=1)
    return pairs.filter(pl.Series(agree >= config.threshold - SIGNATURE_MARGIN))


def near_duplicates_table(ranked: pl.DataFrame, shingles_of: Callable[[list[int]], dict[int, set[str]]],
                          config: DedupConfig) -> dict[int, tuple[int, float]]:
    """Near duplicates among `ranked` (the records the exact stage kept): {pos: (kept pos, Jaccard)}.

    `shingles_of(orders)` gives the shingle sets of the records with these build orders.
    """
    bands, _ = band_params(config)
    pairs = candidate_pairs(ranked, bands)
    if pairs.is_empty():
        return {}
    pairs = plausible(pairs, ranked, config)
    if pairs.is_empty():
        return {}
    members = pl.concat([pairs["a"], pairs["b"]]).unique().to_list()
    order_of = dict(ranked.filter(pl.col("pos").is_in(members)).select("pos", "order").iter_rows())
    sets = shingles_of(sorted(order_of.values()))
    verified = ((a, b, jaccard(sets[order_of[a]], sets[order_of[b]])) for a, b in pairs.iter_rows())
    return resolve(verified, config.threshold)


def duplicates_table(keys: pl.DataFrame, shingles_of: Callable[[list[int]], dict[int, set[str]]],
                     config: DedupConfig = DedupConfig()) -> list[dict]:
    """The duplicates map (schemas/duplicates.schema.json) of the key table, in build order of the
    dropped records; each row also has the build `order` of the dropped and of the kept record."""
    ranked = _ranked(keys)
    exact = exact_duplicates(ranked)
    found = {pos: (kept, "exact", 1.0) for pos, kept in exact.iter_rows()}
    if config.near:
        unique = ranked.filter(~pl.col("pos").is_in(exact["pos"].implode()))
        found.update({pos: (kept, "near", sim) for pos, (kept, sim) in
                      near_duplicates_table(unique, shingles_of, config).items()})
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
