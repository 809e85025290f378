"""Reward models on the fixtures build with a tiny random model, on CPU: the outcome RM (TRL's
RewardTrainer), the process RM (token classifier at each step's separator), their label tensors,
and both as rewards inside GRPO and RLOO steps."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.support.tiny_model import CONFIGS, launch, warm_start  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def trained(trainer: str, tiny: Path, build: Path, out: Path, *overrides: str) -> dict:
    """`trajforge train TRAINER` with its tiny config; the run's results, its loss finite."""
    launch(trainer, tiny, build, out, *overrides)
    results = json.loads((out / "all_results.json").read_text())
    assert math.isfinite(results["train_loss"])
    return results


@pytest.fixture(scope="module")
def rm(tiny, fixtures_build, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rm")
    trained("rm", tiny, fixtures_build, out)
    return out


@pytest.fixture(scope="module")
def prm(tiny, fixtures_build, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prm")
    trained("prm", tiny, fixtures_build, out)
    return out


def heads_moved(tiny: Path, out: Path) -> None:
    from safetensors.torch import load_file

    before, after = load_file(str(tiny / "model.safetensors")), load_file(str(out / "model.safetensors"))
    shared = [k for k in after if k in before]
    assert shared and any(not torch.equal(before[k], after[k]) for k in shared)
    assert "score.weight" in after  # the reward head (Qwen2 ...ForSequenceClassification / ...ForTokenClassification)


def test_rm_trains_and_reports_held_out_pairwise_accuracy(tiny, rm, fixtures_build):
    from transformers import AutoTokenizer

    from trajforge.training.arguments import RewardTrainConfig, parse
    from trajforge.training.dpo import fit_pairs
    from trajforge.training.reward_model import load_pairs

    heads_moved(tiny, rm)
    held_out = json.loads((rm / "pairwise_accuracy.json").read_text())
    data_args, training_args, _ = parse(RewardTrainConfig, ["--config", str(CONFIGS / "rm_tiny.yaml"),
                                                            "--model_name_or_path", str(tiny),
                                                            "--dataset_name", str(fixtures_build)])
    train, evaluation = load_pairs(data_args, training_args)
    groups = lambda rows: {i.split("#")[0] for i in rows["id"]}  # noqa: E731
    assert not groups(train) & groups(evaluation)  # pairs of one parent never straddle the split
    fitting = fit_pairs(evaluation.remove_columns("id"), AutoTokenizer.from_pretrained(tiny), training_args.max_length)
    assert held_out["pairs"] == len(fitting) > 0 and 0 <= held_out["ranked_right"] <= held_out["pairs"]
    low, high = held_out["ci95"]
    assert low <= held_out["accuracy"] <= high


def test_rm_inputs_are_prompt_plus_reply_chosen_then_rejected(tiny, fixtures_build, tmp_path):
    """What RewardTrainer trains on: each pair's chosen and rejected conversations, tokenized by the
    chat template, chosen in the first half of a batch."""
    from trajforge.training.arguments import RewardTrainConfig, parse
    from trajforge.training.reward_model import build_trainer

    args = parse(RewardTrainConfig, ["--config", str(CONFIGS / "rm_tiny.yaml"), "--model_name_or_path", str(tiny),
                                     "--dataset_name", str(fixtures_build), "--output_dir", str(tmp_path)])
    trainer = build_trainer(*args)
    tokenizer = trainer.processing_class
    row = trainer.train_dataset[0]
    text = tokenizer.decode(row["chosen_ids"])
    assert text.startswith("<|im_start|>") and text.endswith("<|im_end|>\n")
    assert tokenizer.decode(row["rejected_ids"]) != text
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    assert batch["input_ids"][0, :len(row["chosen_ids"])].tolist() == row["chosen_ids"]
    assert batch["input_ids"][2, :len(row["rejected_ids"])].tolist() == row["rejected_ids"]


def test_prm_label_tensor_sits_on_each_labelled_steps_separator(tiny, fixtures_build):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from trajforge.training.data import IGNORE
    from trajforge.training.process_reward_model import step_tokens

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    rows = [r for p in sorted((fixtures_build / "data" / "step_labels").glob("*.parquet"))
            for r in pq.read_table(p).to_pylist()]
    # A negative (its last step bad) whose context has an unlabelled assistant turn (the acknowledgement).
    row = next(r for r in rows if r["kind"] == "negative" and any(m["label"] == 1 for m in r["messages"])
               and any(m["role"] == "assistant" and m["label"] is None for m in r["messages"]))
    encoded = step_tokens(tokenizer, row["messages"])
    ids, labels = encoded["input_ids"], encoded["labels"]
    positions = [j for j, label in enumerate(labels) if label != IGNORE]
    assistant = [m for m in row["messages"] if m["role"] == "assistant"]
    assert len(encoded["steps"]) == len(assistant)
    assert positions == [j for j, m in zip(encoded["steps"], assistant) if m["label"] is not None]
    assert [labels[j] for j in positions] == [m["label"] for m in assistant if m["label"] is not None]
    assert labels[positions[-1]] == 0 and positions[-1] == len(ids) - 1  # the negative ends at its bad step
    for j, message in zip(encoded["steps"], assistant):
        # The separator closes the step: everything up to it renders the conversation through this turn.
        upto = row["messages"][:row["messages"].index(message) + 1]
        rendered = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in upto],
                                                 tokenize=False)
        assert tokenizer.decode(ids[:j + 1]) == rendered
    # Cut to fit: only the labelled steps that fit keep their label, the sequence ends at the last one.
    cut = step_tokens(tokenizer, row["messages"], max_length=positions[-1])
    assert cut["input_ids"] == ids[:positions[-2] + 1] and cut["labels"] == labels[:positions[-2] + 1]
    assert step_tokens(tokenizer, row["messages"], max_length=positions[0]) is None


