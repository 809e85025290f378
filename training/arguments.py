"""The configs: TRL's, extended with what agent trajectories need, parsed from YAML + CLI.

Like open-r1, each launcher parses (DataArguments, <Trainer>Config, ModelConfig) with TRL's
TrlParser: `--config file.yaml` sets the values, any `--field value` on the command line wins.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from transformers import TrainingArguments
from trl import DPOConfig, GRPOConfig, ModelConfig, RewardConfig, RLOOConfig, SFTConfig, TrlParser
from trl.scripts.utils import ScriptArguments


@dataclass
class DataArguments(ScriptArguments):
    """Where the dataset comes from: a Hub repo id, or a local `trajforge build` output folder.

    `dataset_config` is the release config (`sft`, `grpo`, `preference`); each launcher fills in
    its own when left empty. When the config has no `dataset_test_split`, `eval_fraction` of the
    trajectories (grouped by upstream id, so repeats never straddle the split) become the eval set.
    """
    dataset_revision: str | None = field(default=None, metadata={"help": "Hub revision (tag, branch, commit)."})
    eval_fraction: float = field(default=0.0, metadata={"help": "Eval share carved from train when no test split."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many training rows."})


@dataclass
class SFTTrainConfig(SFTConfig):
    """SFTConfig; `max_length` is applied by our turn-aware truncation before TRL sees the rows."""
    action_format: str = field(
        default="react",
        metadata={"help": "`react`: the trajectories' text as released; `tools`: actions as tool calls and "
                          "observations as tool turns, the format of GRPO in the environments (`environments`).",
                  "choices": ["react", "tools"]})
    loss_on: str = field(
        default="all", metadata={"help": "Assistant turns that carry loss: `all` (every turn whose loss flag is "
                                         "set) or `critical` (only those `trajforge select-steps` flagged, ATLaS).",
                                 "choices": ["all", "critical"]})


@dataclass
class PromptRewards:
    """What the online RL trainers (GRPO, RLOO) add to TRL's config: the reward registry and the prompt limit."""
    reward_funcs: list[str] = field(
        default_factory=lambda: ["format", "tag_count", "accuracy"],
        metadata={"help": "Reward names from trajforge.training.rewards.REWARDS, or `rm=PATH` / `prm=PATH` for a "
                          "trained (process) reward model; weights in `reward_weights`."})
    max_prompt_tokens: int | None = field(
        default=None,
        metadata={"help": "Drop (and count) prompts longer than this, counted as TRL renders them (with the "
                          "environment's tool schemas under `environments`): cutting an agent prompt loses its "
                          "instructions, and TRL 1.x has no prompt truncation of its own."})


@dataclass
class GRPOTrainConfig(GRPOConfig, PromptRewards):
    environments: list[str] | None = field(
        default=None,
        metadata={"help": "Run whole episodes in these environments (os, db, agentgym) on the `grpo_env` config: "
                          "the model calls the environment's actions as tools and the environment's score is a "
                          "reward (weight 1) beside `reward_funcs`. Rows of other environments are dropped (counted)."})
    env_settings: dict | str | None = field(
        default=None,
        metadata={"help": "Per environment, its settings (JSON on the command line), e.g. {\"os\": "
                          "{\"step_timeout\": 10}, \"agentgym\": {\"base_url\": \"http://127.0.0.1:36001\"}}."})
    max_turns: int | None = field(
        default=None,
        metadata={"help": "Actions per episode; also TRL's max_tool_calling_iterations when that is unset."})
    max_concurrent_envs: int | None = field(
        default=None,
        metadata={"help": "Open sandboxes per environment and process at most; must cover the rollouts of one "
                          "generation batch (per_device_train_batch_size x steps_per_generation)."})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.env_settings, str):
            self.env_settings = json.loads(self.env_settings)
        if self.environments and self.max_turns is not None and self.max_tool_calling_iterations is None:
            self.max_tool_calling_iterations = self.max_turns


@dataclass
class DPOTrainConfig(DPOConfig):
    """DPOConfig on the `preference` release config (conversational prompt/chosen/rejected)."""


@dataclass
class RLOOTrainConfig(RLOOConfig, PromptRewards):
    """RLOOConfig on the `grpo` config, with GRPO's reward registry. TRL 1.16's RLOOTrainer runs no
    environment (no `environment_factory`): whole episodes in the environments are GRPO's."""


@dataclass
class RewardTrainConfig(RewardConfig):
    """RewardConfig on the `preference` config, plus the step pairs of tree search."""
    step_pairs: list[str] | None = field(
        default=None,
        metadata={"help": "Parquet files or folders of step pairs (a synth folder's `search/step_pairs`, TRL's "
                          "conversational preference format) trained on beside the release config."})


@dataclass
class ProcessRewardTrainConfig(TrainingArguments):
    """A process reward model: transformers' Trainer on a token-classification head (TRL 1.16 has no
    PRM trainer), on the `step_labels` config or on trajectory records (labels derived as the build does)."""
    max_length: int | None = field(
        default=1024, metadata={"help": "Tokens per trajectory; it is cut after the last labelled step that fits."})
    step_values: list[str] | None = field(
        default=None,
        metadata={"help": "Parquet files or folders of tree-search step values (a synth folder's "
                          "`search/step_values`): each step is a label, good when its value exceeds "
                          "`step_value_threshold`."})
    step_value_threshold: float = field(
        default=0.0, metadata={"help": "A step is good when its Monte Carlo value is above this (0: any rollout "
                                       "through it succeeded, Math-Shepherd's hard estimate)."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenizing."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models that ship their own code."})
    chat_template_path: str | None = field(default=None, metadata={"help": "A Jinja chat template file."})


def parse(config_cls: type, argv: list[str] | None):
    """(data_args, training_args, model_args) from `--config YAML` and command-line overrides."""
    parser = TrlParser((DataArguments, config_cls, ModelConfig))
    data_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    if not data_args.dataset_name:
        parser.error("--dataset_name (Hub repo id or local build folder) is required")
    if not model_args.model_name_or_path:
        parser.error("--model_name_or_path is required")
    return data_args, training_args, model_args
