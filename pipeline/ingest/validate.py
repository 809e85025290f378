"""Validate records: JSON Schema first, then the rules a schema cannot say.

Every failure has a reason code (the first rule that fails), so the quarantine and the report
can count them. `validate_record` returns None for a valid record; it never raises on data.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable, Iterator

from trajforge.pipeline.ingest.dialects import FREE_TEXT, extract_answer, parse_turn
from trajforge.pipeline.ingest.grammars import GRAMMARS, Breach, Context, grammar_for
from trajforge.pipeline.registry import Registry
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
    rule: str | None = None   # the grammar rule behind an `invalid_action`


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


# The same action this many times in a row, with the same observation in between, is a loop. Three
# happen in an accepted upstream row (AgentInstruct db_314 re-runs an INSERT that returns []), so the
# rule starts at four; db_326 sends the same failing INSERT five times and is caught.
LOOP_REPEATS = 4


def action_contexts(record: dict) -> Iterator[tuple[int, dict, Context]]:
    """Every assistant turn with an action, and what the agent had seen before it."""
    seen = ""
    turns = record["conversations"]
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            seen = f"{seen}\n{turn['content']}" if seen else turn["content"]
        elif turn["action"] is not None:
            observation = turns[i - 1]["content"] if i and turns[i - 1]["role"] == "user" else ""
            yield i, turn, Context(seen, observation, turn["dialect"])


def grammar_breaches(record: dict) -> tuple[int, list[tuple[int, str, Breach]]]:
    """(trained actions checked, [(turn, action, breach)]) against the record's env grammar."""
    grammar = grammar_for(record["env"])
    if grammar is None:
        return 0, []
    checked, breaches = 0, []
    for i, turn, context in action_contexts(record):
        if turn["loss"]:
            checked += 1
            breach = grammar.check(turn["action"], context)
            if breach is not None:
                breaches.append((i, turn["action"], breach))
    return checked, breaches


def _action_grammar(record: dict, config: ValidateConfig) -> Violation | None:
    """Every trained action follows its env's grammar (pipeline/ingest/grammars.py)."""
    breaches = grammar_breaches(record)[1]
    if not breaches:
        return None
    i, action, breach = breaches[0]
    return Violation("invalid_action", f"turn {i}: {action[:120]!r} breaks {breach.rule}: {breach.detail}", breach.rule)


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


def _episode_end(record: dict, config: ValidateConfig) -> Violation | None:
    """An env with a terminal action must end with it; an env that ends on its own must end on a
    (valid, checked above) action rather than on a turn with none."""
    grammar = grammar_for(record["env"])
    if grammar is None:
        return None
    turns = record["conversations"]
    last_at = max(i for i, t in enumerate(turns) if t["role"] == "assistant")
    last = turns[last_at]
    if last["action"] is None:
        if grammar.tool_replies:
            return None
        return Violation("incomplete_episode", f"turn {last_at}: the episode ends without an action; "
                                               f"a {record['env']} episode ends {grammar.ends}")
    if grammar.terminal is None or grammar.terminal(last["action"]):
        return None
    calls = sum(1 for t in turns if t["role"] == "assistant" and t["action"] is not None and t["loss"])
    if grammar.tool_replies and calls == 1:
        return None  # a single call answering a one-step instruction
    return Violation("incomplete_episode", f"turn {last_at}: the episode stops at {last['action'][:100]!r}; "
                                           f"a {record['env']} episode ends {grammar.ends}")


def _outcome_consistent(record: dict, config: ValidateConfig) -> Violation | None:
    """Upstream outcome fields agree with each other and with the record being a positive."""
    success, reward = record["success"], record["reward"]
    if success is False:
        return Violation("outcome_mismatch", "a positive whose upstream outcome is failure")
    if success is True and reward is not None and reward <= 0:
        return Violation("outcome_mismatch", f"success with reward {reward}")
    meta_reward = json.loads(record["meta"]).get("reward")
    if reward is not None and isinstance(meta_reward, (int, float)) and meta_reward != reward:
        return Violation("outcome_mismatch", f"reward {reward}, meta says {meta_reward}")
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
# a written-out observation is named as such before it shows up as a turn that misparses. The
# outcome fields come last: a negative (success false) is named for what is wrong in its turns.
RULES: Registry[Callable[[dict, ValidateConfig], Violation | None]] = Registry("validation rule", {
    "schema": _schema,
    "role_order": _role_order,
    "final_turn": _final_turn,
    "length": _length,
    "model_written_observation": _model_written_observation,
    "assistant_turns_parse": _assistant_turns_parse,
    "react_rendering": _react_rendering,
    "action_grammar": _action_grammar,
    "action_loop": _action_loop,
    "episode_end": _episode_end,
    "answer_consistent": _answer_consistent,
    "outcome_consistent": _outcome_consistent,
})


def validate_record(record: dict, config: ValidateConfig = ValidateConfig()) -> Violation | None:
    """The first violated rule (in registration order) of a positive record, or None when it is valid."""
    for rule in RULES.values():
        violation = rule(record, config)
        if violation is not None:
            return violation
    return None


def tally_env(figures: dict[str, dict], record: dict, violation: Violation | None) -> None:
    """Count one validated record into per-env figures (in place): records, trained actions
    checked and valid by the env's grammar, and quarantined records by rule (the grammar rule for
    `invalid_action`, the reason otherwise)."""
    entry = figures.setdefault(record["env"], {"grammar": record["env"] in GRAMMARS, "records": 0,
                                               "actions_checked": 0, "actions_valid": 0, "quarantined": {}})
    checked, breaches = grammar_breaches(record)
    entry["records"] += 1
    entry["actions_checked"] += checked
    entry["actions_valid"] += checked - len(breaches)
    if violation is not None:
        key = violation.rule or violation.reason
        entry["quarantined"][key] = entry["quarantined"].get(key, 0) + 1


def merge_env_figures(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """Per-env figures of several units added up, envs sorted."""
    total: dict[str, dict] = {}
    for part in parts:
        for env, entry in part.items():
            into = total.setdefault(env, {"grammar": entry["grammar"], "records": 0, "actions_checked": 0,
                                          "actions_valid": 0, "quarantined": {}})
            for key in ("records", "actions_checked", "actions_valid"):
                into[key] += entry[key]
            for rule, n in entry["quarantined"].items():
                into["quarantined"][rule] = into["quarantined"].get(rule, 0) + n
    return dict(sorted(total.items()))
