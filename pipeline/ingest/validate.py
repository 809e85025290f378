"""Validate records: JSON Schema first, then the rules a schema cannot say.

Every failure has a reason code (the first rule that fails), so the quarantine and the report
can count them. `validate_record` returns None for a valid record; it never raises on data.

Verdicts on actions are grounded in what the environment answered (`ground_steps`): each trained
step that breaks its env's grammar, or that the env refused in its own words (grammars.Replies), is

- refused: the env's reply is one of its refusals, or, for an action the grammar breaks, shows the
  state unchanged (WebShop performs nothing and shows the same page);
- grammar-only: the grammar breaks but the env answered normally: the env accepted the action, so
  the record is kept and the step trained as it is; the count is how a grammar gets fixed;
- unconfirmed: the grammar breaks and no observation follows (the final action): `invalid_action`.

`ValidateConfig.invalid_steps` says what a refused step inside an episode does: `mask` (default)
keeps it in context with `loss: false` and names it in meta `masked_steps`, so the model sees the
error and the recovery but is never trained to send what the env refused; `drop` quarantines the
record (`invalid_action`); `keep` trains on it as upstream does. An episode whose every trained
step was refused is quarantined (`all_steps_refused`) whatever the option.
"""
from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import itemgetter

import fastjsonschema

from trajforge.pipeline.envs.grammar import Breach, Context, Replies
from trajforge.pipeline.ingest.dialects import FREE_TEXT, extract_answer, parse_turn
from trajforge.pipeline.ingest.grammars import GRAMMARS, grammar_for
from trajforge.pipeline.ingest.normalize import NormalizedRecord
from trajforge.pipeline.registry import Registry
from trajforge.schemas import first_error, load_schema

# An assistant turn that goes on to write the environment's reply itself.
_MODEL_OBSERVATION = re.compile(
    r"^(?:Observation:|The output of the OS:|\[?Observation\]?\s*:)", re.M)


INVALID_STEPS = ("mask", "drop", "keep")
_CONTENT = itemgetter("content")


@dataclass(frozen=True)
class ValidateConfig:
    max_total_chars: int = 1_000_000
    max_turns: int = 400
    min_trainable_turns: int = 1
    # A refused step inside an episode: mask (context, loss false) | drop (quarantine) | keep (train).
    invalid_steps: str = "mask"

    def __post_init__(self):
        if self.invalid_steps not in INVALID_STEPS:
            raise ValueError(f"invalid_steps must be one of {', '.join(INVALID_STEPS)}, not {self.invalid_steps!r}")


@dataclass(frozen=True)
class Violation:
    reason: str
    detail: str
    rule: str | None = None   # the grammar rule behind an `invalid_action`


# What `new_record` (schemas/record.py) writes alike for every record: the schema's keys and no
# other, the version, the kind and parent of a positive or negative, `meta` as JSON text.
_CONSTRUCTED = ("schema_version", "kind", "parent_id", "meta")


@functools.cache
def _row_decided_check():
    """The compiled trajectory schema less what `new_record` and normalize's turns guarantee: the
    checks left on a `NormalizedRecord` are those of the values its row decides (id, domain, ...)."""
    schema = copy.deepcopy(load_schema("trajectory"))
    del schema["required"], schema["additionalProperties"]
    for key in _CONSTRUCTED:
        del schema["properties"][key]
    for node in schema["properties"].values():
        node.pop("items", None)
    return fastjsonschema.compile(schema)


def _schema(record: dict, config: ValidateConfig) -> Violation | None:
    built = isinstance(record, NormalizedRecord)
    if built:
        try:
            _row_decided_check()(record)
            return None
        except fastjsonschema.JsonSchemaValueException:
            pass  # explained below, as for any record
    error = first_error("trajectory", record, items_built=built)
    return Violation("schema", error[:500]) if error else None


def _role_order(record: dict, config: ValidateConfig) -> Violation | None:
    roles = [t["role"] for t in record["conversations"]]
    body = roles[1:] if roles[0] == "system" else roles
    if "system" in body:
        return Violation("role_order", "system turn after the start")
    if not body or body[0] != "user":
        return Violation("role_order", "the conversation does not start with a user turn")
    # Two assistant turns in a row are looked for in the roles joined (one scan; most records have
    # none), and placed only where found.
    if "assistant\nassistant" in "\n".join(body):
        i = next(i for i in range(1, len(body)) if body[i] == "assistant" and body[i - 1] == "assistant")
        return Violation("role_order", f"two assistant turns in a row at {i}")
    return None


