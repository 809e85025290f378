"""Upstream row -> trajectory record (schemas/trajectory.schema.json).

One function, `normalize_row`, for every source: the sources differ in container, key names
(`conversations`/`conversation`, `from`/`role`, `value`/`content`) and id key, which are all
accepted everywhere, and in how a file maps to a domain and env, which the Source says.

AgentInstruct's one-shot demonstrations (os: an example problem solved before "Now, I will start
a new problem"; kg: a whole example question before the real one) are kept, because they are
the prompt the trajectory was collected with and the model's later turns refer to them, but they
are marked: `demo_turns` counts them, their assistant turns get `loss: false` whatever upstream
says (they are the benchmark's example, not the agent's behaviour), and `task` is the real task.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from json.encoder import encode_basestring

from trajforge.pipeline.envs import specs
from trajforge.pipeline.ingest.dialects import (
    DIALECTS,
    FREE_TEXT,
    ParseError,
    clean_text,
    clean_texts,
    extract_answer,
    parse_cleaned_turn,
    render_react,
)
from trajforge.schemas.record import READABLE_VERSIONS, TrajectoryRecord, Turn, new_record
from trajforge.sources.base import Source

ROLE_NAMES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
              "system": "system"}
TURN_KEYS = {"role", "from", "content", "value", "loss"}
ROW_ID_KEYS = ("id", "item_id")
CONVERSATION_KEYS = ("conversations", "conversation")
KNOWN_ROW_KEYS = frozenset(ROW_ID_KEYS + CONVERSATION_KEYS)
RENDERINGS = ("native", "react")


class NormalizeError(ValueError):
    """The row cannot become a record. `reason` is the quarantine reason code."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


REACT_FORMAT_NOTE = ('\n\nFormat every reply as "Think: <your reasoning>" on the first line and '
                     '"Act: <your action>" after it.')

@dataclass(frozen=True)
class NormalizeConfig:
    rendering: str = "native"
    max_turn_chars: int = 200_000

    def __post_init__(self):
        if self.rendering not in RENDERINGS:
            raise ValueError(f"rendering must be one of {RENDERINGS}, not {self.rendering!r}")


def _raw_turns(row: dict) -> list:
    # A loop, not `next` of a generator: building and resuming one costs more than the lookups.
    for key in CONVERSATION_KEYS:
        if key in row:
            break
    else:
        raise NormalizeError("missing_conversations", f"row has keys {sorted(row)[:10]}")
    raw_turns = row[key]
    if isinstance(raw_turns, str):
        try:
            raw_turns = json.loads(raw_turns)
        except json.JSONDecodeError:
            raise NormalizeError("wrong_type", f"{key} is a string that is not JSON") from None
    if not isinstance(raw_turns, list):
        raise NormalizeError("wrong_type", f"{key} is {type(raw_turns).__name__}, not a list")
    if not raw_turns:
        raise NormalizeError("empty_conversation")
    return raw_turns


def _turn(i: int, turn) -> tuple[str, str, bool | None]:
    """Upstream turn `i` as (role, content, loss), whichever key names it uses."""
    if not isinstance(turn, dict):
        raise NormalizeError("wrong_type", f"turn {i} is {type(turn).__name__}")
    if not turn.keys() <= TURN_KEYS:
        raise NormalizeError("unexpected_keys", f"turn {i} has {sorted(set(turn) - TURN_KEYS)}")
    role = turn["role"] if "role" in turn else turn.get("from")
    content = turn["content"] if "content" in turn else turn.get("value")
    if not isinstance(role, str) or role not in ROLE_NAMES:
        raise NormalizeError("unknown_role", f"turn {i} role {role!r}"[:300])
    if not isinstance(content, str):
        raise NormalizeError("wrong_type", f"turn {i} content is {type(content).__name__}")
    loss = turn.get("loss")
    if loss is not None and not isinstance(loss, bool):
        raise NormalizeError("wrong_type", f"turn {i} loss is {type(loss).__name__}")
    return ROLE_NAMES[role], content, loss


# A row's first turn is mostly its env's instructions, the same long text row after row: it is cleaned
# once (a lookup costs a hash of it, cleaning ~10 scans of it and often a split into lines).
_clean_first_turn = functools.lru_cache(maxsize=64)(clean_text)


