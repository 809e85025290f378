"""RLOO on the `grpo` config: GRPO's prompts and reward registry, REINFORCE with a leave-one-out baseline.

TRL 1.16 has no PPO trainer; RLOO (Ahmadian et al., 2024) is its other online RL algorithm. Its
RLOOTrainer takes no `environment_factory`, so whole episodes in the environments stay GRPO's; RLOO
trains on single agent turns, scored by the same reward registry (`env` replays the turn's action in
its environment, `rm=PATH` / `prm=PATH` ask a trained reward model).
"""
from __future__ import annotations

from trl import RLOOTrainer, get_peft_config

from trajforge.training.arguments import RLOOTrainConfig, parse
from trajforge.training.common import load_model, load_tokenizer, run
from trajforge.training.grpo import prompt_rows
from trajforge.training.rewards import get_rewards


def build_trainer(data_args, training_args: RLOOTrainConfig, model_args, callbacks=None) -> RLOOTrainer:
    tokenizer = load_tokenizer(model_args, training_args)
    train, evaluation = prompt_rows(data_args, training_args, tokenizer, "grpo")
    return RLOOTrainer(model=load_model(model_args, training_args), reward_funcs=get_rewards(training_args.reward_funcs),
                       args=training_args, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer,
                       peft_config=get_peft_config(model_args), callbacks=callbacks)


def main(argv: list[str] | None = None) -> dict:
    data_args, training_args, model_args = parse(RLOOTrainConfig, argv)
    return run(build_trainer(data_args, training_args, model_args), training_args)