def _final_turn(record: dict, config: ValidateConfig) -> Violation | None:
    if record["conversations"][-1]["role"] != "assistant":
        return Violation("final_turn_not_assistant", "the trajectory ends on an observation")
    return None


def masked_turns(record: dict) -> set[int]:
    """The turns validation masked in a written record (meta `masked_steps`)."""
    return {step["turn"] for step in json.loads(record["meta"]).get("masked_steps", [])}


def _assistant_turns_parse(record: dict, config: ValidateConfig) -> Violation | None:
    turns = record["conversations"]
    # A normalized record's native turns are their content's parse (`_parsed` wrote them): only a
    # record rendered or edited since is parsed again.
    known = isinstance(record, NormalizedRecord) and record["rendering"] == "native"
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        dialect = turn["dialect"]
        if not known:
            parsed = parse_turn(turn["content"])
            if (parsed.thought, parsed.action) != (turn["thought"], turn["action"]):
                return Violation("parse_mismatch", f"turn {i}: content does not parse to its thought/action")
            dialect = parsed.dialect
        if dialect == FREE_TEXT and turn["loss"]:
            # Prose is only a valid trained turn as a tool-use agent's final reply.
            if not (i == _last_assistant(turns) and record["domain"] == "tool"):
                return Violation("unparsed_assistant_turn", f"turn {i} has no action in any known dialect")
    return None


def _last_assistant(turns: list[dict]) -> int:
    """The index of the last assistant turn (a record that fits the schema has one): most records end
    on it."""
    if turns[-1]["role"] == "assistant":
        return len(turns) - 1
    return next(i for i in range(len(turns) - 2, -1, -1) if turns[i]["role"] == "assistant")


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
        if turn["role"] == "assistant" and turn["loss"]:
            content = turn["content"]
            # Every match of _MODEL_OBSERVATION holds one of these: a turn without either is not searched
            # line by line (tested here, not by a call per trained turn).
            if ("Observation" in content or "The output of the OS:" in content) and _MODEL_OBSERVATION.search(content):
                return Violation("model_written_observation", f"turn {i} writes the environment's observation")
    return None


def _length(record: dict, config: ValidateConfig) -> Violation | None:
    turns = record["conversations"]
    total = sum(map(len, map(_CONTENT, turns)))
    if total > config.max_total_chars:
        return Violation("too_long", f"{total} chars (max {config.max_total_chars})")
    if len(turns) > config.max_turns:
        return Violation("too_long", f"{len(turns)} turns (max {config.max_turns})")
    # Counted only as far as the minimum: the count is only told when it falls short.
    trainable = 0
    for t in turns:
        if t["loss"] and t["role"] == "assistant":
            trainable += 1
            if trainable >= config.min_trainable_turns:
                return None
    if trainable < config.min_trainable_turns:
        return Violation("no_trainable_turn", f"{trainable} assistant turns with loss")
    return None


# The same action this many times in a row, each attempt before it met with a refusal, a no-op or
# an unchanged state, is a loop. AgentInstruct db_314 re-runs an INSERT that returns [] three times
# in an accepted row, so the rule starts at four; db_326 sends the same failing INSERT six times and
# is caught.
LOOP_REPEATS = 4

REFUSED, GRAMMAR_ONLY, UNCONFIRMED = "refused", "grammar_only", "unconfirmed"
VERDICTS = (REFUSED, GRAMMAR_ONLY, UNCONFIRMED)


@dataclass(frozen=True)
class Step:
    """A trained assistant turn that breaks its env's grammar or that the env refused."""
    turn: int
    verdict: str   # one of VERDICTS
    rule: str      # the grammar rule it breaks; else the env's refusal (`db.sql_error`), or the unparsed turn
    detail: str


def _assistant_turns(turns: list[dict]) -> Iterator[tuple[int, dict, list[str]]]:
    """Every assistant turn, with what the agent had seen before it (the other turns' contents from
    the first non-empty one; a list that grows as the walk goes on: copy it to keep it)."""
    seen: list[str] = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            if seen or turn["content"]:
                seen.append(turn["content"])
        else:
            yield i, turn, seen


