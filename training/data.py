"""Datasets for the trainers: loading a release config, the eval split, and SFT label masks.

SFT labels are built here from per-turn boundaries rather than with TRL's `assistant_only_loss`,
which needs `{% generation %}` markers that most chat templates lack. The chat template is
rendered once per prefix of the conversation; the character where each turn starts and ends is
the length of the rendered prefix, so the boundaries are the template's own whatever its markup.
A token is trained on only when it lies inside an assistant turn whose `loss` flag is true (the
turn's text and the template's end-of-turn marker, so the model learns to stop); the header
that opens the turn (`<|im_start|>assistant\\n`) is the generation prompt and stays masked.

`loss_on: critical` (ATLaS) narrows that further to the assistant turns `trajforge select-steps`
flagged `critical`; a turn never judged (`critical` null) carries no loss then, so a record the
selector could not judge is dropped and counted as `dropped_not_judged` (the launcher reports it
with the run's metrics).
"""
from __future__ import annotations

import glob
import hashlib
import logging
import os
import re
from dataclasses import dataclass, field

from datasets import Dataset, DatasetDict, load_dataset

logger = logging.getLogger(__name__)

IGNORE = -100
LOSS_ON = ("all", "critical")


def carries_loss(turn: dict, loss_on: str = "all") -> bool:
    """Whether a turn is trained on: an assistant turn with `loss`, and with `loss_on=critical` flagged critical."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, not {loss_on!r}")
    if turn["role"] != "assistant" or not turn.get("loss"):
        return False
    return loss_on == "all" or turn.get("critical") is True


def load_release(dataset_name: str, config: str, revision: str | None = None) -> DatasetDict:
    """A config of the released dataset: a local build folder or a Hub repo id.

    A local folder is read by globbing `data/<config>/<split>-*.parquet`, which does not depend on
    the dataset card being present; a Hub repo goes through `load_dataset(repo, config)`.
    """
    if os.path.isdir(dataset_name):
        files = sorted(glob.glob(os.path.join(dataset_name, "data", config, "*.parquet")))
        if not files:
            raise FileNotFoundError(f"no parquet shards under {dataset_name}/data/{config}")
        splits: dict[str, list[str]] = {}
        for path in files:
            splits.setdefault(re.split(r"[-.]", os.path.basename(path))[0], []).append(path)
        return load_dataset("parquet", data_files=splits)
    return load_dataset(dataset_name, config, revision=revision)


def trajectory_group(row_id: str) -> str:
    """The upstream trajectory a row comes from: `agentinstruct/db_35~2` -> `agentinstruct/db_35`, and
    `agentinstruct/db_35#neg-wrong_answer#pair` (a pair or step labels of its negative) alike."""
    return re.split(r"[~#]", row_id, maxsplit=1)[0]


def train_eval_split(data: DatasetDict, train_split: str, test_split: str, eval_fraction: float,
                     seed: int = 0) -> tuple[Dataset, Dataset | None]:
    """Train and eval sets. A release test split wins; otherwise a stable hash of the trajectory
    group decides, so reruns give the same split and a repeated trajectory stays on one side."""
    train = data[train_split]
    if test_split in data:
        return train, data[test_split]
    if eval_fraction <= 0:
        return train, None
    if "id" not in train.column_names:
        parts = train.train_test_split(test_size=eval_fraction, seed=seed)
        return parts["train"], parts["test"]

    def in_eval(row_id: str) -> bool:
        digest = hashlib.sha256(f"{seed}:{trajectory_group(row_id)}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction

    flags = [in_eval(i) for i in train["id"]]
    evals = [i for i, f in enumerate(flags) if f]
    if not evals or len(evals) == len(flags):
        raise ValueError(f"eval_fraction={eval_fraction} leaves an empty train or eval set ({len(flags)} rows)")
    return train.select([i for i, f in enumerate(flags) if not f]), train.select(evals)


class TemplateError(ValueError):
    """The chat template does not render a conversation as the concatenation of its prefixes."""


def turn_boundaries(tokenizer, messages: list[dict],
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, per message, the character span it owns in it.

    An assistant message's span starts after the generation prompt (the header the model is given
    at inference) and ends where the next message starts. Templates that rewrite earlier turns
    when a later one is added (for example by dropping past reasoning) break the prefix property
    that per-turn masking needs, and are refused with the turn where it happened.
    """
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    spans, previous_end = [], 0
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:i], tools=tools, tokenize=False, add_generation_prompt=True)
            if not text.startswith(head):
                raise TemplateError(f"turn {i}: the generation prompt is not a prefix of the full rendering")
            start = len(head)
        else:
            start = previous_end
        prefix = tokenizer.apply_chat_template(messages[:i + 1], tools=tools, tokenize=False)
        if not text.startswith(prefix):
            raise TemplateError(f"turn {i}: rendering the first {i + 1} messages is not a prefix of the full "
                                "rendering; this template rewrites earlier turns")
        spans.append((start, len(prefix)))
        previous_end = len(prefix)
    return text, spans


