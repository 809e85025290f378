"""SFT label masks from per-turn boundaries, turn-aware truncation, the eval split, loading."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.support.tiny_model import (  # noqa: E402
    CHATML,
    END_OF_TURN,
    HEADERS,
    build_tokenizer,
    fixture_texts,
    labelled_runs,
    read_config,
)
from trajforge.training.data import (  # noqa: E402
    IGNORE,
    TemplateError,
    load_release,
    prepare_sft,
    tokenize_trajectory,
    train_eval_split,
    trajectory_group,
    turn_boundaries,
)

# Rewrites earlier assistant turns once a later message exists (as templates that drop past
# reasoning do): per-turn masking cannot be derived from it and must be refused.
REWRITING = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n...<|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def sft_rows(fixtures_build: Path) -> list[dict]:
    return read_config(fixtures_build, "sft")


@pytest.fixture(scope="module")
def tokenizer(fixtures_build: Path):
    return build_tokenizer(fixture_texts(fixtures_build))


def trained_turns(row: dict) -> list[str]:
    return [t["content"] for t in row["conversations"] if t["role"] == "assistant" and t["loss"]]


@pytest.mark.parametrize("template", [CHATML, HEADERS], ids=["chatml", "plain_headers"])
def test_label_mask_is_exactly_the_assistant_turns_with_loss(tokenizer, sft_rows, template):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    checked_untrained = 0
    for row in sft_rows:
        out = tokenize_trajectory(tok, row["conversations"], max_length=None)
        expected = [content + END_OF_TURN[template] for content in trained_turns(row)]
        assert labelled_runs(tok, out["labels"]) == expected, row["id"]
        assert not out["truncated"]
        assert [i for i, label in zip(out["input_ids"], out["labels"]) if label != IGNORE] == \
            [label for label in out["labels"] if label != IGNORE]
        checked_untrained += sum(t["role"] == "assistant" and not t["loss"] for t in row["conversations"])
    # The fixtures hold the no-loss turns the mask must skip ("OK." acks, one-shot demos).
    assert checked_untrained > 50


def test_template_that_rewrites_earlier_turns_is_refused(tokenizer, sft_rows):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = REWRITING
    messages = [{"role": t["role"], "content": t["content"]} for t in sft_rows[0]["conversations"]]
    with pytest.raises(TemplateError, match="rewrites earlier turns"):
        turn_boundaries(tok, messages)


def test_truncation_keeps_whole_turns_and_counts_what_it_cut(tokenizer, sft_rows):
    from datasets import Dataset

    max_length = 600
    data, stats = prepare_sft(Dataset.from_list(sft_rows), tokenizer, max_length)
    assert stats.kept + stats.dropped_too_long + stats.dropped_no_loss == stats.rows == len(sft_rows)
    assert stats.truncated > 0 and stats.dropped_too_long > 0
    assert stats.kept == len(data) and len(stats.dropped_ids) == stats.dropped_too_long + stats.dropped_no_loss
    by_id = {row["id"]: row for row in sft_rows}
    kept_rows = [by_id[i] for i in by_id if i not in set(stats.dropped_ids)]
    cut = 0
    for row, prepared in zip(kept_rows, data):
        assert len(prepared["input_ids"]) <= max_length
        runs = labelled_runs(tokenizer, prepared["labels"])
        expected = [content + "<|im_end|>\n" for content in trained_turns(row)]
        assert runs == expected[:len(runs)], row["id"]  # whole turns, never a part of one
        cut += len(runs) < len(expected)
    assert cut == stats.truncated
    assert stats.trained_tokens == sum(sum(label != IGNORE for label in r["labels"]) for r in data)


def test_eval_split_is_stable_and_keeps_repeats_together(fixtures_build):
    data = load_release(str(fixtures_build), "sft")
    assert list(data) == ["train"] and len(data["train"]) == len(read_config(fixtures_build, "sft"))
    train, evaluation = train_eval_split(data, "train", "test", 0.2, seed=0)
    again_train, _ = train_eval_split(data, "train", "test", 0.2, seed=0)
    assert train["id"] == again_train["id"]
    train_groups = {trajectory_group(i) for i in train["id"]}
    eval_groups = {trajectory_group(i) for i in evaluation["id"]}
    assert not train_groups & eval_groups
    assert len(train) + len(evaluation) == len(data["train"]) and 0 < len(evaluation) < len(train)
    # The fixtures do hold repeated trajectories (`~n` ids), so the grouping is exercised.
    assert any("~" in i for i in data["train"]["id"])


def test_dpo_pairs_that_do_not_fit_are_dropped_not_cut(tokenizer, fixtures_build):
    from datasets import Dataset

    from trajforge.training.dpo import fit_pairs

    pairs = Dataset.from_list(read_config(fixtures_build, "preference")).select_columns(["prompt", "chosen", "rejected"])
    kept = fit_pairs(pairs, tokenizer, 512)
    assert 0 < len(kept) < len(pairs)
    for row in kept:
        for side in ("chosen", "rejected"):
            rendered = tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=True, return_dict=True)
            assert len(rendered["input_ids"]) <= 512
