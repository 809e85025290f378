"""Negatives from the real fixture positives: every type is produced, labelled, and fails validation
as a positive for its own reason; the same seed gives the same negatives."""
from __future__ import annotations

import json
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.oracles import make_negatives
from tests.support.paths import AGENT_FLAN
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.quality.negatives import (
    _SORTED_JSON,
    EXPECTED_VIOLATION,
    MAKERS,
    NEGATIVE_TYPES,
    NegativesConfig,
    _draw_bound,
    batch_negatives,
    drawn_makers,
    negative_table,
    negatives_of,
)
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.schemas import arrow_schema, validator

ALL = NegativesConfig(rates=dict.fromkeys(NEGATIVE_TYPES, 1.0))


@pytest.fixture(scope="module")
def positives(fixtures_build):
    return pq.read_table(fixtures_build / "data" / "sft").to_pylist()


@pytest.fixture(scope="module")
def negatives(positives):
    return make_negatives(positives, ALL)


def _as_positive(record: dict) -> dict:
    return {**record, "kind": "positive", "negative_type": None, "parent_id": None}


def test_every_type_is_produced(negatives):
    counts = Counter(n["negative_type"] for n in negatives)
    assert set(counts) == set(NEGATIVE_TYPES)


@pytest.mark.parametrize("kind", NEGATIVE_TYPES)
def test_each_negative_is_labelled_and_fails_validation_for_its_reason(negatives, positives, kind):
    parents = {r["id"]: r for r in positives}
    made = [n for n in negatives if n["negative_type"] == kind]
    assert made
    for negative in made:
        assert negative["kind"] == "negative" and negative["parent_id"] in parents
        assert negative["id"] != negative["parent_id"] and negative["success"] is False
        assert not list(validator("trajectory").iter_errors(negative)), negative["id"]
        violation = validate_record(_as_positive(negative))
        assert violation is not None, f"{negative['id']} passes as a positive"
        assert violation.reason == EXPECTED_VIOLATION[kind], (negative["id"], violation)
        # Its parent is a valid positive: the rule fires on what the negative changed.
        assert validate_record(parents[negative["parent_id"]]) is None


def test_hallucinated_observation_is_written_by_the_model(negatives, positives):
    parents = {r["id"]: r for r in positives}
    for negative in (n for n in negatives if n["negative_type"] == "hallucinated_observation"):
        last = negative["conversations"][-1]
        assert last["role"] == "assistant" and "\nObservation: " in last["content"]
        at = len(negative["conversations"]) - 1
        parent = parents[negative["parent_id"]]["conversations"]
        assert last["content"].startswith(parent[at]["content"])


def test_wrong_and_premature_answers_keep_the_expected_answer(negatives, positives):
    parents = {r["id"]: r for r in positives}
    for negative in (n for n in negatives if n["negative_type"] in ("wrong_answer", "premature_answer")):
        parent = parents[negative["parent_id"]]
        assert negative["answer"] == parent["answer"]
        if negative["negative_type"] == "premature_answer":
            assert len(negative["conversations"]) < len(parent["conversations"])


def test_irrelevant_tools_swap_the_offered_tools(negatives, positives):
    parents = {r["id"]: r for r in positives}
    made = [n for n in negatives if n["negative_type"] == "irrelevant_tools"]
    assert made
    for negative in made:
        parent = parents[negative["parent_id"]]
        assert negative["conversations"][0]["content"] != parent["conversations"][0]["content"]
        assert '"answer"' in json.loads(negative["meta"])["chosen"]


def test_deterministic_and_rates_are_respected(positives):
    assert make_negatives(positives, ALL) == make_negatives(positives, ALL)
    none = make_negatives(positives, NegativesConfig(rates=dict.fromkeys(NEGATIVE_TYPES, 0.0)))
    assert none == []
    some = make_negatives(positives, NegativesConfig(rates={"broken_format": 0.5}))
    everything = [n for n in make_negatives(positives, ALL) if n["negative_type"] == "broken_format"]
    assert {n["negative_type"] for n in some} == {"broken_format"}
    assert 0.25 * len(everything) < len(some) < 0.75 * len(everything)
    assert make_negatives(positives, NegativesConfig(seed=1, rates={"broken_format": 0.5})) != some


@pytest.mark.parametrize("rate", [1.0, 0.2, 0.5, 1 / 3, 0.9999999999999999, 1e-19, 5e-324])
def test_draw_bound_is_where_the_draw_starts_to_fail(rate):
    # A draw is `n / 2**64 < rate` for the first 8 digest bytes n; the bound is the least n it fails.
    bound = int.from_bytes(_draw_bound(rate), "big")
    assert not bound / 2**64 < rate
    assert bound == 0 or (bound - 1) / 2**64 < rate
    assert (b"\xff" * 32 < _draw_bound(rate)) is False and (bytes(32) < _draw_bound(rate)) is (bound > 0)


