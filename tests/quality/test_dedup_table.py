"""The columnar dedup (key table, band group-by, verification, keep choice) and the negative pools:
the same decisions as the in-memory dedup and the full-scan pools on the real fixtures, and the
rules themselves on small hand-made cases."""
from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from tests.support.oracles import (
    band_pairs,
    deduplicate,
    deduplicate_in_memory,
    jaccard,
    key_columns_of_dicts,
    make_negatives,
    sketch_similarity,
    staged_keys,
)
from trajforge.pipeline.quality import dedup, dedup_table
from trajforge.pipeline.quality.dedup import DedupConfig, dedup_texts, shingles
from trajforge.pipeline.quality.dedup_table import (
    band_keys,
    near_matrices,
    parts_in_memory,
    record_keys,
    resolve,
    screen_band,
    verify_chunks,
    write_near_table,
)
from trajforge.pipeline.quality.negatives import NEGATIVE_TYPES, NegativesConfig
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.pipeline.quality.sketch_screen import pairs_across, pairs_within
from trajforge.schemas import arrow_schema


@pytest.mark.parametrize("threshold", [0.85, 0.6, 0.4])
def test_same_duplicate_map_as_the_in_memory_dedup_on_the_fixtures(merged, threshold):
    config = DedupConfig(threshold=threshold)
    kept, dups = deduplicate(merged, config)
    kept_table, dups_table = deduplicate_in_memory(merged, config, batch=50)
    assert dups, "the fixtures hold known duplicates"
    assert dups_table == dups
    assert [r["id"] for r in kept_table] == [r["id"] for r in kept]


def test_batching_does_not_change_the_keys(merged):
    whole = staged_keys(merged, 0)
    parts = pl.concat([staged_keys(merged[i:i + 7], i) for i in range(0, len(merged), 7)])
    assert whole.equals(parts)


@pytest.mark.parametrize("compiled_from", [0, 1 << 62], ids=["compiled", "numpy"])
def test_keys_of_staged_records_are_those_of_their_dicts(merged, monkeypatch, compiled_from):
    """The key rows made from the staged records' Arrow columns (the texts joined from its buffers,
    the group, the keep preference, the ids) are those the dicts give, over several record batches
    too."""
    monkeypatch.setattr(dedup, "COMPILED_TOKENS_FROM", compiled_from)
    schema = arrow_schema("trajectory")
    half = len(merged) // 2
    staged = pa.concat_tables([pa.Table.from_pylist(merged[:half], schema=schema),
                               pa.Table.from_pylist(merged[half:], schema=schema)])
    keys = record_keys(merged, staged, 3)
    assert keys.equals(staged_keys(merged, 3))
    expected = key_columns_of_dicts(merged)
    assert keys.select(expected.columns).equals(expected)
    assert len(set(expected["source_rank"])) > 1 and len(set(expected["unknown"])) > 1 and any(expected["not_upstream"])
    assert record_keys([], schema.empty_table(), 0).columns == keys.columns


def test_band_keys_equal_exactly_when_the_band_values_do():
    sigs = np.array([[1, 2, 3, 4], [1, 2, 9, 9], [9, 9, 3, 4], [2, 1, 4, 3]], dtype=np.uint32)
    keys = band_keys(sigs, bands=2, rows=2)
    assert keys.shape == (4, 2) and keys.dtype == np.uint64
    assert keys[0, 0] == keys[1, 0] and keys[0, 1] == keys[2, 1]
    assert keys[0, 0] != keys[2, 0] and keys[0, 1] != keys[1, 1]
    # Order inside a band matters: (1, 2) is not (2, 1).
    assert keys[3, 0] != keys[0, 0] and keys[3, 1] != keys[0, 1]


def _screened(folder, groups, bands, sketch, threshold: float) -> list[list[tuple[int, int]]]:
    """Each band step's pairs, (rows, bands) keys, through a near table."""
    config = DedupConfig(bands=bands.shape[1], rows=1)
    parts = [(np.arange(len(groups)), bands, sketch)]
    table = write_near_table(folder, pl.DataFrame({"group": [f"g{g}" for g in groups]}), parts_in_memory(parts), config)
    return [sorted(map(tuple, screen_band(table, band, threshold).tolist())) for band in range(bands.shape[1])]


def _every_pair(folder, groups, bands) -> list[list[tuple[int, int]]]:
    """The candidate pairs of each band: at threshold = SKETCH_MARGIN the screen keeps every pair."""
    bands = np.array(bands, dtype=np.uint64)
    sketch = np.zeros((len(groups), dedup_table.SKETCH_BINS), dtype=np.uint8)
    return _screened(folder, groups, bands, sketch, dedup_table.SKETCH_MARGIN)


