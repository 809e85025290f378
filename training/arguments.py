"""The configs: TRL's, extended with what agent trajectories need, parsed from YAML + CLI.

Like open-r1, each launcher parses (DataArguments, <Trainer>Config, ModelConfig) with TRL's
TrlParser: `--config file.yaml` sets the values, any `--field value` on the command line wins.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from trl import DPOConfig, GRPOConfig, ModelConfig, SFTConfig, TrlParser
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
    loss_on: str = field(
        default="all", metadata={"help": "Assistant turns that carry loss: `all` (every turn whose loss flag is "
                                         "set) or `critical` (only those `trajforge select-steps` flagged, ATLaS).",
                                 "choices": ["all", "critical"]})


@dataclass
class GRPOTrainConfig(GRPOConfig):
    reward_funcs: list[str] = field(
        default_factory=lambda: ["format", "tag_count", "accuracy"],
        metadata={"help": "Reward names from training.rewards.REWARDS; weights in `reward_weights`."})
    max_prompt_tokens: int | None = field(
        default=None,
        metadata={"help": "Drop (and count) prompts longer than this: cutting an agent prompt loses its "
                          "instructions, and TRL 1.x has no prompt truncation of its own."})


@dataclass
class DPOTrainConfig(DPOConfig):
    """DPOConfig on the `preference` release config (conversational prompt/chosen/rejected)."""


def parse(config_cls: type, argv: list[str] | None):
    """(data_args, training_args, model_args) from `--config YAML` and command-line overrides."""
    parser = TrlParser((DataArguments, config_cls, ModelConfig))
    data_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    if not data_args.dataset_name:
        parser.error("--dataset_name (Hub repo id or local build folder) is required")
    if not model_args.model_name_or_path:
        parser.error("--model_name_or_path is required")
    return data_args, training_args, model_args