def _context(turns: list[dict], i: int, seen: list[str]) -> Context:
    return Context(tuple(seen), _before(turns, i), turns[i]["dialect"])


def action_contexts(record: dict) -> Iterator[tuple[int, dict, Context]]:
    """Every assistant turn with an action, and what the agent had seen before it."""
    turns = record["conversations"]
    for i, turn, seen in _assistant_turns(turns):
        if turn["action"] is not None:
            yield i, turn, _context(turns, i, seen)


def _before(turns: list[dict], i: int) -> str:
    """The observation assistant turn `i` answers: the user turn before it, "" if none."""
    return turns[i - 1]["content"] if i and turns[i - 1]["role"] == "user" else ""


def reply_to(turns: list[dict], i: int) -> str | None:
    """The environment's answer to assistant turn `i`: the user turn after it, None at the end."""
    return turns[i + 1]["content"] if i + 1 < len(turns) and turns[i + 1]["role"] == "user" else None


_NO_REPLIES = Replies()


def replies_of(env: str) -> Replies:
    grammar = grammar_for(env)
    return grammar.replies if grammar is not None else _NO_REPLIES


def grammar_breaches(record: dict, from_turn: int = 0) -> tuple[int, list[tuple[int, str, Breach]]]:
    """(trained actions checked, [(turn, action, breach)]) against the record's env grammar, of the
    turns from `from_turn` on (an action's verdict depends only on it and the turns before it)."""
    grammar = grammar_for(record["env"])
    if grammar is None:
        return 0, []
    checked, breaches = 0, []
    for i, turn, context in action_contexts(record):
        if turn["loss"] and i >= from_turn:
            checked += 1
            breach = grammar.check(turn["action"], context)
            if breach is not None:
                breaches.append((i, turn["action"], breach))
    return checked, breaches


def ground_steps(record: dict) -> list[Step]:
    """Every trained step that breaks the grammar or that the env refused, with its verdict (module
    doc), in turn order."""
    return _grounded(record).steps


@dataclass
class _Grounding:
    """What grounding a record's trained turns found: `ground_steps`, the trained assistant turns, and
    the trained actions checked against the env's grammar and how many of them break it."""
    steps: list[Step]
    trained: int
    checked: int
    breached: int


def _grounded(record: dict) -> _Grounding:
    """The record's grounding in one pass over its turns: each trained action checked against the
    grammar in its `action_contexts` context, then its verdict taken (`_step`) where the grammar
    breaks or the env refused (most trained turns have neither: no call for them)."""
    turns = record["conversations"]
    grammar = grammar_for(record["env"])
    replies = grammar.replies if grammar is not None else _NO_REPLIES
    steps: list[Step] = []
    trained = checked = breached = 0
    for i, turn, seen in _assistant_turns(turns):
        if not turn["loss"]:
            continue
        trained += 1
        breach = None
        if grammar is not None and turn["action"] is not None:
            checked += 1
            breach = grammar.check(turn["action"], _context(turns, i, seen))
            breached += breach is not None
        reply = reply_to(turns, i)
        refusal = replies.refusal(reply) if reply is not None else None
        if breach is not None or refusal is not None:
            step = _step(turns, i, reply, refusal, breach)
            if step is not None:
                steps.append(step)
    return _Grounding(steps, trained, checked, breached)


def _step(turns: list[dict], i: int, reply: str | None, refusal: str | None, breach: Breach | None) -> Step | None:
    """The verdict on trained assistant turn `i` (`reply`: the env's answer to it, `refusal`: the
    refusal that answer is, `breach`: the grammar rule its action breaks), or None when the grammar
    holds and the env did not refuse it."""
    turn = turns[i]
    if turn["action"] is None:
        # A turn in no dialect that the env answered with a refusal (AgentGym sends the whole turn).
        if refusal is not None and turn["dialect"] == FREE_TEXT:
            return Step(i, REFUSED, "unparsed_assistant_turn", f"the env answered {refusal}")
        return None
    if breach is None:
        if refusal is not None:
            return Step(i, REFUSED, refusal, f"{turn['action'][:120]!r}: the env answered {refusal}")
        return None
    if reply is None:
        return Step(i, UNCONFIRMED, breach.rule, breach.detail)
    if refusal is not None or reply == _before(turns, i):
        return Step(i, REFUSED, breach.rule, f"{breach.detail}; the env answered "
                                             f"{refusal or 'with the state unchanged'}")
    return Step(i, GRAMMAR_ONLY, breach.rule, f"{breach.detail}; the env answered normally")


