"""Outcome reward model on TRL's RewardTrainer: which of two replies to the same context is better.

Trained on the `preference` config (the parent's turn chosen over the negative's at the step where
they diverge) and, when given (`step_pairs`), on the step pairs of tree search (a next step from
which a rollout succeeded over one from which every rollout failed): both are TRL's conversational
preference format, `prompt` + `chosen` / `rejected` message lists. The model is a
sequence-classification head (one logit) on the base model, scoring the last token of the
rendered conversation (Bradley-Terry loss, TRL's).

After training, every held-out pair (`eval_fraction`, split by the trajectory a pair comes from so
that pairs of one parent never straddle the split) is scored and the share ranked right is
reported with its 95% Wilson interval (`pairwise_accuracy.json` in output_dir): TRL's own
`eval_accuracy` is a mean of per-batch means, this is the count.

`RewardModel` loads a trained one to score conversations: `trajforge score`, the `rm` GRPO
reward (training/rewards.py) and `rank_candidates` for best-of-N use it.
"""
from __future__ import annotations

import glob
import logging
import math
import os

from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset
from transformers import AutoModelForSequenceClassification
from trl import RewardTrainer, get_peft_config

from trajforge.pipeline.atomic import write_json
from trajforge.training.arguments import RewardTrainConfig, parse
from trajforge.training.common import load_model, load_tokenizer, run
from trajforge.training.data import load_release, train_eval_split
from trajforge.training.dpo import fit_pairs

logger = logging.getLogger(__name__)

PAIR = ["id", "prompt", "chosen", "rejected"]


def read_pairs(paths: list[str]) -> Dataset:
    """Step pairs from Parquet files or folders, as pair rows whose `id` is their task (the split
    keeps a task's pairs on one side)."""
    files = sorted(f for p in paths for f in ([p] if os.path.isfile(p) else glob.glob(os.path.join(p, "*.parquet"))))
    if not files:
        raise FileNotFoundError(f"step_pairs: no Parquet file in {paths}")
    pairs = load_dataset("parquet", data_files=files, split="train")
    return pairs.map(lambda row: {"id": row.get("task_id") or row["id"]}).select_columns(PAIR)


def load_pairs(data_args, training_args: RewardTrainConfig) -> tuple[Dataset, Dataset | None]:
    data = load_release(data_args.dataset_name, data_args.dataset_config or "preference", data_args.dataset_revision)
    data = DatasetDict({name: split.select_columns(PAIR) for name, split in data.items()})
    if training_args.step_pairs:
        train_split = data_args.dataset_train_split
        data[train_split] = concatenate_datasets([data[train_split], read_pairs(training_args.step_pairs)])
    train, evaluation = train_eval_split(data, data_args.dataset_train_split, data_args.dataset_test_split,
                                         data_args.eval_fraction, training_args.seed)
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    return train, evaluation


def build_trainer(data_args, training_args: RewardTrainConfig, model_args, callbacks=None) -> RewardTrainer:
    tokenizer = load_tokenizer(model_args, training_args)
    train, evaluation = load_pairs(data_args, training_args)
    # Too-long pairs are dropped and counted here; TRL would drop them silently.
    train = fit_pairs(train.remove_columns("id"), tokenizer, training_args.max_length)
    if evaluation is not None:
        evaluation = fit_pairs(evaluation.remove_columns("id"), tokenizer, training_args.max_length)
    model = load_model(model_args, training_args, AutoModelForSequenceClassification, num_labels=1)
    return RewardTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                         processing_class=tokenizer, peft_config=get_peft_config(model_args), callbacks=callbacks)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion (sound for small n and for 0 or n successes)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


class RewardModel:
    """A trained outcome reward model: one score per conversation (a list of {role, content})."""

    def __init__(self, model, tokenizer, max_length: int | None = None, batch_size: int = 8):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.batch_size = batch_size
        self.truncated = 0  # conversations longer than max_length, scored on their last max_length tokens

    @classmethod
    def load(cls, path: str, max_length: int | None = None, batch_size: int = 8) -> RewardModel:
        from transformers import AutoTokenizer

        return cls(AutoModelForSequenceClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                   max_length, batch_size)

    def encode(self, conversation: list[dict]) -> list[int]:
        messages = [{"role": m["role"], "content": m["content"]} for m in conversation]
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        if self.max_length is not None and len(ids) > self.max_length:
            # The outcome is at the end: keep it, lose the start of the instructions.
            self.truncated += 1
            ids = ids[-self.max_length:]
        return ids

    def score(self, conversations: list[list[dict]]) -> list[float]:
        import torch

        scores: list[float] = []
        pad = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        for start in range(0, len(conversations), self.batch_size):
            encoded = [self.encode(c) for c in conversations[start:start + self.batch_size]]
            width = max(map(len, encoded))
            input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids in encoded], device=device)
            mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids in encoded], device=device)
            with torch.no_grad():
                logits = self.model(input_ids=input_ids, attention_mask=mask).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores


def pairwise_accuracy(rm: RewardModel, pairs: Dataset) -> dict:
    """Held-out pairs ranked right (chosen scored above rejected), with the 95% Wilson interval."""
    chosen = rm.score([p + c for p, c in zip(pairs["prompt"], pairs["chosen"])])
    rejected = rm.score([p + r for p, r in zip(pairs["prompt"], pairs["rejected"])])
    right = sum(c > r for c, r in zip(chosen, rejected))
    low, high = wilson_interval(right, len(chosen))
    return {"pairs": len(chosen), "ranked_right": right, "accuracy": right / len(chosen) if chosen else None,
            "ci95": [round(low, 4), round(high, 4)]}


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(RewardTrainConfig, argv)
    trainer = build_trainer(data_args, training_args, model_args)
    metrics = run(trainer, training_args)
    if trainer.eval_dataset is not None:
        # The untokenized held-out pairs again: TRL's copy holds token ids only.
        _, evaluation = load_pairs(data_args, training_args)
        evaluation = fit_pairs(evaluation.remove_columns("id"), trainer.processing_class, training_args.max_length)
        held_out = pairwise_accuracy(RewardModel(trainer.model, trainer.processing_class), evaluation)
        write_json(os.path.join(training_args.output_dir, "pairwise_accuracy.json"), held_out)
        logger.info("held-out pairwise accuracy: %s", held_out)
        metrics["pairwise_accuracy"] = held_out
    return metrics
