"""DPO on the `preference` config: conversational prompt, chosen and rejected message lists."""
from __future__ import annotations

import logging

from datasets import Dataset
from trl import DPOTrainer, get_peft_config

from trajforge.training.arguments import DPOTrainConfig, parse
from trajforge.training.common import load_model, load_splits, load_tokenizer, run

logger = logging.getLogger(__name__)


def fit_pairs(dataset: Dataset, tokenizer, max_length: int | None) -> Dataset:
    """Drop, and count, pairs longer than max_length. TRL keeps the start of a too-long pair, which
    for agent prompts (long instructions, many turns) cuts away the very replies being compared."""
    if max_length is None:
        return dataset

    def fits(row: dict) -> bool:
        return all(len(tokenizer.apply_chat_template(row["prompt"] + row[side], tokenize=True,
                                                     return_dict=True)["input_ids"]) <= max_length
                   for side in ("chosen", "rejected"))

    kept = dataset.filter(fits)
    if len(kept) < len(dataset):
        logger.warning("Preference pairs: %d of %d longer than max_length=%d dropped",
                       len(dataset) - len(kept), len(dataset), max_length)
    if not len(kept):
        raise ValueError(f"no preference pair fits max_length={max_length}")
    return kept


def build_trainer(data_args, training_args: DPOTrainConfig, model_args, callbacks=None) -> DPOTrainer:
    tokenizer = load_tokenizer(model_args, training_args)
    train, evaluation = load_splits(data_args, "preference", training_args.seed)
    # Only the pair columns: TRL's collator would otherwise try to tensorize provenance strings.
    pair = ["prompt", "chosen", "rejected"]
    train = fit_pairs(train.select_columns(pair), tokenizer, training_args.max_length)
    if evaluation is not None:
        evaluation = fit_pairs(evaluation.select_columns(pair), tokenizer, training_args.max_length)
    return DPOTrainer(model=load_model(model_args, training_args), args=training_args, train_dataset=train,
                      eval_dataset=evaluation, processing_class=tokenizer,
                      peft_config=get_peft_config(model_args), callbacks=callbacks)


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(DPOTrainConfig, argv)
    return run(build_trainer(data_args, training_args, model_args), training_args)
