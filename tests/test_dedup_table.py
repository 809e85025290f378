"""The columnar dedup (key table, band group-by, verification, keep choice) and the negative pools:
the same decisions as the in-memory dedup and the full-scan pools on the real fixtures, and the
rules themselves on small hand-made cases."""
from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from trajforge.pipeline.quality.dedup import DedupConfig, deduplicate
from trajforge.pipeline.quality.dedup_table import (band_keys, candidate_pairs, deduplicate_in_memory, record_keys,
                                                    resolve)
from trajforge.pipeline.quality.negatives import NEGATIVE_TYPES, NegativesConfig, make_negatives
from trajforge.pipeline.quality.pools import EnvPools
from tests.test_dedup import merged  # noqa: F401  (the fixture: every valid fixture record, ids unique)


@pytest.mark.parametrize("threshold", [0.85, 0.6, 0.4])
def test_same_duplicate_map_as_the_in_memory_dedup_on_the_fixtures(merged, threshold):
    config = DedupConfig(threshold=threshold)
    kept, dups = deduplicate(merged, config)
    kept_table, dups_table = deduplicate_in_memory(merged, config, batch=50)
    assert dups, "the fixtures hold known duplicates"
    assert dups_table == dups
    assert [r["id"] for r in kept_table] == [r["id"] for r in kept]


def test_batching_does_not_change_the_keys(merged):
    whole = record_keys(merged, 0)
    parts = pl.concat([record_keys(merged[i:i + 7], i) for i in range(0, len(merged), 7)])
    assert whole.equals(parts)


def test_band_keys_equal_exactly_when_the_band_values_do():
    sigs = np.array([[1, 2, 3, 4], [1, 2, 9, 9], [9, 9, 3, 4], [2, 1, 4, 3]], dtype=np.uint32)
    keys = band_keys(sigs, bands=2, rows=2)
    assert keys.shape == (4, 2) and keys.dtype == np.uint64
    assert keys[0, 0] == keys[1, 0] and keys[0, 1] == keys[2, 1]
    assert keys[0, 0] != keys[2, 0] and keys[0, 1] != keys[1, 1]
    # Order inside a band matters: (1, 2) is not (2, 1).
    assert keys[3, 0] != keys[0, 0] and keys[3, 1] != keys[0, 1]


def _ranked(rows: list[tuple[str, list[int]]]) -> pl.DataFrame:
    return pl.DataFrame({"pos": list(range(len(rows))), "group": [g for g, _ in rows],
                         **{f"band{b}": pl.Series([keys[b] for _, keys in rows], dtype=pl.UInt64) for b in range(2)}})


def test_band_grouping_pairs_records_that_share_a_band_within_a_group_once():
    ranked = _ranked([("positive:", [1, 2]), ("positive:", [1, 2]), ("positive:", [5, 2]),
                      ("negative:x", [1, 2]), ("positive:", [7, 8])])
    pairs = set(candidate_pairs(ranked, 2).iter_rows())
    # 0-1 share both bands but appear once; 3 has the same keys in another group; 4 shares nothing.
    assert pairs == {(0, 1), (0, 2), (1, 2)}


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
    pairs = candidate_pairs(record_keys(merged, 0, loose).with_row_index("pos").with_columns(
        pl.col("pos").cast(pl.Int64)), 64)
    assert len(pairs) > 5 * len(dups)


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
