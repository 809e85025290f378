"""Dispatch `sft|grpo|dpo` to its launcher; heavy imports happen only for the chosen one.

`--help` answers from here, without importing TRL: a short page of the options the README's
examples use. `--help-all` hands `--help` to TRL's parser, which lists every config field.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from trajforge.pipeline.registry import Registry, UnknownName

TRAINERS: Registry[str] = Registry("trainer", {"sft": "trajforge.training.sft", "grpo": "trajforge.training.grpo",
                                              "dpo": "trajforge.training.dpo", "rloo": "trajforge.training.rloo",
                                              "rm": "trajforge.training.reward_model",
                                              "prm": "trajforge.training.process_reward_model"})
DESCRIPTIONS = {
    "sft": "SFT on the `sft` config: multi-turn, loss only on assistant turns whose `loss` flag is set",
    "grpo": "GRPO on the `grpo` config: agent prompts up to the first action, scored by the reward registry",
    "dpo": "DPO on the `preference` config: conversational prompt, chosen and rejected message lists",
    "rloo": "RLOO on the `grpo` config: the same prompts and reward registry as GRPO, leave-one-out baseline",
    "rm": "outcome reward model (RewardTrainer) on the `preference` config (+ tree-search step pairs)",
    "prm": "process reward model: a token classifier over the end of each step, on the `step_labels` config",
}
DEFAULT_CONFIGS = {"sft": "sft", "grpo": "grpo", "dpo": "preference", "rloo": "grpo", "rm": "preference",
                   "prm": "step_labels"}
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
USAGE = "usage: trajforge train {sft,grpo,dpo,rloo,rm,prm} --config training/configs/<name>.yaml [--field value ...]"

# (flag, metavar, help): the options first shown; tests check each is a real field of the parser.
COMMON_OPTIONS = [
    ("--config", "FILE", "YAML file of config fields; a --field on the command line wins over it"),
    ("--model_name_or_path", "MODEL", "model to start from: Hub model id or local folder"),
    ("--dataset_name", "DATASET", "Hub dataset repo id, or the output folder of `trajforge build`"),
    ("--dataset_config", "NAME", "release config to train on (default: {config})"),
    ("--dataset_revision", "REV", "Hub revision of the dataset (tag, branch, commit)"),
    ("--max_train_samples", "N", "keep at most N training rows"),
    ("--eval_fraction", "F", "share of the trajectories held out for eval when there is no test split"),
    ("--output_dir", "DIR", "where checkpoints and the final model are written"),
    ("--max_steps", "N", "stop after N optimizer steps"),
]
REWARD_OPTIONS = [("--reward_funcs", "NAME [NAME ...]", "reward names from training.rewards.REWARDS, or "
                                                           "rm=PATH / prm=PATH (a trained reward model)"),
                  ("--max_prompt_tokens", "N", "drop (and count) prompts longer than N tokens")]
TRAINER_OPTIONS = {
    "grpo": REWARD_OPTIONS,
    "rloo": REWARD_OPTIONS,
    "rm": [("--step_pairs", "PATH [PATH ...]", "tree-search step pairs (Parquet files or folders) trained on too")],
    "prm": [("--step_values", "PATH [PATH ...]", "tree-search step values (Parquet files or folders) as labels too")],
}


def options(trainer: str) -> list[tuple[str, str, str]]:
    return COMMON_OPTIONS + TRAINER_OPTIONS.get(trainer, [])


def trainers_page() -> str:
    lines = [USAGE, "", "trainers (each on TRL; `trajforge train NAME --help` for its options):"]
    lines += [f"  {name:<6}{DESCRIPTIONS[name]}" for name in TRAINERS]
    return "\n".join(lines)


def trainer_page(trainer: str) -> str:
    configs = sorted(p.relative_to(CONFIG_DIR.parent.parent).as_posix() for p in CONFIG_DIR.glob(f"{trainer}_*.yaml"))
    lines = [f"usage: trajforge train {trainer} --config FILE [--field value ...]", "", DESCRIPTIONS[trainer] + ".",
             "", "main options (every field of the config can be given as --field value):"]
    for flag, metavar, text in options(trainer):
        lines.append(f"  {flag + ' ' + metavar:<34}{text.format(config=DEFAULT_CONFIGS[trainer])}")
    lines.append(f"  {'--help-all':<34}every option: TRL's full list of {trainer.upper()} and model fields")
    lines += ["", "configs: " + ", ".join(configs)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(trainers_page())
        return 0
    if not argv:
        print(trainers_page(), file=sys.stderr)
        return 2
    try:
        TRAINERS[argv[0]]
    except UnknownName as exc:
        print(f"{trainers_page()}\ntrajforge train: error: {exc}", file=sys.stderr)
        return 2
    trainer, rest = argv[0], argv[1:]
    if "-h" in rest or "--help" in rest:
        print(trainer_page(trainer))
        return 0
    if "--help-all" in rest:
        rest = ["--help" if arg == "--help-all" else arg for arg in rest]
    importlib.import_module(TRAINERS[trainer]).main(rest)
    return 0
