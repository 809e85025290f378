"""Dispatch `sft|grpo|dpo` to its launcher; heavy imports happen only for the chosen one."""
from __future__ import annotations

import importlib
import sys

TRAINERS = {"sft": "trajforge.training.sft", "grpo": "trajforge.training.grpo", "dpo": "trajforge.training.dpo"}
USAGE = "usage: python -m training {sft,grpo,dpo} --config training/configs/<name>.yaml [--field value ...]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in TRAINERS:
        print(USAGE, file=sys.stderr)
        return 2
    importlib.import_module(TRAINERS[argv[0]]).main(argv[1:])
    return 0