def test_band_grouping_pairs_records_that_share_a_band_within_a_group(tmp_path):
    pairs = _every_pair(tmp_path / "near", [0, 0, 0, 1, 0], [[1, 2], [1, 2], [5, 2], [1, 2], [7, 8]])
    # 0-1 share both bands (the near stage keeps the pair once); 3 has the same keys in another group; 4 shares nothing.
    assert pairs == [[(0, 1)], [(0, 1), (0, 2), (1, 2)]]


def test_a_bucket_larger_than_a_batch_is_screened_in_blocks_with_every_pair_once(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup_table, "SCREEN_ROWS", 8)
    pairs = _every_pair(tmp_path / "near", [0] * 40 + [1] * 3, [[7]] * 43)
    assert pairs == [[(a, b) for a in range(40) for b in range(a + 1, 40)] + [(40, 41), (40, 42), (41, 42)]]


def test_the_near_table_keeps_the_rows_that_share_a_band_and_screens_as_the_whole_arrays(tmp_path, monkeypatch):
    """Written in scattered parts and read in small chunks, the near table gives each band step the
    pairs the whole in-memory arrays give, as rows of the table it came from; it holds only the rows
    that share some band key with a row of their group."""
    for name, value in [("NEAR_WRITE_ROWS", 4), ("SCREEN_ROWS", 6), ("SKETCH_ROWS_MAPPED", 3)]:
        monkeypatch.setattr(dedup_table, name, value)
    rng = np.random.default_rng(3)
    config = DedupConfig(bands=3, rows=2)
    n = 60
    groups = rng.integers(0, 3, n)
    bands = rng.integers(0, 12, (n, 3)).astype(np.uint64) + np.arange(3, dtype=np.uint64) * 1000
    bands[::4] += np.uint64(100)  # a quarter keep to themselves (keys no other row has) in some band
    bands[5::7] = np.arange(100_000, 100_000 + 3 * len(bands[5::7]), dtype=np.uint64).reshape(-1, 3)
    sketch = rng.integers(0, 4, (n, dedup_table.SKETCH_BINS)).astype(np.uint8)
    order = rng.permutation(n)
    parts = [(order[:25], bands[order[:25]], sketch[order[:25]]), (order[25:], bands[order[25:]], sketch[order[25:]])]
    table = write_near_table(tmp_path / "near", pl.DataFrame({"group": [f"g{g}" for g in groups]}), parts_in_memory(parts),
                             config)
    alone = [i for i in range(n) if not any(((groups == groups[i]) & (bands[:, b] == bands[i, b])).sum() > 1
                                            for b in range(3))]
    assert alone and sorted(set(range(n)) - set(table.rows().tolist())) == alone
    threshold = 0.3
    for band, candidates in enumerate(band_pairs(groups, bands)):
        a, b = np.array(candidates).T
        likely = sketch_similarity(sketch, a, b) >= threshold - dedup_table.SKETCH_MARGIN
        expected = sorted(zip(a[likely].tolist(), b[likely].tolist()))
        screened = screen_band(table, band, threshold)
        assert len(expected) and sorted(map(tuple, screened.tolist())) == expected and len(screened) == len(expected)


def test_the_near_table_keeps_every_row_that_shares_a_full_width_band_key_in_its_group(tmp_path):
    """Full 64-bit keys, as MinHash bands give them, of a few thousand rows: copies of another row's key
    in the same group (kept), in another group (not, unless also copied within one), and keys
    that agree with another row's only in their low or their high bits (not): the rows kept are
    exactly those of some band's candidate pairs."""
    rng = np.random.default_rng(11)
    n, config = 3000, DedupConfig(bands=4, rows=2)
    groups = rng.integers(0, 40, n)
    bands = rng.integers(0, 2**63, (n, 4), dtype=np.uint64)
    rows = rng.permutation(n)
    copies, sources = rows[:300], rng.integers(0, n, 300)
    bands[copies, 1] = bands[sources, 1]
    groups[copies[:200]] = groups[sources[:200]]
    # Rows of no copy, each beside another of its group whose key it shares in half of its bits only.
    halves, others = rows[300:400], rows[400:500]
    groups[halves] = groups[others]
    low, high = np.uint64(0xFFFFFFFF), np.uint64(0xFFFFFFFF00000000)
    bands[halves[:50], 2] = (bands[halves[:50], 2] & high) | (bands[others[:50], 2] & low)
    bands[halves[50:], 3] = (bands[halves[50:], 3] & low) | (bands[others[50:], 3] & high)
    sketch = np.zeros((n, dedup_table.SKETCH_BINS), dtype=np.uint8)
    table = write_near_table(tmp_path / "near", pl.DataFrame({"group": [f"g{g}" for g in groups]}),
                             parts_in_memory([(np.arange(n), bands, sketch)]), config)
    paired = sorted({row for pairs in band_pairs(groups, bands) for pair in pairs for row in pair})
    assert len(paired) >= 300 and not set(paired) & set(halves.tolist()) and table.rows().tolist() == paired