def _action_grammar(record: dict, config: ValidateConfig) -> Violation | None:
    """No trained action breaks its env's grammar unconfirmed (the final one, which no observation
    follows); under `invalid_steps: drop` none was refused either."""
    return _steps_violation(record, ground_steps(record), config)


def _steps_violation(record: dict, steps: list[Step], config: ValidateConfig) -> Violation | None:
    """`_action_grammar` on the record's `ground_steps`, already known."""
    for step in steps:
        if step.verdict == UNCONFIRMED or (step.verdict == REFUSED and config.invalid_steps == "drop"):
            action = record["conversations"][step.turn]["action"] or ""
            return Violation("invalid_action", f"turn {step.turn}: {action[:120]!r} breaks {step.rule} "
                                               f"({step.verdict}): {step.detail}", step.rule)
    return None


def _action_loop(record: dict, config: ValidateConfig) -> Violation | None:
    """The agent repeats an action although the env refused it, did nothing, or left the state as it
    was each time; a repeat the env reports as progress (TextCraft `Crafted ...`) is no loop. A masked
    step still counts as an attempt: the loop is in the episode either way."""
    turns = record["conversations"]
    run, previous_at, previous = 0, None, None
    for i, turn in enumerate(turns):
        action = turn["action"]
        if action is None or turn["role"] != "assistant":
            continue
        # The env's reply to the previous attempt (its replies, and the meta) are read only where they
        # can matter: most actions repeat none before them.
        if action == previous and _got_nowhere(turns, previous_at, replies_of(record["env"])):
            run += 1
            if run >= LOOP_REPEATS and (turn["loss"] or i in masked_turns(record)):
                return Violation("action_loop", f"turn {i}: the same action {run} times, the env refusing it, "
                                                "doing nothing or leaving the state unchanged each time")
        else:
            run = 1
        previous_at, previous = i, action
    return None


def _got_nowhere(turns: list[dict], i: int, replies: Replies) -> bool:
    """Whether the env's reply to assistant turn `i` shows its action got nowhere (`Replies.stuck`)."""
    reply = reply_to(turns, i)
    return reply is not None and replies.stuck(reply, _before(turns, i))


def _episode_end(record: dict, config: ValidateConfig) -> Violation | None:
    """An env with a terminal action must end with it; an env that ends on its own must end on a
    (valid, checked above) action rather than on a turn with none."""
    grammar = grammar_for(record["env"])
    if grammar is None:
        return None
    turns = record["conversations"]
    last_at = _last_assistant(turns)
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
    if reward is None:
        return None
    meta_reward = json.loads(record["meta"]).get("reward")
    if isinstance(meta_reward, (int, float)) and meta_reward != reward:
        return Violation("outcome_mismatch", f"reward {reward}, meta says {meta_reward}")
    return None


def _answer_consistent(record: dict, config: ValidateConfig) -> Violation | None:
    """The final action must give the record's answer (what a reward compares against). A record
    normalize built took its answer from that action (`_answer`: the same `extract_answer` of the
    same last assistant turn; rendering and masking leave actions as they are), so it gives it."""
    if record["answer"] is None or isinstance(record, NormalizedRecord):
        return None
    turns = record["conversations"]
    last = turns[_last_assistant(turns)]
    if last["action"] is None:
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


# Not frozen: one is built for every record, and a frozen dataclass's __init__ costs several times a
# plain one's. Nothing changes one once built.
@dataclass
class Checked:
    """A validated record: as it is written (refused steps masked under `invalid_steps: mask`), its
    first violation, and what grounding found: trained actions checked and how many break the grammar,
    the steps of `ground_steps`, and how many of them were masked."""
    record: dict
    violation: Violation | None
    checked: int = 0
    breached: int = 0
    steps: list[Step] = field(default_factory=list)
    masked: int = 0