def test_prm_trains_and_reports_held_out_step_accuracy_and_auroc(tiny, prm):
    heads_moved(tiny, prm)
    metrics = json.loads((prm / "step_metrics.json").read_text())
    assert metrics["steps"] == metrics["good"] + metrics["bad"] > 0
    assert set(metrics["by_label_source"]) <= {"trajectory", "negative", "critical", "salvage", "refused", "search"}
    assert sum(s["steps"] for s in metrics["by_label_source"].values()) == metrics["steps"]
    assert metrics["auroc"] is None or 0.0 <= metrics["auroc"] <= 1.0


def test_auroc_counts_ties_as_half():
    from trajforge.training.process_reward_model import auroc

    assert auroc([0.9, 0.8, 0.1], [1, 1, 0]) == 1.0
    assert auroc([0.1, 0.8, 0.9], [1, 1, 0]) == 0.0
    assert auroc([0.5, 0.5], [1, 0]) == 0.5 and auroc([0.3], [1]) is None


def test_reward_models_give_one_number_per_completion(rm, prm, fixtures_build):
    import pyarrow.parquet as pq

    from trajforge.pipeline.quality.score import rank_candidates
    from trajforge.training.reward_model import RewardModel
    from trajforge.training.rewards import get_rewards

    rows = pq.read_table(sorted((fixtures_build / "data" / "preference").glob("*.parquet"))[0]).to_pylist()[:3]
    prompts = [r["prompt"] for r in rows] * 2
    completions = [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    rm_reward, prm_reward = get_rewards([f"rm={rm}", f"prm={prm}"])
    assert (rm_reward.__name__, prm_reward.__name__) == ("rm_reward", "prm_reward")
    for reward in (rm_reward, prm_reward):
        scores = reward(prompts=prompts, completions=completions)
        assert len(scores) == len(completions) and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    model = RewardModel.load(str(rm))
    candidates = [p + c for p, c in zip(prompts, completions)]
    ranked = rank_candidates(model, candidates)
    scores = model.score(candidates)
    assert sorted(i for i, _ in ranked) == list(range(len(candidates)))
    assert [s for _, s in ranked] == sorted(scores, reverse=True)


def test_grpo_step_with_the_reward_model_as_a_reward(tiny, rm, fixtures_build, tmp_path):
    policy = warm_start(tiny, fixtures_build, tmp_path / "warm")
    out = tmp_path / "grpo"
    trained("grpo", policy, fixtures_build, out, "--max_prompt_tokens", "1024", "--max_steps", "1",
           "--reward_funcs", "format", f"rm={rm}", "--reward_weights", "1.0", "1.0")
    logged = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "reward" in e]
    assert logged and math.isfinite(logged[0]["rewards/rm_reward/mean"])