def test_the_compiled_screen_keeps_exactly_the_pairs_whose_estimate_reaches_the_bound():
    """The kernel's bit counting against the sketch similarity computed bin by bin: for bounds
    that some pairs meet exactly, within blocks and across them, with empty bins, identical rows
    and empty rows."""
    rng = np.random.default_rng(7)
    n = 90
    sketch = rng.integers(0, 6, (n, dedup_table.SKETCH_BINS)).astype(np.uint8)
    sketch[::9] = sketch[1]  # identical rows
    sketch[5::11] = 0  # rows with every bin empty
    sketch[:, rng.random(dedup_table.SKETCH_BINS) < 0.2] = 0  # bins no row fills
    words = sketch.view(np.uint64)
    a, b = np.triu_indices(n, 1)
    similarity = sketch_similarity(sketch, a, b)
    for bound in [0.0, *np.quantile(similarity, [0.2, 0.5, 0.9, 0.99], method="nearest"), 1.0]:
        expected = sorted(zip(a[similarity >= bound].tolist(), b[similarity >= bound].tolist()))
        assert expected and ((similarity == bound).any() or bound == 0.0)
        within = pairs_within(words, np.array([0, 40, n]), bound)
        across = pairs_across(words[:40], words[40:], bound) + [0, 40]
        assert sorted(map(tuple, np.concatenate([within, across]).tolist())) == expected


def test_sketches_estimate_the_jaccard_of_the_fixture_pairs(merged):
    """The screen's premise: on real trajectories the sketch similarity is close to the true
    Jaccard, and no pair at or above the threshold falls below threshold - SKETCH_MARGIN."""
    config = DedupConfig()
    keys = staged_keys(merged, 0, config)
    _, sketch = near_matrices(keys, config)
    sets = [shingles(t.words.split(), config.shingle_size) for t in dedup_texts(merged)]
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, len(merged), 3000), rng.integers(0, len(merged), 3000)
    similar = [(i, j) for i in range(len(merged)) for j in range(i + 1, len(merged))
               if len(sets[i] & sets[j]) * 2 > len(sets[i])]
    a = np.concatenate([a, [i for i, _ in similar]]).astype(np.int64)
    b = np.concatenate([b, [j for _, j in similar]]).astype(np.int64)
    estimate = sketch_similarity(sketch, a, b)  # the screen keeps a pair when this reaches the bound (above)
    true = np.array([jaccard(sets[i], sets[j]) for i, j in zip(a.tolist(), b.tolist())])
    assert (true >= 0.85).sum() > 10, "the fixtures hold near duplicates"
    assert np.abs(estimate - true).mean() < 0.01
    assert (estimate[true >= 0.85] >= 0.85 - dedup_table.SKETCH_MARGIN).all()


def test_verification_chunks_hold_at_most_a_batch_of_records_and_cover_every_pair(monkeypatch):
    monkeypatch.setattr(dedup_table, "VERIFY_BATCH", 9)
    pairs = np.array([(i, j) for i in range(0, 60) for j in range(i + 1, 60, 7)], dtype=np.int64)
    chunks = list(verify_chunks(pairs))
    assert len(chunks) > 5 and max(len(rows) for rows, _ in chunks) <= 9 + 1
    assert [tuple(rows[p]) for rows, local in chunks for p in local.tolist()] == [tuple(p) for p in pairs.tolist()]


def test_resolve_drops_for_the_most_similar_kept_record_and_never_chains():
    # 1 is near 0; 2 is near 1 only (1 is dropped, so 2 stays); 3 is near 0 and 2, more to 2.
    verified = [(0, 1, 0.9), (1, 2, 0.9), (0, 2, 0.5), (0, 3, 0.86), (2, 3, 0.95)]
    assert resolve(verified, 0.85) == {1: (0, 0.9), 3: (2, 0.95)}
    # Ties go to the better-ranked record; pairs below the threshold never merge.
    assert resolve([(1, 4, 0.9), (0, 4, 0.9), (2, 5, 0.84)], 0.85) == {4: (0, 0.9)}


def test_candidates_are_verified_by_the_true_jaccard(merged):
    """With one row per band every record sharing any single signature value is a candidate: many
    false positives, which the Jaccard check must reject, so the map is the in-memory one."""
    loose = DedupConfig(bands=64, rows=1)
    kept, dups = deduplicate(merged, loose)
    assert deduplicate_in_memory(merged, loose)[1] == dups
    keys = staged_keys(merged, 0, loose)
    bands, _ = near_matrices(keys, loose)
    groups = keys["group"].rank("dense").to_numpy()
    assert len(set().union(*band_pairs(groups, bands))) > 5 * len(dups)


