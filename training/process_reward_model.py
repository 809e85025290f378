"""Process reward model: the probability that each assistant step of a trajectory is a good one.

TRL 1.16 ships no PRM trainer; its former `PRMTrainer` was a token classifier that predicts a label
at the separator after each step. This is the same model for multi-turn agent trajectories, on
transformers' `AutoModelForTokenClassification` (two classes, bad / good) and `Trainer`: the
trajectory is rendered with the chat template, and the label of a step sits on the last token of
its turn's rendering (with ChatML the newline after `<|im_end|>`), the step separator; every
other token is -100. A causal model sees the whole step, and nothing after it, at that token.

Data: the `step_labels` config of a build (pipeline/quality/derived.py says where each label comes
from), or a trajectory config such as a `trajforge select-steps` output (labels derived the same
way, `step_labels_of`), plus tree-search step values when given (`step_values`). After training the
held-out steps (`eval_fraction`, split by trajectory) are scored: step accuracy, AUROC, and both per
label source, in `step_metrics.json`.

`ProcessRewardModel` loads a trained one: per-step scores, and one score per trajectory (the
lowest step score by default, as in Lightman et al.'s "Let's Verify Step by Step").
"""
from __future__ import annotations

import bisect
import glob
import logging
import os
from collections import Counter, defaultdict

import numpy as np
from datasets import Dataset, DatasetDict, concatenate_datasets, load_dataset
from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification, Trainer

from trajforge.pipeline.atomic import write_json
from trajforge.pipeline.quality.derived import step_labels_of
from trajforge.training.arguments import ProcessRewardTrainConfig, parse
from trajforge.training.common import load_model, load_tokenizer, run
from trajforge.training.data import IGNORE, load_release, train_eval_split, turn_boundaries
from trajforge.training.reward_model import wilson_interval

logger = logging.getLogger(__name__)

AGGREGATES = ("min", "mean", "last")