# Why a row is dropped (its `status`), as the warning and the error say it.
DROP_REASONS = {
    "too_long": "even the first trained turn is longer than max_length",
    "no_loss": "no assistant turn carries loss (with loss_on: critical, none is flagged critical)",
    "not_judged": "never judged by `trajforge select-steps` (critical is null; see its select_failures.parquet), "
                  "so no turn carries loss with loss_on: critical",
    "no_tool_call": "an action that maps to no tool call (action_format: tools)",
}


@dataclass
class SFTStats:
    """What preparation did to the rows; nothing is cut or dropped without being counted here."""
    rows: int = 0
    kept: int = 0
    truncated: int = 0          # cut at a turn boundary to fit max_length
    dropped_too_long: int = 0   # even the first trained turn does not fit
    dropped_no_loss: int = 0    # no assistant turn with loss
    dropped_not_judged: int = 0  # loss_on critical: the selector could not judge the record
    dropped_no_tool_call: int = 0  # action_format tools: an action that is no tool call
    trained_tokens: int = 0
    dropped_ids: list[str] = field(default_factory=list, repr=False)

    def drops(self) -> dict[str, int]:
        """Dropped rows per reason (the keys of DROP_REASONS), the reasons that dropped none left out."""
        counts = {reason: getattr(self, f"dropped_{reason}") for reason in DROP_REASONS}
        return {reason: n for reason, n in counts.items() if n}

    def metrics(self, prefix: str) -> dict[str, int]:
        """The counts as run metrics (`<prefix>_rows`, `<prefix>_dropped_not_judged`, ...)."""
        return {f"{prefix}_{name}": getattr(self, name) for name in
                ("rows", "kept", "truncated", *(f"dropped_{r}" for r in DROP_REASONS), "trained_tokens")}


_MESSAGE_KEYS = ("role", "content", "tool_calls", "name")