def test_pools_give_the_same_negatives_as_the_full_scan(merged):
    config = NegativesConfig(rates=dict.fromkeys(NEGATIVE_TYPES, 1.0))
    made = make_negatives(merged, config)
    assert {n["negative_type"] for n in made} >= {"wrong_answer", "irrelevant_tools"}
    assert make_negatives(merged, config, EnvPools.of(merged)) == made


def _tool(env: str, prompt: str, answer: str | None = None) -> dict:
    return {"kind": "positive", "env": env, "domain": "tool", "answer": answer,
            "conversations": [{"role": "user", "content": prompt}]}


def test_pools_are_bounded_deterministic_and_exclude_the_own_prompt_and_answer():
    records = [_tool("weather", f"w{i}", answer=f"a{i % 5}") for i in range(50)] + [_tool("todo", "t1"),
                                                                                  _tool("todo", "t2")]
    pools = EnvPools.of(records, max_answers=3)
    assert pools.wrong_answers("weather", "a1") == ["a0", "a2"]
    assert pools.wrong_answers("movie", None) == []
    assert pools.tool_prompts_of_other_envs("movie", "x") == [("todo", "t2"), ("weather", "w49")]
    # A record whose own prompt is the last one of an env gets that env's previous, different one.
    assert pools.tool_prompts_of_other_envs("movie", "t2") == [("todo", "t1"), ("weather", "w49")]
    assert pools.tool_prompts_of_other_envs("todo", "w49") == [("weather", "w48")]
    assert EnvPools.of(records, max_answers=3) == pools
    assert EnvPools.of([{**r, "kind": "negative"} for r in records]).answers == {}


def test_wrong_answers_follow_answers_added_after_a_maker_asked():
    pools = EnvPools.of([_tool("weather", "w", answer=a) for a in ("b", "d")])
    assert pools.wrong_answers("weather", "b") == ["d"]
    pools.add(_tool("weather", "w", answer="a"))
    assert pools.wrong_answers("weather", "b") == ["a", "d"]
    later = EnvPools.of([_tool("weather", "w", answer="c")])
    pools.merge(later)
    assert pools.wrong_answers("weather", "b") == ["a", "c", "d"]
    assert pools.wrong_answers("weather", "x") == pools.wrong_answers("weather", None) == ["a", "b", "c", "d"]


@pytest.mark.parametrize("parts", [2, 3, 7])
def test_pools_of_units_merged_in_order_equal_the_pool_of_all_records(merged, parts):
    """A build fills one pool per unit and merges them: the result must be the one-pass pool, also
    when the answer cap bites inside a unit and a unit holds one tool prompt only."""
    records = merged + [_tool("weather", f"w{i % 3}", answer=f"a{i}") for i in range(40)] + [_tool("todo", "t1")]
    for cap in (3, 1024):
        whole = EnvPools.of(records, max_answers=cap)
        combined = EnvPools(max_answers=cap)
        size = -(-len(records) // parts)
        for start in range(0, len(records), size):
            combined.merge(EnvPools.of(records[start:start + size], max_answers=cap))
        assert combined == whole


def test_compiled_signatures_and_sketches_are_numpys_bit_for_bit():
    """keys_kernel.py against `_numpy_signatures` and `sketches`: sets of one shingle, of many,
    shingles that repeat, bins whose smallest value is 0 or 0xFFFFFFFF (stored as an empty bin), a
    number of permutations that is not a multiple of 8."""
    from trajforge.pipeline.quality.dedup import ShingleSets, _numpy_signatures

    rng = np.random.default_rng(7)
    sizes = np.array([1, 1, 2, 5, 700, 3, 9000, 1, 64], dtype=np.int64)
    hashed = rng.integers(0, 1 << 64, size=int(sizes.sum()), dtype=np.uint64)
    hashed[:3] = 0xFFFFFFFF00000000 | np.uint64(5)  # a bin whose smallest high half is 0xFFFFFFFF
    hashed[10:20] = hashed[10]  # a repeated shingle
    hashed[30] = np.uint64(7)  # high half 0
    for config in (DedupConfig(), DedupConfig(num_perm=131)):  # the permutations in blocks of 8, and 3 after them
        sigs, sketch = dedup_table.signatures_and_sketches(ShingleSets(None, 5), config, (sizes, hashed))
        assert np.array_equal(sigs, _numpy_signatures([None] * len(sizes), config.num_perm, config.seed, (sizes, hashed)))
    assert np.array_equal(sketch, dedup_table.sketches(sizes, hashed).reshape(-1))
    assert sketch.reshape(len(sizes), -1)[0].max() == 0