def step_tokens(tokenizer, messages: list[dict], max_length: int | None = None) -> dict | None:
    """input_ids, labels (a step's label at its separator token, -100 elsewhere) and the separator
    positions of every assistant step (`steps`, labelled or not), or None when no labelled step fits.

    A trajectory longer than max_length is cut after the last labelled step that fits."""
    text, spans = turn_boundaries(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = encoded["input_ids"], [start for start, _ in encoded["offset_mapping"]]
    labels = [IGNORE] * len(ids)
    steps = []
    for (_, end), message in zip(spans, messages):
        if message["role"] != "assistant":
            continue
        separator = bisect.bisect_left(starts, end) - 1  # the token holding the turn's last character
        steps.append(separator)
        if message.get("label") is not None:
            labels[separator] = int(message["label"])
    labelled = [j for j, label in enumerate(labels) if label != IGNORE]
    if not labelled:
        return None
    if max_length is not None and len(ids) > max_length:
        fitting = [j for j in labelled if j < max_length]
        if not fitting:
            return None
        cut = fitting[-1] + 1
        ids, labels, steps = ids[:cut], labels[:cut], [j for j in steps if j < cut]
    return {"input_ids": ids, "labels": labels, "steps": steps}


def read_step_values(paths: list[str], threshold: float) -> Dataset:
    """Tree-search step values (prompt, one-turn completion, Monte Carlo value) as step_labels rows:
    the completion is good when its value is above `threshold`; the prompt's own steps are context."""
    files = sorted(f for p in paths for f in ([p] if os.path.isfile(p) else glob.glob(os.path.join(p, "*.parquet"))))
    if not files:
        raise FileNotFoundError(f"step_values: no Parquet file in {paths}")

    def as_labels(row: dict) -> dict:
        context = [{"role": m["role"], "content": m["content"], "label": None, "label_source": None}
                   for m in row["prompt"]]
        step = [{"role": m["role"], "content": m["content"], "label": int(row["value"] > threshold),
                 "label_source": "search"} for m in row["completion"]]
        # `#` ends the split group (training.data.trajectory_group): a task's steps stay on one side.
        return {"id": f"{row['task_id']}#{row['id']}", "messages": context + step}

    values = load_dataset("parquet", data_files=files, split="train")
    return values.map(as_labels, remove_columns=values.column_names)


def labelled_rows(data: Dataset) -> Dataset:
    """`id` + `messages` rows: a step_labels config as it is, a trajectory config labelled as the
    build labels it (records with no labelled step are dropped and counted)."""
    if "messages" in data.column_names:
        return data.select_columns(["id", "messages"])
    rows = [row for row in map(step_labels_of, data) if row is not None]
    if len(rows) < len(data):
        logger.warning("PRM data: %d of %d trajectories have no labelled step", len(data) - len(rows), len(data))
    return Dataset.from_list([{"id": r["id"], "messages": r["messages"]} for r in rows])


def load_steps(data_args, training_args: ProcessRewardTrainConfig) -> tuple[Dataset, Dataset | None]:
    data = load_release(data_args.dataset_name, data_args.dataset_config or "step_labels", data_args.dataset_revision)
    data = DatasetDict({name: labelled_rows(split) for name, split in data.items()})
    if training_args.step_values:
        split = data_args.dataset_train_split
        values = read_step_values(training_args.step_values, training_args.step_value_threshold)
        data[split] = concatenate_datasets([data[split], values.cast(data[split].features)])
    train, evaluation = train_eval_split(data, data_args.dataset_train_split, data_args.dataset_test_split,
                                         data_args.eval_fraction, training_args.seed)
    if data_args.max_train_samples is not None:
        train = train.select(range(min(data_args.max_train_samples, len(train))))
    return train, evaluation


def _tokenize_row(row: dict, tokenizer, max_length: int | None) -> dict:
    out = step_tokens(tokenizer, row["messages"], max_length)
    sources = [m["label_source"] for m in row["messages"] if m["role"] == "assistant" and m["label"] is not None]
    if out is None:
        return {"input_ids": [], "labels": [], "sources": [], "kept": False}
    labelled = sum(label != IGNORE for label in out["labels"])
    return {"input_ids": out["input_ids"], "labels": out["labels"], "sources": sources[:labelled], "kept": True}


def tokenize_steps(dataset: Dataset, tokenizer, max_length: int | None, num_proc: int | None = None) -> Dataset:
    """Tokenized rows (`input_ids`, `labels`, and the label source of each labelled step); rows whose
    first labelled step does not fit max_length are dropped and counted."""
    mapped = dataset.map(_tokenize_row, fn_kwargs={"tokenizer": tokenizer, "max_length": max_length},
                         remove_columns=dataset.column_names, num_proc=num_proc, desc="Labelling step separators")
    kept = mapped.filter(lambda k: k, input_columns="kept")
    if len(kept) < len(mapped):
        logger.warning("PRM data: %d of %d trajectories dropped: no labelled step within max_length=%s",
                       len(mapped) - len(kept), len(mapped), max_length)
    if not len(kept):
        raise ValueError(f"no step_labels row has a labelled step within max_length={max_length}")
    return kept.remove_columns("kept")


def build_trainer(data_args, training_args: ProcessRewardTrainConfig, model_args, callbacks=None) -> Trainer:
    tokenizer = load_tokenizer(model_args, training_args)
    train, evaluation = load_steps(data_args, training_args)
    train = tokenize_steps(train, tokenizer, training_args.max_length, training_args.dataset_num_proc)
    if evaluation is not None:
        evaluation = tokenize_steps(evaluation, tokenizer, training_args.max_length, training_args.dataset_num_proc)
    model = load_model(model_args, training_args, AutoModelForTokenClassification, num_labels=2,
                       id2label={0: "bad", 1: "good"}, label2id={"bad": 0, "good": 1})
    model.config.pad_token_id = tokenizer.pad_token_id
    # `sources` stays in the datasets for step_metrics; Trainer drops it from the batches (remove_unused_columns).
    return Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation,
                   processing_class=tokenizer, data_collator=DataCollatorForTokenClassification(tokenizer),
                   callbacks=callbacks)


