"""Preference pairs and GRPO prompts built from the real fixtures load with `datasets` and with
TRL's data utilities, validate against their JSON Schemas, and say what they should."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import load_dataset

from tests.support.oracles import grpo_prompts as grpo_prompts_by_record
from tests.support.oracles import make_negatives, preference_pair, preference_pairs
from trajforge.pipeline.ingest.dialects import parse_turn
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.quality.derived import grpo_prompts, preference_table
from trajforge.pipeline.quality.negatives import NEGATIVE_TYPES, NegativesConfig
from trajforge.schemas import arrow_schema, validator


@pytest.fixture(scope="module")
def positives(fixtures_build):
    return pq.read_table(fixtures_build / "data" / "sft").to_pylist()


@pytest.fixture(scope="module")
def all_pairs(positives):
    negatives = make_negatives(positives, NegativesConfig(rates=dict.fromkeys(NEGATIVE_TYPES, 1.0)))
    pairs, unpaired = preference_pairs(negatives, positives)
    return negatives, pairs, unpaired


@pytest.fixture(scope="module")
def tokenizer(fixtures_build):
    from tests.support.tiny_model import build_tokenizer, fixture_texts

    return build_tokenizer(fixture_texts(fixtures_build)[:300], vocab_size=400)


def _dataset(fixtures_build, config):
    files = sorted(str(p) for p in (fixtures_build / "data" / config).glob("*.parquet"))
    return load_dataset("parquet", data_files={"train": files}, split="train")


def test_every_negative_has_a_pair_of_its_type(all_pairs):
    negatives, pairs, unpaired = all_pairs
    assert unpaired == 0 and len(pairs) == len(negatives)
    assert {p["negative_type"] for p in pairs} == set(NEGATIVE_TYPES)
    for pair in pairs:
        assert not list(validator("preference").iter_errors(pair)), pair["id"]
        assert pair["chosen"] != pair["rejected"]
        assert pair["chosen"][0]["role"] == pair["rejected"][0]["role"] == "assistant"
        assert pair["prompt"][-1]["role"] == "user"


def test_the_build_makes_the_same_pairs_column_wise(all_pairs, positives):
    negatives, pairs, _ = all_pairs
    of_parent: dict[str, list[dict]] = {}
    for negative in negatives:
        of_parent.setdefault(negative["parent_id"], []).append(negative)
    table = preference_table(pa.Table.from_pylist(positives, schema=arrow_schema("trajectory")), positives,
                             [of_parent.get(p["id"], []) for p in positives])
    assert sorted(table.to_pylist(), key=lambda p: p["id"]) == sorted(pairs, key=lambda p: p["id"])


def test_pair_is_cut_where_the_trajectories_diverge(all_pairs, positives):
    negatives, pairs, _ = all_pairs
    parents = {r["id"]: r for r in positives}
    by_id = {n["id"]: n for n in negatives}
    for pair in (p for p in pairs if p["negative_type"] != "irrelevant_tools"):
        parent = parents[pair["parent_id"]]["conversations"]
        k = len(pair["prompt"])
        assert pair["prompt"] == [{"role": t["role"], "content": t["content"]} for t in parent[:k]]
        assert pair["chosen"][0]["content"] == parent[k]["content"]
        assert pair["rejected"][0]["content"] == by_id[pair["negative_id"]]["conversations"][k]["content"]


def test_irrelevant_tools_pair_chooses_to_answer_without_a_tool(all_pairs, positives):
    negatives, pairs, _ = all_pairs
    parents = {r["id"]: r for r in positives}
    for pair in (p for p in pairs if p["negative_type"] == "irrelevant_tools"):
        # The chosen reply, appended to the swapped context, is a valid positive in the env's syntax.
        negative = next(n for n in negatives if n["id"] == pair["negative_id"])
        parsed = parse_turn(pair["chosen"][0]["content"])
        turn = {"role": "assistant", "content": pair["chosen"][0]["content"], "loss": True,
                "thought": parsed.thought, "action": parsed.action, "reasoning": None, "dialect": parsed.dialect}
        fixed = {**parents[pair["parent_id"]], "conversations": negative["conversations"][:-1] + [turn],
                 "answer": None}
        assert validate_record(fixed) is None


def test_pair_is_none_when_nothing_differs(positives):
    record = positives[0]
    same = {**record, "id": record["id"] + "#neg-x", "kind": "negative", "negative_type": "x",
            "parent_id": record["id"]}
    assert preference_pair(same, record) is None


def test_preference_config_loads_with_datasets_and_trl(fixtures_build, tokenizer):
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    ds = _dataset(fixtures_build, "preference")
    assert len(ds) > 0 and {"prompt", "chosen", "rejected"} <= set(ds.column_names)
    example = ds[0]
    assert is_conversational(example)
    text = maybe_apply_chat_template(example, tokenizer)
    assert set(text) >= {"prompt", "chosen", "rejected"}
    assert text["prompt"].endswith("<|im_start|>assistant\n")
    assert example["chosen"][0]["content"] in text["chosen"]
    assert example["rejected"][0]["content"] in text["rejected"]


def test_grpo_config_loads_with_datasets_and_trl(fixtures_build, positives, tokenizer):
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    ds = _dataset(fixtures_build, "grpo")
    assert len(ds) == sum(1 for r in positives if r["kind"] == "positive")
    row = ds[0]
    assert is_conversational(row) and row["prompt"][-1]["role"] == "user"
    assert maybe_apply_chat_template({"prompt": row["prompt"]}, tokenizer)["prompt"].endswith(
        "<|im_start|>assistant\n")
    for row in ds:
        assert not list(validator("grpo").iter_errors(row)), row["id"]


def _grpo_rows(records: list[dict]) -> list[dict]:
    return grpo_prompts(pa.Table.from_pylist(records, schema=arrow_schema("trajectory"))).to_pylist()


def test_grpo_prompts_made_column_wise_are_those_made_record_by_record(positives):
    negative = {**positives[0], "id": "x/negative", "kind": "negative"}
    # A positive whose first assistant turn is trained gets no prompt; a negative none either.
    no_prompt = {**positives[1], "id": "x/no-prompt", "conversations": [
        {**positives[1]["conversations"][1], "role": "assistant", "loss": True}, *positives[1]["conversations"][1:]]}
    records = [negative, *positives, no_prompt]
    assert _grpo_rows(records) == grpo_prompts_by_record(records)
    assert len(_grpo_rows(positives)) > 100 and _grpo_rows([negative, no_prompt]) == [] and _grpo_rows([]) == []


def test_grpo_prompt_stops_before_the_first_trained_turn(positives):
    record = next(r for r in positives if r["id"] == "agenttraj_l/todo_0")
    [row] = _grpo_rows([record])
    turns = record["conversations"]
    first = next(i for i, t in enumerate(turns) if t["role"] == "assistant" and t["loss"])
    assert len(row["prompt"]) == first
    assert row["answer"] == record["answer"] == "2015-06-01"
    assert row["first_action"] == turns[first]["action"]
    assert row["expected_actions"][-1].startswith("finish with Action Input:")
    assert (row["env"], row["domain"]) == ("todo", "tool")
    # AgentInstruct OS rows keep their one-shot demonstration in the prompt (not trained on).
    os_record = next(r for r in positives if r["env"] == "os" and r["demo_turns"] > 0)
    assert sum(1 for m in _grpo_rows([os_record])[0]["prompt"] if m["role"] == "assistant") >= 1