def mask_steps(record: dict, steps: list[Step]) -> dict:
    """`record` with each of `steps` kept as context (`loss: false`) and named in meta `masked_steps`."""
    turns = [dict(t) for t in record["conversations"]]
    for step in steps:
        turns[step.turn]["loss"] = False
    meta = json.loads(record["meta"])
    meta["masked_steps"] = [{"turn": s.turn, "rule": s.rule} for s in steps]
    # Only loss flags change: a record normalize built keeps what it holds by construction (each
    # turn's shape, its content's parse), and so its class.
    return type(record)({**record, "conversations": turns, "meta": json.dumps(meta, sort_keys=True, ensure_ascii=False)})


def check_record(record: dict, config: ValidateConfig = ValidateConfig()) -> Checked:
    """Validate a positive record, grounding its steps in the env's answers (module doc)."""
    violation = _schema(record, config)
    if violation is not None:
        return Checked(record, violation)
    grounding = _grounded(record)
    steps = grounding.steps
    # Most records have no step: no comprehension (a function built and called) for them.
    refused = [s for s in steps if s.verdict == REFUSED] if steps else steps
    if refused and len(refused) == grounding.trained:
        return Checked(record, Violation("all_steps_refused", f"the env refused each of the {len(refused)} trained "
                                                              f"steps: {', '.join(s.rule for s in refused)}"),
                       grounding.checked, grounding.breached, steps)
    if not refused or config.invalid_steps != "mask":
        return Checked(record, _first_violation(record, steps, config), grounding.checked, grounding.breached, steps)
    # Masking only turns loss flags off and names the steps in meta: the written record still fits
    # the schema, and its steps are the record's less the masked ones. Neither is checked twice.
    written = mask_steps(record, refused)
    still_trained = [s for s in steps if s.verdict != REFUSED]
    return Checked(written, _first_violation(written, still_trained, config), grounding.checked, grounding.breached,
                   steps, len(refused))


def _first_violation(record: dict, steps: list[Step], config: ValidateConfig) -> Violation | None:
    """The first rule a record that fits the schema breaks, its `ground_steps` already known."""
    for rule in RULES.values():
        if rule is _schema:
            continue
        violation = _steps_violation(record, steps, config) if rule is _action_grammar else rule(record, config)
        if violation is not None:
            return violation
    return None


def validate_record(record: dict, config: ValidateConfig = ValidateConfig()) -> Violation | None:
    """The first violated rule (in registration order) of a positive record, or None when it is valid
    (as `check_record` writes it)."""
    return check_record(record, config).violation


def _env_entry() -> dict:
    return {"records": 0, "actions_checked": 0, "actions_valid": 0, "quarantined": {},
            "records_masked": 0, "steps_masked": 0, **{verdict: {} for verdict in VERDICTS}}


def _add(into: dict[str, int], key: str, n: int = 1) -> None:
    into[key] = into.get(key, 0) + n


def tally_env(figures: dict[str, dict], record: dict, checked: Checked) -> None:
    """Count one validated record into per-env figures (in place): records, trained actions checked
    and valid by the env's grammar, steps refused / grammar-only / unconfirmed by rule, records
    written with masked steps and the steps masked, and quarantined records by rule (the grammar
    rule for `invalid_action`, the reason otherwise)."""
    env = record["env"]
    entry = figures.get(env)
    if entry is None:  # not setdefault: the default would be built for every record
        entry = figures[env] = {"grammar": env in GRAMMARS, **_env_entry()}
    entry["records"] += 1
    entry["actions_checked"] += checked.checked
    entry["actions_valid"] += checked.checked - checked.breached
    for step in checked.steps:
        _add(entry[step.verdict], step.rule)
    if checked.violation is not None:
        _add(entry["quarantined"], checked.violation.rule or checked.violation.reason)
    elif checked.masked:
        entry["records_masked"] += 1
        entry["steps_masked"] += checked.masked


def merge_env_figures(parts: list[dict[str, dict]]) -> dict[str, dict]:
    """Per-env figures of several units added up, envs sorted."""
    total: dict[str, dict] = {}
    for part in parts:
        for env, entry in part.items():
            into = total.setdefault(env, {"grammar": entry["grammar"], **_env_entry()})
            for key in ("records", "actions_checked", "actions_valid", "records_masked", "steps_masked"):
                into[key] += entry[key]
            for key in ("quarantined", *VERDICTS):
                for rule, n in entry[key].items():
                    _add(into[key], rule, n)
    return dict(sorted(total.items()))
