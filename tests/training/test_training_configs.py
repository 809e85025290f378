"""Every shipped config parses into its TRL-based dataclasses; the launchers reject bad input."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")

from trajforge.training.arguments import (  # noqa: E402
    DPOTrainConfig,
    GRPOTrainConfig,
    ProcessRewardTrainConfig,
    RewardTrainConfig,
    RLOOTrainConfig,
    SFTTrainConfig,
    parse,
)
from trajforge.training.cli import main  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "training" / "configs"
CLASSES = {"sft": SFTTrainConfig, "grpo": GRPOTrainConfig, "dpo": DPOTrainConfig, "rloo": RLOOTrainConfig,
           "rm": RewardTrainConfig, "prm": ProcessRewardTrainConfig}


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_config_parses(path: Path):
    trainer = path.name.split("_")[0]
    # The GPU recipes ask for bf16, which TrainingArguments refuses on a machine without a GPU.
    with warnings.catch_warnings():
        # A deprecated key (transformers 5.24: `gradient_checkpointing` -> `activation_checkpointing`) fails.
        warnings.filterwarnings("error", message=".*deprecated", category=FutureWarning)
        data_args, training_args, model_args = parse(CLASSES[trainer], [
            "--config", str(path), "--bf16", "false", "--model_name_or_path", "m", "--dataset_name", "d"])
    assert isinstance(training_args, CLASSES[trainer])
    expected = {"sft": "sft", "grpo": "grpo", "dpo": "preference", "rloo": "grpo", "rm": "preference",
                "prm": "step_labels"}[trainer]
    if getattr(training_args, "environments", None):
        expected = "grpo_env"  # whole episodes in the environments
        assert training_args.max_tool_calling_iterations == training_args.max_turns
        assert training_args.max_concurrent_envs >= (training_args.per_device_train_batch_size
                                                     * training_args.steps_per_generation)
    assert data_args.dataset_config == expected
    if trainer in ("grpo", "rloo"):
        assert len(training_args.reward_weights) == len(training_args.reward_funcs)


def test_recipes_name_the_model_and_the_hub_dataset():
    recipe = yaml.safe_load((CONFIGS / "sft_qwen2.5-1.5b.yaml").read_text())
    assert recipe["model_name_or_path"] == "Qwen/Qwen2.5-1.5B-Instruct" and recipe["bf16"] is True
    assert recipe["dataset_name"].count("/") == 1  # a Hub repo id, not a local folder


@pytest.mark.parametrize("name, kind", [("zero3.yaml", "DEEPSPEED"), ("fsdp.yaml", "FSDP")])
def test_accelerate_configs(name, kind):
    config = yaml.safe_load((CONFIGS / "accelerate" / name).read_text())
    assert config["distributed_type"] == kind and config["mixed_precision"] == "bf16"


def test_launcher_rejects_unknown_trainers_and_missing_arguments(capsys):
    assert main([]) == 2 and main(["ppo"]) == 2
    err = capsys.readouterr().err
    assert "usage" in err and "unknown trainer 'ppo'; known: dpo, grpo, prm, rloo, rm, sft" in err
    with pytest.raises(SystemExit):
        parse(SFTTrainConfig, ["--config", str(CONFIGS / "sft_tiny.yaml"), "--model_name_or_path", "m"])


@pytest.mark.parametrize("trainer", sorted(CLASSES))
def test_short_help_lists_real_options(trainer):
    """`trajforge train X --help` is written by hand (it must not wait for TRL): each flag it shows is a field."""
    from trl import ModelConfig, TrlParser

    from trajforge.training.arguments import DataArguments
    from trajforge.training.cli import options

    parser = TrlParser((DataArguments, CLASSES[trainer], ModelConfig))
    known = {flag for action in parser._actions for flag in action.option_strings}
    shown = {flag for flag, _, _ in options(trainer)} - {"--config"}  # --config is TrlParser's own
    assert shown <= known, shown - known


def test_environment_settings_come_as_json_on_the_command_line():
    _, training_args, _ = parse(GRPOTrainConfig, [
        "--config", str(CONFIGS / "grpo_env_tiny.yaml"), "--model_name_or_path", "m", "--dataset_name", "d",
        "--env_settings", '{"db": {}, "os": {"step_timeout": 3}}', "--environments", "db", "os"])
    assert training_args.env_settings == {"db": {}, "os": {"step_timeout": 3}}
    assert training_args.environments == ["db", "os"]
