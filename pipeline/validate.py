"""Validate records: JSON Schema first, then the rules a schema cannot say.

Every failure has a reason code (the first rule that fails), so the quarantine and the report
can count them. `validate_record` returns None for a valid record; it never raises on data.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from pipeline.dialects import FREE_TEXT, parse_turn
from schemas import validator

# An assistant turn that goes on to write the environment's reply itself.
_MODEL_OBSERVATION = re.compile(
    r"^(?:Observation:|The output of the OS:|\[?Observation\]?\s*:)", re.M)


@dataclass(frozen=True)
class ValidateConfig:
    max_total_chars: int = 1_000_000
    max_turns: int = 400
    min_trainable_turns: int = 1


@dataclass(frozen=True)
class Violation:
    reason: str
    detail: str


def _schema(record: dict, config: ValidateConfig) -> Violation | None:
    errors = sorted(validator("trajectory").iter_errors(record), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        path = "/".join(str(p) for p in e.absolute_path)
        return Violation("schema", f"{path or '<record>'}: {e.message}"[:500])
    return None


def _role_order(record: dict, config: ValidateConfig) -> Violation | None:
    roles = [t["role"] for t in record["conversations"]]
    body = roles[1:] if roles[0] == "system" else roles
    if "system" in body:
        return Violation("role_order", "system turn after the start")
    if not body or body[0] != "user":
        return Violation("role_order", "the conversation does not start with a user turn")
    for i in range(1, len(body)):
        if body[i] == "assistant" and body[i - 1] == "assistant":
            return Violation("role_order", f"two assistant turns in a row at {i}")
    return None


def _final_turn(record: dict, config: ValidateConfig) -> Violation | None:
    if record["conversations"][-1]["role"] != "assistant":
        return Violation("final_turn_not_assistant", "the trajectory ends on an observation")
    return None


def _assistant_turns_parse(record: dict, config: ValidateConfig) -> Violation | None:
    turns = record["conversations"]
    last_assistant = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        parsed = parse_turn(turn["content"])
        if (parsed.thought, parsed.action) != (turn["thought"], turn["action"]):
            return Violation("parse_mismatch", f"turn {i}: content does not parse to its thought/action")
        if parsed.dialect == FREE_TEXT and turn["loss"]:
            # Prose is only a valid trained turn as a tool-use agent's final reply.
            if not (i == last_assistant and record["domain"] == "tool"):
                return Violation("unparsed_assistant_turn", f"turn {i} has no action in any known dialect")
    return None


def _react_rendering(record: dict, config: ValidateConfig) -> Violation | None:
    if record["rendering"] != "react":
        return None
    for i, turn in enumerate(record["conversations"]):
        if turn["role"] == "assistant" and turn["action"] is not None and turn["dialect"] != "think_act":
            parsed = parse_turn(turn["content"])
            if parsed.dialect != "think_act":
                return Violation("mixed_rendering", f"turn {i} is not Think/Act in a react record")
    prompt = " ".join(t["content"] for t in record["conversations"] if t["role"] in ("system", "user"))
    if "Act:" not in prompt:
        return Violation("mixed_rendering", "react record whose prompt does not ask for Think/Act")
    return None


def _model_written_observation(record: dict, config: ValidateConfig) -> Violation | None:
    for i, turn in enumerate(record["conversations"]):
        if turn["role"] == "assistant" and turn["loss"] and _MODEL_OBSERVATION.search(turn["content"]):
            return Violation("model_written_observation", f"turn {i} writes the environment's observation")
    return None


def _length(record: dict, config: ValidateConfig) -> Violation | None:
    turns = record["conversations"]
    total = sum(len(t["content"]) for t in turns)
    if total > config.max_total_chars:
        return Violation("too_long", f"{total} chars (max {config.max_total_chars})")
    if len(turns) > config.max_turns:
        return Violation("too_long", f"{len(turns)} turns (max {config.max_turns})")
    trainable = sum(1 for t in turns if t["role"] == "assistant" and t["loss"])
    if trainable < config.min_trainable_turns:
        return Violation("no_trainable_turn", f"{trainable} assistant turns with loss")
    return None


# Order matters: the schema first (the other rules assume its shape), then structure, then content;
# a written-out observation is named as such before it shows up as a turn that misparses.
RULES: dict[str, Callable[[dict, ValidateConfig], Violation | None]] = {
    "schema": _schema,
    "role_order": _role_order,
    "final_turn": _final_turn,
    "length": _length,
    "model_written_observation": _model_written_observation,
    "assistant_turns_parse": _assistant_turns_parse,
    "react_rendering": _react_rendering,
}


def validate_record(record: dict, config: ValidateConfig = ValidateConfig()) -> Violation | None:
    """The first violated rule of a positive record, or None when it is valid."""
    for rule in RULES.values():
        violation = rule(record, config)
        if violation is not None:
            return violation
    return None