def auroc(scores: list[float], labels: list[int]) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties count half); None when one class is missing."""
    scores_array, labels_array = np.asarray(scores, dtype=float), np.asarray(labels) == 1
    positives, negatives = int(labels_array.sum()), int((~labels_array).sum())
    if not positives or not negatives:
        return None
    _, inverse, counts = np.unique(scores_array, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]  # 1-based, ties share their mean rank
    return float((ranks[labels_array].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def _summary(probabilities: list[float], labels: list[int]) -> dict:
    right = sum((p > 0.5) == bool(y) for p, y in zip(probabilities, labels))
    low, high = wilson_interval(right, len(labels))
    return {"steps": len(labels), "good": sum(labels), "bad": len(labels) - sum(labels),
            "accuracy": right / len(labels) if labels else None, "accuracy_ci95": [round(low, 4), round(high, 4)],
            "auroc": auroc(probabilities, labels)}


def step_metrics(model, dataset: Dataset) -> dict:
    """Held-out step accuracy (P(good) > 0.5 against the label) and AUROC, in all and per label source."""
    import torch

    device = next(model.parameters()).device
    model.eval()
    probabilities, labels, sources = [], [], []
    for row in dataset:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row["input_ids"]], device=device)).logits[0]
        positions = [j for j, label in enumerate(row["labels"]) if label != IGNORE]
        probabilities += logits[positions].float().softmax(-1)[:, 1].tolist()
        labels += [row["labels"][j] for j in positions]
        sources += row["sources"]
    by_source: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for p, y, s in zip(probabilities, labels, sources):
        by_source[s][0].append(p)
        by_source[s][1].append(y)
    return {**_summary(probabilities, labels),
            "by_label_source": {s: _summary(*pair) for s, pair in sorted(by_source.items())}}


class ProcessRewardModel:
    """A trained process reward model: P(good) per assistant step, and one score per trajectory."""

    def __init__(self, model, tokenizer, max_length: int | None = None, aggregate: str = "min"):
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}, not {aggregate!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.aggregate = aggregate

    @classmethod
    def load(cls, path: str, max_length: int | None = None, aggregate: str = "min") -> ProcessRewardModel:
        from transformers import AutoTokenizer

        return cls(AutoModelForTokenClassification.from_pretrained(path), AutoTokenizer.from_pretrained(path),
                   max_length, aggregate)

    def step_scores(self, conversation: list[dict]) -> list[float]:
        """P(good) at the end of each assistant step that fits max_length (steps that carry no loss,
        where the conversation says, are context and not scored)."""
        import torch

        # Every step is a candidate; label 1 only marks where to read the score.
        messages = [{"role": m["role"], "content": m["content"],
                     "label": 1 if m["role"] == "assistant" and m.get("loss", True) else None} for m in conversation]
        encoded = step_tokens(self.tokenizer, messages, self.max_length)
        if encoded is None:
            return []
        device = next(self.model.parameters()).device
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([encoded["input_ids"]], device=device)).logits[0]
        positions = [j for j, label in enumerate(encoded["labels"]) if label != IGNORE]
        return logits[positions].float().softmax(-1)[:, 1].tolist()

    def score(self, conversations: list[list[dict]]) -> list[float | None]:
        """One score per conversation: the lowest (`min`), mean or last step score; None with no step."""
        out: list[float | None] = []
        for conversation in conversations:
            steps = self.step_scores(conversation)
            if not steps:
                out.append(None)
            elif self.aggregate == "min":
                out.append(min(steps))
            elif self.aggregate == "mean":
                out.append(sum(steps) / len(steps))
            else:
                out.append(steps[-1])
        return out


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(ProcessRewardTrainConfig, argv)
    trainer = build_trainer(data_args, training_args, model_args)
    metrics = run(trainer, training_args)
    if trainer.eval_dataset is not None:
        held_out = step_metrics(trainer.model, trainer.eval_dataset)
        write_json(os.path.join(training_args.output_dir, "step_metrics.json"), held_out)
        logger.info("held-out steps: %s", {k: v for k, v in held_out.items() if k != "by_label_source"})
        metrics["step_metrics"] = held_out
    mix = Counter(source for row in trainer.train_dataset["sources"] for source in row)
    logger.info("PRM train label sources: %s", dict(mix))
    return metrics