def tokenize_trajectory(tokenizer, conversations: list[dict], max_length: int | None,
                        tools: list[dict] | None = None, loss_on: str = "all") -> dict | None:
    """input_ids and labels for one trajectory, or None when no trained turn fits.

    Truncation keeps whole turns only: the sequence ends after the last assistant turn that fits
    (observations after it would carry no loss). `truncated` says whether turns were dropped.
    With `tools` the turns are in TRL's tool-calling format (assistant `tool_calls`, `tool` turns).
    """
    messages = [{k: t[k] for k in _MESSAGE_KEYS if t.get(k) is not None} for t in conversations]
    text, spans = turn_boundaries(tokenizer, messages, tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    trained = [(s, e) for (s, e), t in zip(spans, conversations) if carries_loss(t, loss_on)]
    labels = [IGNORE] * len(ids)
    # Walk tokens and trained spans together: both are sorted by position.
    k = 0
    for j, (start, end) in enumerate(offsets):
        while k < len(trained) and trained[k][1] <= start:
            k += 1
        if k < len(trained) and trained[k][0] <= start and end <= trained[k][1]:
            labels[j] = ids[j]
    if all(label == IGNORE for label in labels):
        return None
    truncated = False
    if max_length is not None and len(ids) > max_length:
        # Token index where each trained turn ends; cut after the last one that fits.
        ends = [next((j for j, (s, _) in enumerate(offsets) if s >= e), len(ids)) for _, e in trained]
        fitting = [n for n in ends if n <= max_length]
        if not fitting:
            return None
        ids, labels, truncated = ids[:fitting[-1]], labels[:fitting[-1]], True
    return {"input_ids": ids, "labels": labels, "truncated": truncated}


def tools_rendering(row: dict) -> dict | None:
    """A trajectory as tool calls (`pipeline.envs.tool_calls`), the action format of multi-turn
    GRPO in the environments; None when one of its actions is no tool call."""
    from trajforge.pipeline.envs.tool_calls import environment_of, tool_messages, trajectory_prompt
    from trajforge.training.environments import tool_schemas

    return tool_messages(row, trajectory_prompt(row), tool_schemas(environment_of(row["env"])))


def loss_status(turns: list[dict], loss_on: str) -> str | None:
    """None when a turn carries loss; else why none does: `not_judged` (loss_on critical, a turn
    with loss the selector never judged) or `no_loss`."""
    if any(carries_loss(t, loss_on) for t in turns):
        return None
    if loss_on == "critical" and any(t["role"] == "assistant" and t.get("loss") and t.get("critical") is None
                                     for t in turns):
        return "not_judged"
    return "no_loss"


def _prepare_row(row: dict, tokenizer, max_length: int | None, loss_on: str = "all",
                 action_format: str = "react") -> dict:
    conversations, tools = row["conversations"], None
    if action_format == "tools":
        rendered = tools_rendering(row)
        if rendered is None:
            return {"input_ids": [], "labels": [], "status": "no_tool_call", "trained": 0}
        conversations, tools = rendered["messages"], rendered["tools"]
    # Checked on what is tokenized: a rendering that lost a turn's flags shows here, not as too_long.
    status = loss_status(conversations, loss_on)
    if status is not None:
        return {"input_ids": [], "labels": [], "status": status, "trained": 0}
    out = tokenize_trajectory(tokenizer, conversations, max_length, tools, loss_on)
    if out is None:
        return {"input_ids": [], "labels": [], "status": "too_long", "trained": 0}
    return {"input_ids": out["input_ids"], "labels": out["labels"],
            "status": "truncated" if out["truncated"] else "ok",
            "trained": sum(label != IGNORE for label in out["labels"])}


def prepare_sft(dataset: Dataset, tokenizer, max_length: int | None,
                num_proc: int | None = None, loss_on: str = "all", action_format: str = "react") -> tuple[Dataset, SFTStats]:
    """Tokenized rows with per-turn labels, TRL-ready (`input_ids`, `labels`), and the counts.

    Rendering every prefix is quadratic in the turns of a trajectory, so rows are prepared with
    `Dataset.map` (cached, and parallel with `num_proc`, TRL's `dataset_num_proc`)."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {LOSS_ON}, not {loss_on!r}")
    mapped = dataset.map(_prepare_row, fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "loss_on": loss_on,
                                                  "action_format": action_format},
                         remove_columns=[c for c in dataset.column_names if c != "id"], num_proc=num_proc,
                         desc="Tokenizing trajectories with per-turn labels")
    statuses = mapped["status"]
    ids = mapped["id"] if "id" in mapped.column_names else [str(i) for i in range(len(mapped))]
    stats = SFTStats(rows=len(dataset), truncated=statuses.count("truncated"), trained_tokens=sum(mapped["trained"]),
                     **{f"dropped_{reason}": statuses.count(reason) for reason in DROP_REASONS},
                     dropped_ids=[i for i, s in zip(ids, statuses) if s in DROP_REASONS])
    kept = mapped.filter(lambda status: status in ("ok", "truncated"), input_columns="status")
    stats.kept = len(kept)
    drops = "; ".join(f"{n} dropped: {DROP_REASONS[reason]}" for reason, n in stats.drops().items())
    if stats.truncated or drops:
        logger.warning("SFT data: %d rows, %d kept, %d truncated at a turn boundary to max_length=%s%s",
                       stats.rows, stats.kept, stats.truncated, max_length, f"; {drops}" if drops else "")
    if not stats.kept:
        raise ValueError(f"no SFT row left after preparation (loss_on={loss_on}, action_format={action_format}, "
                         f"max_length={max_length}): of {stats.rows} rows, {drops or 'none dropped'}")
    return kept.select_columns(["input_ids", "labels"]), stats
