"""DPO on the `preference` config: conversational prompt, chosen and rejected message lists."""
from __future__ import annotations

from trl import DPOTrainer, get_peft_config

from training.arguments import DPOTrainConfig, parse
from training.common import load_model, load_splits, load_tokenizer, run


def build_trainer(data_args, training_args: DPOTrainConfig, model_args, callbacks=None) -> DPOTrainer:
    tokenizer = load_tokenizer(model_args, training_args)
    train, evaluation = load_splits(data_args, "preference", training_args.seed)
    # Only the pair columns: TRL's collator would otherwise try to tensorize provenance strings.
    pair = ["prompt", "chosen", "rejected"]
    train = train.select_columns(pair)
    evaluation = evaluation.select_columns(pair) if evaluation is not None else None
    return DPOTrainer(model=load_model(model_args, training_args), args=training_args, train_dataset=train,
                      eval_dataset=evaluation, processing_class=tokenizer,
                      peft_config=get_peft_config(model_args), callbacks=callbacks)


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(DPOTrainConfig, argv)
    return run(build_trainer(data_args, training_args, model_args), training_args)