@dataclass
class _Turns:
    """A row's turns as parallel sequences: our role names, the upstream contents, their loss flags
    (None where upstream has none)."""
    roles: tuple[str, ...]
    raw: tuple[str, ...]
    losses: tuple[bool | None, ...]

    @classmethod
    def of(cls, row: dict) -> _Turns:
        raw_turns = _raw_turns(row)
        roles, contents, losses = [], [], []
        # `_turn`'s checks in one loop, for turns of exactly the types it takes (nearly all): a call
        # and a tuple per turn less. At the first other turn, `_turn` takes every turn, and says why not.
        # A turn of exactly `from`, `value` and `loss` (the ShareGPT layout most upstream files use) is told
        # by its size and three lookups, where the subset test of its keys costs a view and a set comparison.
        for turn in raw_turns:
            if type(turn) is not dict:
                break
            if len(turn) == 3 and "from" in turn and "value" in turn and "loss" in turn:
                role, content, loss = turn["from"], turn["value"], turn["loss"]
            elif turn.keys() <= TURN_KEYS:
                role = turn["role"] if "role" in turn else turn.get("from")
                content = turn["content"] if "content" in turn else turn.get("value")
                loss = turn.get("loss")
            else:
                break
            if type(role) is not str or type(content) is not str or not (loss is None or type(loss) is bool):
                break
            name = ROLE_NAMES.get(role)
            if name is None:
                break
            roles.append(name)
            contents.append(content)
            losses.append(loss)
        else:
            return cls(tuple(roles), tuple(contents), tuple(losses))
        return cls(*zip(*[_turn(i, turn) for i, turn in enumerate(raw_turns)]))

    def cleaned(self, max_chars: int) -> list[str]:
        """Each content cleaned (`clean_text`); too long or empty after it is an error, of the first
        such turn."""
        if max(map(len, self.raw)) <= max_chars:
            contents = [_clean_first_turn(self.raw[0]), *clean_texts(self.raw[1:])]
            if "" not in contents:
                return contents
        i, text = next((i, text) for i, text in enumerate(self.raw) if len(text) > max_chars or not clean_text(text))
        if len(text) > max_chars:
            raise NormalizeError("too_long", f"turn {i} has {len(text)} chars (max {max_chars})")
        raise NormalizeError("empty_turn", f"turn {i} ({self.roles[i]}) is empty after cleaning")


def _spec_field(env: str, name: str):
    """The task marker or pattern of an env's spec (pipeline/envs), None for an env without one."""
    found = specs().get(env)
    return getattr(found, name) if found is not None else None


def _task_index(roles: tuple[str, ...], contents: list[str], env: str) -> tuple[int, int]:
    """(index of the user turn that states the task, number of demo turns right before it)."""
    if "user" not in roles:
        raise NormalizeError("no_user_turn")
    first_user = roles.index("user")
    default = _after_acknowledgement(roles, contents, first_user)
    marker = _spec_field(env, "task_start")
    if marker is None:
        return default, 0
    starts = [i for i in range(first_user + 1, len(roles)) if roles[i] == "user" and marker.match(contents[i])]
    if not starts or starts[-1] <= default:
        return default, 0
    task_at = starts[-1]
    demo_from = default if default > first_user else first_user + 1
    return task_at, task_at - demo_from


def _after_acknowledgement(roles: tuple[str, ...], contents: list[str], first_user: int) -> int:
    """The task's turn when no marker says: the instruction turn may be followed by an
    acknowledgement ("Ok.", an assistant turn with no action) and then the task."""
    ack, task = first_user + 1, first_user + 2
    if (task < len(roles) and roles[ack] == "assistant" and roles[task] == "user"
            and parse_cleaned_turn(contents[ack]).dialect == FREE_TEXT):
        return task
    return first_user


def _task_text(content: str, env: str) -> str:
    pattern = _spec_field(env, "task_pattern")
    m = pattern.search(content) if pattern else None
    return (m.group(1) if m else content).strip()


class NormalizedRecord(dict):
    """A record `normalize_row` built from an upstream row's turns. Each turn has the schema's turn
    shape by construction (`_parsed` writes every key with its type, `_Turns.cleaned` leaves no
    content empty), so validation checks the schema on the rest only. Whoever edits its turns afterwards
    makes a plain dict of it."""


def normalize_row(row: dict, source: Source, split: str, source_file: str, index: int,
                  config: NormalizeConfig = NormalizeConfig()) -> TrajectoryRecord:
    """Turn one upstream row into a record, or raise NormalizeError with a reason code."""
    if "schema_version" in row:
        return _passthrough(row, source)
    raw_id = source.row_id(row)
    if raw_id is None or not str(raw_id).strip():
        raise NormalizeError("missing_id", f"row has none of {ROW_ID_KEYS}")
    if not isinstance(raw_id, (str, int)):
        raise NormalizeError("wrong_type", "id is not a string")
    source_id = str(raw_id)
    turns = _Turns.of(row)
    domain_env = source.domain_env(split, source_id, turns.raw[0][:4000])
    if domain_env is None:
        raise NormalizeError("unknown_env", f"split {split!r}, id {source_id!r}")
    domain, env = domain_env
    contents = turns.cleaned(config.max_turn_chars)
    task_at, demo_turns = _task_index(turns.roles, contents, env)
    upstream_loss = turns.losses.count(None) < len(turns.losses)
    conversations = _parsed(turns, contents, task_at, demo_turns, upstream_loss)
    rendering = _render_react(conversations, task_at) if config.rendering == "react" else "native"
    # The usual meta as its JSON text (keys sorted): written out, it costs a tenth of the encoder's call.
    # Most rows have no other keys: a subset test, without building their difference.
    meta = (f'{{"source_index": {index}, "split": {encode_basestring(split)}}}' if row.keys() <= KNOWN_ROW_KEYS
            else {"source_index": index, "split": split, "extra_keys": sorted(row.keys() - KNOWN_ROW_KEYS)})
    return NormalizedRecord(new_record(
        id=source.record_id(split, source_id), source=source.name, source_id=source_id, source_file=source_file,
        license=source.license, domain=domain, env=env, negative_type=source.negative_type(split, source_id),
        rendering=rendering, loss_flags="upstream" if upstream_loss else "inferred", demo_turns=demo_turns,
        task=_task_text(contents[task_at], env) or contents[task_at],
        answer=_answer(conversations, domain), conversations=conversations, meta=meta))


