"""SFT on the `sft` config: multi-turn, loss only on assistant turns whose `loss` flag is set
(and, with `loss_on: critical`, that `trajforge select-steps` flagged critical)."""
from __future__ import annotations

import os

from trl import SFTTrainer, get_peft_config

from trajforge.training.arguments import SFTTrainConfig, parse
from trajforge.training.common import load_model, load_splits, load_tokenizer, run
from trajforge.training.data import prepare_sft


def build_trainer(data_args, training_args: SFTTrainConfig, model_args, callbacks=None) -> SFTTrainer:
    """The trainer on the prepared rows. What preparation kept, cut and dropped (and why) is printed
    and saved with the run's metrics (`data_results.json`, `all_results.json`: `sft_train_*`, `sft_eval_*`)."""
    tokenizer = load_tokenizer(model_args, training_args)
    train, evaluation = load_splits(data_args, "sft", training_args.seed)
    train, stats = prepare_sft(train, tokenizer, training_args.max_length, training_args.dataset_num_proc,
                               training_args.loss_on, training_args.action_format)
    counts = stats.metrics("sft_train")
    if evaluation is not None:
        evaluation, eval_stats = prepare_sft(evaluation, tokenizer, training_args.max_length,
                                             training_args.dataset_num_proc, training_args.loss_on, training_args.action_format)
        counts.update(eval_stats.metrics("sft_eval"))
    trainer = SFTTrainer(model=load_model(model_args, training_args), args=training_args, train_dataset=train,
                         eval_dataset=evaluation, processing_class=tokenizer,
                         peft_config=get_peft_config(model_args), callbacks=callbacks)
    os.makedirs(training_args.output_dir, exist_ok=True)
    trainer.log_metrics("data", counts)
    trainer.save_metrics("data", counts)
    return trainer


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(SFTTrainConfig, argv)
    return run(build_trainer(data_args, training_args, model_args), training_args)
