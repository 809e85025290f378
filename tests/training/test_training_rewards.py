"""Each GRPO reward on real rows of the fixtures build: a positive and a negative case."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.tiny_model import read_config
from trajforge.pipeline.ingest.dialects import render_react
from trajforge.training.rewards import (
    REWARDS,
    accuracy_reward,
    env_reward,
    format_reward,
    get_rewards,
    tag_count_reward,
)


@pytest.fixture(scope="module")
def sft_rows(fixtures_build: Path) -> list[dict]:
    return read_config(fixtures_build, "sft")


def action_turns(rows: list[dict]):
    for row in rows:
        for turn in row["conversations"]:
            if turn["role"] == "assistant" and turn["action"] is not None:
                yield row, turn


def as_completion(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_format_rewards_the_dialect_the_prompt_asks_for(sft_rows):
    turns = list(action_turns(sft_rows))
    dialects = {turn["dialect"] for _, turn in turns}
    assert len(dialects) >= 8  # the fixtures cover most upstream dialects
    n = len(turns)
    rewards = format_reward([as_completion(t["content"]) for _, t in turns],
                            rendering=["native"] * n, dialect=[t["dialect"] for _, t in turns])
    assert rewards == [1.0] * n
    # The same action rendered as Think/Act answers a native prompt in the wrong format ...
    other = [(r, t) for r, t in turns if t["dialect"] != "think_act" and t["thought"]]
    react_texts = [as_completion(render_react(t["thought"], t["action"])) for _, t in other]
    assert format_reward(react_texts, rendering=["native"] * len(other),
                         dialect=[t["dialect"] for _, t in other]) == [0.0] * len(other)
    # ... and is the right one for a react-rendered prompt, where the native text is wrong.
    assert format_reward(react_texts, rendering=["react"] * len(other), dialect=[None] * len(other)) == \
        [1.0] * len(other)
    assert format_reward([as_completion(t["content"]) for _, t in other], rendering=["react"] * len(other),
                         dialect=[t["dialect"] for _, t in other]) == [0.0] * len(other)


def test_format_skips_rows_without_a_format_and_zeroes_empty_text(sft_rows):
    assert format_reward([as_completion("x")], rendering=["native"], dialect=[None]) == [None]
    assert format_reward([as_completion("   ")], rendering=["react"], dialect=[None]) == [0.0]


def test_tag_count_gives_full_credit_to_real_turns_and_partial_to_broken_ones(sft_rows):
    turns = list(action_turns(sft_rows))
    n = len(turns)
    rewards = tag_count_reward([as_completion(t["content"]) for _, t in turns],
                               rendering=["native"] * n, dialect=[t["dialect"] for _, t in turns])
    assert rewards == [1.0] * n
    marked = [(r, t) for r, t in turns if t["dialect"] in ("think_act", "upper_thought_action", "thought_action")]
    # Two steps in one turn (the model plays the environment too): the action count check fails.
    doubled = [as_completion(t["content"] + "\n" + t["content"]) for _, t in marked]
    doubled_rewards = tag_count_reward(doubled, rendering=["native"] * len(marked),
                                       dialect=[t["dialect"] for _, t in marked])
    assert all(r <= 0.5 for r in doubled_rewards)
    # A thought with no action.
    thought_only = [as_completion(t["content"].split("\n")[0]) for _, t in marked if t["thought"]]
    assert all(r == 0.25 for r in tag_count_reward(thought_only, rendering=["native"] * len(thought_only),
                                                   dialect=[t["dialect"] for _, t in marked if t["thought"]]))


def final_turns(rows: list[dict]) -> list[tuple[dict, str]]:
    """Rows whose answer is given by an action (DB, KG, OS, tool `finish`), with that turn's text.
    Prose final replies (ToolBench CoT) are not exact-match answers and stay out."""
    out = []
    for row in rows:
        last = [t for t in row["conversations"] if t["role"] == "assistant"][-1]
        if row["answer"] is not None and last["action"] is not None:
            out.append((row, last["content"]))
    return out


def test_accuracy_matches_the_reference_answer_of_db_kg_and_os_rows(sft_rows):
    finals = final_turns(sft_rows)
    assert {row["domain"] for row, _ in finals} >= {"db", "kg", "os"}
    rewards = accuracy_reward([as_completion(text) for _, text in finals], answer=[r["answer"] for r, _ in finals])
    assert rewards == [1.0] * len(finals)
    # Another row's (different) answer is wrong.
    wrong = [(row, text) for (row, _), (other, text) in zip(finals, finals[1:] + finals[:1])
             if row["answer"] != other["answer"]]
    assert len(wrong) > len(finals) // 2
    assert accuracy_reward([as_completion(t) for _, t in wrong], answer=[r["answer"] for r, _ in wrong]) == \
        [0.0] * len(wrong)
    # A step that is not an answer earns nothing; a row without a reference answer is skipped.
    db_row = next(row for row, _ in finals if row["domain"] == "db"
                  and sum(t["role"] == "assistant" and t["action"] is not None for t in row["conversations"]) > 1)
    first_action = next(t for t in db_row["conversations"] if t["role"] == "assistant" and t["action"])
    assert "Operation" in first_action["action"]
    assert accuracy_reward([as_completion(first_action["content"])], answer=[db_row["answer"]]) == [0.0]
    assert accuracy_reward([as_completion("Final Answer: 1")], answer=[None]) == [None]


def test_accuracy_is_order_insensitive_for_list_answers(sft_rows):
    row = next(r for r, _ in final_turns(sft_rows) if r["domain"] == "db" and len(json.loads(r["answer"])) > 2)
    items = json.loads(row["answer"])
    reordered = f'Action: Answer\nFinal Answer: {json.dumps(list(reversed(items)))}'
    assert accuracy_reward([as_completion(reordered)], answer=[row["answer"]]) == [1.0]
    missing = f'Action: Answer\nFinal Answer: {json.dumps(items[1:])}'
    assert accuracy_reward([as_completion(missing)], answer=[row["answer"]]) == [0.0]


def test_env_reward_replays_db_answers_in_the_registered_environment(raw_dir):
    pytest.importorskip("trajforge.pipeline.synth.envs.db")
    from trajforge.pipeline.envs.tasks import load_tasks

    tasks = [t for t in load_tasks(raw_dir.parent / "tasks" / "agentbench" / "db" / "dev.jsonl") if t.data.get("kind") == "select"][:3]
    assert tasks
    right = [as_completion(f"The query gave the answer.\nAction: Answer\nFinal Answer: {json.dumps(t.data['label'])}")
             for t in tasks]
    wrong = [as_completion('The query gave the answer.\nAction: Answer\nFinal Answer: ["no such value"]')
             for _ in tasks]
    columns = {"env_task": [json.dumps(t.as_dict()) for t in tasks]}
    assert env_reward(right, **columns) == [1.0] * len(tasks)
    assert env_reward(wrong, **columns) == [0.0] * len(tasks)
    assert env_reward(right[:1], env_task=[None]) == [None]


def test_registry_names_and_unknown_names():
    assert set(REWARDS) == {"format", "tag_count", "accuracy", "env", "tool_call"}
    assert get_rewards(["format", "accuracy"]) == [format_reward, accuracy_reward]
    with pytest.raises(KeyError, match="unknown reward"):
        get_rewards(["math_verify"])


def test_grpo_rows_carry_the_format_of_their_reference_trajectory(fixtures_build, sft_rows):
    rows = read_config(fixtures_build, "grpo")
    by_id = {r["id"]: r for r in sft_rows}
    checked = 0
    for row in rows:
        reference = next(t for t in by_id[row["id"]]["conversations"] if t["role"] == "assistant" and t["loss"])
        reward = format_reward([as_completion(reference["content"])], rendering=[row["rendering"]],
                               dialect=[row["dialect"]])
        assert reward == ([None] if reference["action"] is None else [1.0]), row["id"]
        checked += reward == [1.0]
    assert checked > len(rows) // 2