def test_a_type_left_undrawn_for_what_a_positive_lacks_would_make_nothing(positives):
    # negatives_of does not draw a type whose maker needs what the positive lacks (a tool env, an
    # answer): with every type drawn, it makes what every maker makes.
    pools = EnvPools.of(positives)
    for record in positives + [{**r, "answer": None} for r in positives[:40]]:
        made = [m for maker in MAKERS.values() if (m := maker(record, pools, ALL.seed)) is not None]
        assert negatives_of(record, pools, ALL) == made


@pytest.mark.parametrize("meta", [{}, {"b": 1, "a": [1.5, None, True, "\u00e9\u2028"], "c": {"z": 1, "y": float("nan")}},
                                  {"x": "line\nbreak", "n": 10**30, "e": -0.0}])
def test_the_meta_encoder_writes_what_json_dumps_writes(meta):
    assert _SORTED_JSON(meta) == json.dumps(meta, sort_keys=True)


def test_negatives_are_made_per_parent_whatever_the_order(positives):
    config = NegativesConfig(seed=3)
    forward = {n["id"]: n for n in make_negatives(positives, config)}
    backward = {n["id"]: n for n in make_negatives(list(reversed(positives)), config)}
    assert forward == backward


def test_upstream_negatives_are_not_used_as_parents(positives):
    labelled = {**positives[0], "id": positives[0]["id"] + "-flan", "kind": "negative",
                "negative_type": "tool_irrelevance"}
    made = make_negatives([labelled], ALL)
    assert made == []


def test_config_rejects_unknown_types_and_rates():
    with pytest.raises(ValueError):
        NegativesConfig(rates={"nonsense": 0.5})
    with pytest.raises(ValueError):
        NegativesConfig(rates={"broken_format": 1.5})


def test_build_writes_negatives_config(fixtures_build):
    negatives = pq.read_table(fixtures_build / "data" / "negatives").to_pylist()
    assert negatives and all(n["kind"] == "negative" and n["parent_id"] for n in negatives)
    sft_ids = {r["id"] for r in pq.read_table(fixtures_build / "data" / "sft").to_pylist()}
    assert {n["parent_id"] for n in negatives} <= sft_ids
    assert not sft_ids & {n["id"] for n in negatives}


def test_agent_flan_rows_keep_their_label_and_their_negatives_fail_validation(tmp_path):
    from tests.support.oracles import deduplicate
    from trajforge.pipeline.build import BuildConfig, process_unit
    from trajforge.sources import get_source
    records = [r for f in get_source("agent_flan").files(str(AGENT_FLAN))
               for r in pa.ipc.open_file(process_unit("agent_flan", f, tmp_path, BuildConfig()).records_path).read_all().to_pylist()]
    labelled = [r for r in records if r["kind"] == "negative"]
    assert [r["negative_type"] for r in labelled] == ["tool_irrelevance"]
    kept, _ = deduplicate(records)
    assert labelled[0] in kept
    negatives = make_negatives(records, ALL)
    assert labelled[0]["id"] not in {n["parent_id"] for n in negatives}
    # Tool calls as JSON and as Python dicts get their own negatives too.
    assert {"invented_tool", "broken_format"} <= {n["negative_type"] for n in negatives if n["domain"] == "tool"}
    for negative in negatives:
        violation = validate_record(_as_positive(negative))
        assert violation is not None, negative["id"]
        assert violation.reason == EXPECTED_VIOLATION[negative["negative_type"]], negative["id"]


def test_the_negatives_table_is_the_negatives_converted_from_python(fixtures_build):
    # Every type at rate 1, and the positives' table as a staged batch's: two chunks, a slice.
    table = pq.read_table(fixtures_build / "data" / "sft").cast(arrow_schema("trajectory"))
    table = pa.concat_tables([table.slice(1, 7), table.slice(9)])
    parents = table.to_pylist()
    pools = EnvPools.of(parents)
    made = [negatives_of(record, pools, ALL) for record in parents]
    assert sum(map(len, made)) > len(parents)
    expected = pa.Table.from_pylist([n for its in made for n in its], schema=arrow_schema("trajectory"))
    assert negative_table(table, parents, made).equals(expected)


def test_a_batch_converts_the_turns_of_the_positives_drawn_and_makes_their_negatives(fixtures_build):
    table = pq.read_table(fixtures_build / "data" / "sft").cast(arrow_schema("trajectory"))
    full = table.to_pylist()
    pools = EnvPools.of(full)
    config = NegativesConfig(seed=3, rates=dict.fromkeys(NEGATIVE_TYPES, 0.3))
    parents = table.drop_columns(["conversations"]).to_pylist()
    made = batch_negatives(table, parents, pools, config)
    assert made == [negatives_of(record, pools, config) for record in full]
    drawn = [bool(drawn_makers(record, config)) for record in full]
    assert 0 < sum(drawn) < len(full)
    assert [("conversations" in parent) for parent in parents] == drawn
    assert all(parent == record for parent, record, d in zip(parents, full, drawn) if d)