# A system or user turn but its role and content: a copy of it and two stores cost less than a dict
# built key by key.
_PROMPT_TURN: Turn = {"role": "user", "content": "", "loss": False, "thought": None, "action": None, "reasoning": None,
                      "dialect": None}


def _parsed(turns: _Turns, contents: list[str], task_at: int, demo_turns: int, upstream_loss: bool) -> list[Turn]:
    """The record's turns: each assistant turn parsed (thought, action, dialect) and its loss flag
    set (module doc)."""
    conversations: list[Turn] = []
    demo_from = task_at - demo_turns
    for i, (role, content) in enumerate(zip(turns.roles, contents)):
        if role != "assistant":
            turn = _PROMPT_TURN.copy()
            turn["role"], turn["content"] = role, content
            conversations.append(turn)
            continue
        try:
            parsed = parse_cleaned_turn(content)
        except ParseError as exc:
            raise NormalizeError("unparsed_assistant_turn", f"turn {i}: {exc}") from None
        if demo_from <= i < task_at:
            loss = False
        elif upstream_loss:
            loss = turns.losses[i] is True
        else:
            # No upstream flags: the acknowledgement before the task is not trained on.
            loss = i >= task_at
        conversations.append({"role": "assistant", "content": content, "loss": loss, "thought": parsed.thought,
                              "action": parsed.action, "reasoning": None, "dialect": parsed.dialect})
    return conversations


def _answer(conversations: list[Turn], domain: str) -> str | None:
    """The final answer of the last assistant turn; a tool agent's final prose reply is its answer."""
    for last in reversed(conversations):
        if last["role"] == "assistant":
            break
    else:
        return None
    answer = extract_answer(last["action"], last["dialect"])
    if answer is None and last["dialect"] == FREE_TEXT and domain == "tool":
        return last["thought"]
    return answer


def _passthrough(row: dict, source: Source) -> dict:
    """A row that already is a record (our own synthesis output) keeps everything it carries:
    per-turn reasoning, generator and sampling in `meta`. Validation still decides."""
    if row["schema_version"] not in READABLE_VERSIONS:
        raise NormalizeError("schema", f"schema_version {row['schema_version']!r}, expected one of {READABLE_VERSIONS}")
    if row.get("source") != source.name:
        raise NormalizeError("schema", f"a {row.get('source')!r} record read as source {source.name!r}")
    return dict(row)


def _render_react(conversations: list[dict], task_at: int) -> str:
    """Render every action turn as Think/Act and rewrite the instructions to ask for exactly that.

    A record whose assistant turns carry no Thought/Action keywords upstream (JSON tool calls,
    prose replies) stays native: rewriting only some turns would make a response disagree with
    its own prompt. Observations after the task are the environment's words and stay as they are.
    """
    action_turns = [t for t in conversations if t["role"] == "assistant" and t["action"] is not None]
    dialects = {t["dialect"] for t in action_turns}
    if not action_turns or any(not DIALECTS[d].prompt_keywords for d in dialects):
        return "native"
    if any(t["dialect"] == FREE_TEXT and t["loss"] for t in conversations if t["role"] == "assistant"):
        return "native"
    _ask_for_think_act([t for t in conversations[:task_at + 1] if t["role"] in ("system", "user")], dialects)
    for turn in action_turns:
        turn["content"] = render_react(turn["thought"], turn["action"])
    return "react"


def _ask_for_think_act(prompt_turns: list[dict], dialects: set[str]) -> None:
    """Rewrite the dialects' thought/action keywords in the prompt turns to Think/Act (in place), and
    ask for that format where no turn names `Act:` after it."""
    for turn in prompt_turns:
        for name in sorted(dialects):
            for old, new in DIALECTS[name].prompt_keywords:
                turn["content"] = re.sub(rf"(?<![\w]){re.escape(old)}", new, turn["content"])
    if not any("Act:" in t["content"] for t in prompt_turns):
        prompt_turns[0]["content"] += REACT_FORMAT_NOTE