def test_rloo_trains_on_the_grpo_prompts_with_the_process_reward_model(tiny, prm, fixtures_build, tmp_path):
    policy = warm_start(tiny, fixtures_build, tmp_path / "warm")
    out = tmp_path / "rloo"
    trained("rloo", policy, fixtures_build, out, "--max_steps", "1", "--reward_funcs", "format", "tag_count",
           f"prm={prm}", "--reward_weights", "1.0", "0.5", "1.0")
    logged = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "reward" in e]
    assert logged and math.isfinite(logged[0]["rewards/prm_reward/mean"])


def search_rows(fixtures_build: Path, tmp_path: Path) -> tuple[Path, Path, list[dict]]:
    """Tree-search outputs in their layout (`search/step_pairs`, `search/step_values`), made of real
    preference pairs: each pair's prompt is a node, its chosen and rejected replies two children."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = [r for p in sorted((fixtures_build / "data" / "preference").glob("*.parquet"))
             for r in pq.read_table(p).to_pylist()][:6]
    step_pairs, step_values = tmp_path / "search" / "step_pairs", tmp_path / "search" / "step_values"
    step_pairs.mkdir(parents=True)
    step_values.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([
        {"id": f"n{k}c>n{k}r", "task_id": f"task{k // 2}", "env": p["env"], "prompt": p["prompt"],
         "chosen": p["chosen"], "rejected": p["rejected"], "chosen_value": 0.5, "rejected_value": 0.0}
        for k, p in enumerate(pairs)]), step_pairs / "db.parquet")
    pq.write_table(pa.Table.from_pylist([
        {"id": f"n{k}{side[0]}", "task_id": f"task{k // 2}", "env": p["env"], "prompt": p["prompt"],
         "completion": p[side], "value": value, "visits": 4, "successes": int(4 * value)}
        for k, p in enumerate(pairs) for side, value in (("chosen", 0.5), ("rejected", 0.0))]),
        step_values / "db.parquet")
    return step_pairs, step_values, pairs


def test_tree_search_step_pairs_and_values_join_the_training_data(tiny, fixtures_build, tmp_path):
    from trajforge.training.arguments import ProcessRewardTrainConfig, RewardTrainConfig, parse
    from trajforge.training.process_reward_model import load_steps
    from trajforge.training.reward_model import load_pairs

    step_pairs, step_values, pairs = search_rows(fixtures_build, tmp_path)
    common = ["--model_name_or_path", str(tiny), "--dataset_name", str(fixtures_build)]
    plain = load_pairs(*parse(RewardTrainConfig, ["--config", str(CONFIGS / "rm_tiny.yaml"), *common])[:2])
    data_args, training_args, _ = parse(RewardTrainConfig, ["--config", str(CONFIGS / "rm_tiny.yaml"), *common,
                                                            "--step_pairs", str(step_pairs)])
    train, evaluation = load_pairs(data_args, training_args)
    assert len(train) + len(evaluation) == len(plain[0]) + len(plain[1]) + len(pairs)
    # A task's step pairs are grouped by task: never on both sides.
    tasks = lambda rows: {i for i in rows["id"] if i.startswith("task")}  # noqa: E731
    assert not tasks(train) & tasks(evaluation) and tasks(train) | tasks(evaluation) == {"task0", "task1", "task2"}

    data_args, training_args, _ = parse(ProcessRewardTrainConfig, [
        "--config", str(CONFIGS / "prm_tiny.yaml"), *common, "--step_values", str(step_values)])
    train, evaluation = load_steps(data_args, training_args)
    searched = [row for split in (train, evaluation) for row in split if row["id"].startswith("task")]
    assert len(searched) == 2 * len(pairs)
    for row in searched:
        *context, step = row["messages"]
        assert all(m["label"] is None for m in context) and step["label_source"] == "search"
        assert step["label"] == (1 if row["id"].endswith("c") else 0)  # value 0.5 > 0: good; 0.0: bad
