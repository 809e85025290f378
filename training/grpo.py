"""GRPO on the `grpo` config: agent prompts up to the first action, scored by the reward registry."""
from __future__ import annotations

import logging

from datasets import Dataset
from trl import GRPOTrainer, get_peft_config

from trajforge.training.arguments import GRPOTrainConfig, parse
from trajforge.training.common import load_model, load_splits, load_tokenizer, run
from trajforge.training.rewards import get_rewards

logger = logging.getLogger(__name__)


def prompt_tokens(tokenizer, prompt: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])


def limit_prompts(dataset: Dataset, tokenizer, max_prompt_tokens: int | None) -> Dataset:
    """Drop prompts longer than max_prompt_tokens, counting them: a cut prompt loses its instructions."""
    if max_prompt_tokens is None:
        return dataset
    keep = [i for i, p in enumerate(dataset["prompt"]) if prompt_tokens(tokenizer, p) <= max_prompt_tokens]
    if len(keep) < len(dataset):
        logger.warning("GRPO data: %d of %d prompts longer than max_prompt_tokens=%d dropped",
                       len(dataset) - len(keep), len(dataset), max_prompt_tokens)
    if not keep:
        raise ValueError(f"no GRPO prompt fits max_prompt_tokens={max_prompt_tokens}")
    return dataset.select(keep)


def build_trainer(data_args, training_args: GRPOTrainConfig, model_args, callbacks=None) -> GRPOTrainer:
    tokenizer = load_tokenizer(model_args, training_args)
    train, evaluation = load_splits(data_args, "grpo", training_args.seed)
    train = limit_prompts(train, tokenizer, training_args.max_prompt_tokens)
    if evaluation is not None:
        evaluation = limit_prompts(evaluation, tokenizer, training_args.max_prompt_tokens)
    if training_args.reward_weights is not None and len(training_args.reward_weights) != len(training_args.reward_funcs):
        raise ValueError(f"reward_weights {training_args.reward_weights} do not match reward_funcs "
                         f"{training_args.reward_funcs}")
    return GRPOTrainer(model=load_model(model_args, training_args), reward_funcs=get_rewards(training_args.reward_funcs),
                       args=training_args, train_dataset=train, eval_dataset=evaluation,
                       processing_class=tokenizer, peft_config=get_peft_config(model_args), callbacks=callbacks)


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(GRPOTrainConfig, argv)
    return run(build_trainer(data_args, training_args, model_args), training_args)
