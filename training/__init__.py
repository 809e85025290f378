"""SFT, GRPO and DPO launchers on TRL for trajforge's agent-trajectory datasets.

`python -m training sft|grpo|dpo --config training/configs/<name>.yaml [--field value ...]`, or
`trajforge train ...`. The configs extend TRL's so every TRL option works from YAML and the
command line; the data preparation (per-turn label masks, GRPO prompts, preference pairs) and
the reward registry are ours because agent trajectories are not math problems.
"""
