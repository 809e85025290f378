"""GRPO on the `grpo` config (agent prompts up to the first action, scored by the reward registry),
or, with `environments`, on the `grpo_env` config: whole episodes in our environments, the model
calling their actions as tools (TRL's `environment_factory`), scored by the environment."""
from __future__ import annotations

import logging

from datasets import Dataset
from trl import GRPOTrainer, get_peft_config

from trajforge.training.arguments import GRPOTrainConfig, parse
from trajforge.training.common import load_model, load_splits, load_tokenizer, run
from trajforge.training.environments import make_factories, tool_schemas
from trajforge.training.rewards import get_rewards

logger = logging.getLogger(__name__)


def prompt_tokens(tokenizer, prompt: list[dict], tools: list[dict] | None = None) -> int:
    """The prompt's length as TRL renders it: the chat template with the generation prompt and, in
    the environments, the environment's tool schemas (often most of the prompt)."""
    return len(tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])


def select_counted(dataset: Dataset, keep: list[int], dropped: str) -> Dataset:
    """The rows in `keep`; the others are counted in a warning ("N of M <dropped>")."""
    if len(keep) < len(dataset):
        logger.warning("GRPO data: %d of %d %s", len(dataset) - len(keep), len(dataset), dropped)
    if not keep:
        raise ValueError(f"no GRPO row left: every one of them {dropped}")
    return dataset.select(keep)


def limit_prompts(dataset: Dataset, tokenizer, max_prompt_tokens: int | None, with_tools: bool = False) -> Dataset:
    """Drop prompts longer than max_prompt_tokens, counting them: a cut prompt loses its instructions.
    `with_tools`: rows of the `grpo_env` config, counted with their environment's tools."""
    if max_prompt_tokens is None:
        return dataset
    environments = dataset["environment"] if with_tools else [None] * len(dataset)
    schemas = {name: tool_schemas(name) for name in set(environments) if name is not None}
    keep = [i for i, (p, name) in enumerate(zip(dataset["prompt"], environments))
            if prompt_tokens(tokenizer, p, schemas.get(name)) <= max_prompt_tokens]
    return select_counted(dataset, keep, f"prompts longer than max_prompt_tokens={max_prompt_tokens} dropped")


def keep_environments(dataset: Dataset | None, environments: list[str]) -> Dataset | None:
    """Only the rows of the configured environments (TRL fails on a row whose environment has no
    factory); the others are counted."""
    if dataset is None:
        return None
    if "environment" not in dataset.column_names:
        raise ValueError("`environments` needs the `grpo_env` config (an `environment` column per row)")
    keep = [i for i, name in enumerate(dataset["environment"]) if name in environments]
    return select_counted(dataset, keep, f"tasks for environments other than {environments} dropped")


def environment_factories(training_args: GRPOTrainConfig) -> dict | None:
    if not training_args.environments:
        return None
    per_process = training_args.per_device_train_batch_size * training_args.steps_per_generation
    if training_args.max_concurrent_envs is not None and training_args.max_concurrent_envs < per_process:
        raise ValueError(f"max_concurrent_envs={training_args.max_concurrent_envs} is below the {per_process} "
                         "rollouts one generation batch runs at once (per_device_train_batch_size x "
                         "steps_per_generation)")
    return make_factories(training_args.environments, training_args.env_settings,
                          training_args.max_concurrent_envs, training_args.max_turns)


def prompt_rows(data_args, training_args, tokenizer, config: str,
                environments: list[str] | None = None) -> tuple[Dataset, Dataset | None]:
    """Train and eval prompts of an online RL run (GRPO, RLOO): of `environments` only when given,
    no longer than max_prompt_tokens; the reward weights checked against the rewards."""
    train, evaluation = load_splits(data_args, config, training_args.seed)
    if environments:
        train, evaluation = (keep_environments(d, environments) for d in (train, evaluation))
    train = limit_prompts(train, tokenizer, training_args.max_prompt_tokens, bool(environments))
    if evaluation is not None:
        evaluation = limit_prompts(evaluation, tokenizer, training_args.max_prompt_tokens, bool(environments))
    if training_args.reward_weights is not None and len(training_args.reward_weights) != len(training_args.reward_funcs):
        raise ValueError(f"reward_weights {training_args.reward_weights} do not match reward_funcs "
                         f"{training_args.reward_funcs}")
    return train, evaluation


def build_trainer(data_args, training_args: GRPOTrainConfig, model_args, callbacks=None) -> GRPOTrainer:
    tokenizer = load_tokenizer(model_args, training_args)
    factories = environment_factories(training_args)
    train, evaluation = prompt_rows(data_args, training_args, tokenizer, "grpo_env" if factories else "grpo",
                                    training_args.environments if factories else None)
    return GRPOTrainer(model=load_model(model_args, training_args), reward_funcs=get_rewards(training_args.reward_funcs),
                       args=training_args, train_dataset=train, eval_dataset=evaluation,
                       processing_class=tokenizer, peft_config=get_peft_config(model_args), callbacks=callbacks,
                       environment_factory=factories)


def close_environments(trainer: GRPOTrainer) -> None:
    """Close every sandbox the run's environments still hold (TRL never closes them)."""
    for factory in (trainer.environment_factories or {}).values():
        factory.close_all()


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(GRPOTrainConfig, argv)
    trainer = build_trainer(data_args, training_args, model_args)
    try:
        return run(trainer, training_args)
    finally:
        close_environments(trainer)
