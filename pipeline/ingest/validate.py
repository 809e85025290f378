"""Validate records: JSON Schema first, then the rules a schema cannot say.

Every failure has a reason code (the first rule that fails), so the quarantine and the report
can count them. `validate_record` returns None for a valid record; it never raises on data.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Callable

from trajforge.pipeline.ingest.dialects import FREE_TEXT, parse_turn
from trajforge.pipeline.ingest.normalize import extract_answer
from trajforge.schemas import first_error

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
    error = first_error("trajectory", record)
    return Violation("schema", error[:500]) if error else None


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


# Envs whose prompt or observations name every valid action (a tool, a command verb): an action
# whose name appears nowhere in them is outside the action space. Not listed: envs where valid
# actions are free (wordle guesses, mind2web's lettered choices) or where upstream positives use
# verbs the prompt does not spell out (alfworld's "go", babyai's "pickup").
ACTION_SPACE_ENVS = frozenset({"os", "db", "kg", "webshop", "sciworld", "sqlgym", "textcraft", "maze",
                               "movie", "todo", "weather", "toolbench"})
_ACTION_HEAD = re.compile(r"[A-Za-z_][\w.\-]*")
_CONTEXT_WORD = re.compile(r"[\w.\-]+")
# The same action this many times in a row, with the same observation in between, is a loop. Three
# happen in an accepted upstream row (AgentInstruct db_314 re-runs an INSERT that returns []), so the
# rule starts at four; db_326 sends the same failing INSERT five times and is caught.
LOOP_REPEATS = 4


def action_name(action: str, dialect: str | None) -> str | None:
    """The name of the tool or command an action invokes (`bash`, `get_relations`, `search`, ...)."""
    try:
        if dialect == "json_tool":
            name = json.loads(action).get("Tool")
            return name if isinstance(name, str) else None
        if dialect == "dict_tool_call":
            name = ast.literal_eval(action).get("name")
            return name if isinstance(name, str) else None
    except (ValueError, SyntaxError, AttributeError):
        return None
    m = _ACTION_HEAD.search(action.lstrip("`"))
    return m.group(0) if m else None


def _action_space(record: dict, config: ValidateConfig) -> Violation | None:
    if record["env"] not in ACTION_SPACE_ENVS and record["domain"] != "tool":
        return None
    context = "\n".join(t["content"] for t in record["conversations"] if t["role"] != "assistant").lower()
    known = set(_CONTEXT_WORD.findall(context))
    for i, turn in enumerate(record["conversations"]):
        if turn["role"] == "assistant" and turn["loss"] and turn["action"] is not None:
            name = action_name(turn["action"], turn["dialect"])
            if name is None or name.lower() not in known:
                return Violation("action_outside_space", f"turn {i}: {name!r} is not an action the prompt offers")
    return None


def _action_loop(record: dict, config: ValidateConfig) -> Violation | None:
    """The agent repeats an action although the environment answered the same each time."""
    turns = record["conversations"]
    run, previous, seen = 0, None, None
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant" or turn["action"] is None:
            continue
        observation = turns[i - 1]["content"]
        if turn["action"] == previous:
            run = run + 1 if run >= 2 and observation == seen else 2
            seen = observation
        else:
            run = 1
        previous = turn["action"]
        if run >= LOOP_REPEATS and turn["loss"]:
            return Violation("action_loop", f"turn {i}: the same action {run} times with the same observation")
    return None


def _answer_consistent(record: dict, config: ValidateConfig) -> Violation | None:
    """The final action must give the record's answer (what a reward compares against)."""
    last = next(t for t in reversed(record["conversations"]) if t["role"] == "assistant")
    if record["answer"] is None or last["action"] is None:
        return None
    given = extract_answer(last["action"], last["dialect"])
    if given is not None and given != record["answer"]:
        return Violation("answer_mismatch", f"the final action answers {given[:100]!r}, the record says "
                                            f"{record['answer'][:100]!r}")
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
    "action_space": _action_space,
    "action_loop": _action_loop,
    "answer_consistent": _answer_consistent,
}


def validate_record(record: dict, config: ValidateConfig = ValidateConfig()) -> Violation | None:
    """The first violated rule of a positive record, or None when it is valid."""
    for rule in RULES.values():
        violation = rule(record, config)
        if violation is not None:
            return violation
    return None
