"""Rule-based negative trajectories made from valid positives.

Each maker takes a positive and returns a trajectory that shows one wrong behaviour, or None when
the positive cannot show it (no answer action, no observation after the turn, ...). A negative is
a full trajectory record (schemas/trajectory.schema.json) with `kind: negative`, its
`negative_type` and the `parent_id` of the positive, so the `negatives` config loads with the same
features as `sft`. Changed turns are re-parsed, so their `thought`/`action` fields match their
text and a negative fails `validate_record` for the reason its type names (EXPECTED_VIOLATION),
not on a bookkeeping mismatch.

Which positives get which negative is decided by a hash of (seed, type, parent id) against the
rate of the type: the same inputs give the same negatives whatever the order or the batching.

Agent-FLAN's own `toolbench_negative` rows (negative_type `tool_irrelevance`) are not made here:
they show the right behaviour when the offered tools do not fit (answer without a tool) and stay
in the `sft` config as ingested. The types below show wrong behaviour and are never trained on
as positives.
"""
from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from json.encoder import c_make_encoder, encode_basestring_ascii

import numpy as np
import pyarrow as pa

from trajforge.pipeline.envs.grammar import action_name, break_action
from trajforge.pipeline.ingest.dialects import FREE_TEXT, extract_answer, parse_turn, render_turn
from trajforge.pipeline.ingest.grammars import grammar_for
from trajforge.pipeline.ingest.validate import LOOP_REPEATS, action_contexts, grammar_breaches, replies_of, reply_to
from trajforge.pipeline.quality.derived import record_meta
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.pipeline.registry import Registry
from trajforge.schemas import arrow_schema

NEGATIVE_TYPES = ("invalid_action", "invented_tool", "irrelevant_tools", "hallucinated_observation",
                  "wrong_answer", "premature_answer", "broken_format", "action_loop")

# The validator reason each type fails with when validated as a positive.
EXPECTED_VIOLATION = {
    "invalid_action": "invalid_action",
    "invented_tool": "invalid_action",
    "irrelevant_tools": "invalid_action",
    "hallucinated_observation": "model_written_observation",
    "wrong_answer": "answer_mismatch",
    "premature_answer": "answer_mismatch",
    "broken_format": "unparsed_assistant_turn",
    "action_loop": "action_loop",
}

# Tool names that no fixture env offers; the first one absent from a record's prompt is used.
INVENTED_TOOLS = ("web_search", "search_internet", "call_external_api", "python_interpreter")
NO_FITTING_TOOL = "I cannot answer this with the available actions."


@dataclass(frozen=True)
class NegativesConfig:
    seed: int = 0
    # Fraction of eligible positives that get a negative of each type.
    rates: dict[str, float] = field(default_factory=lambda: dict.fromkeys(NEGATIVE_TYPES, 0.2))

    def __post_init__(self):
        MAKERS.check(self.rates)
        bad = {k: v for k, v in self.rates.items() if not 0 <= v <= 1}
        if bad:
            raise ValueError(f"rates must be in [0, 1]: {bad}")

    @functools.cached_property
    def draw_key(self) -> tuple[int, tuple[tuple[str, float], ...]]:
        """What `_draws` are cached by, made once: made and hashed per positive, ~1 us of ~35."""
        return self.seed, tuple(self.rates.items())


# What a positive must have for a type's maker to make anything of it, where that is cheap to see
# (`_can_make`): a type's draw is not hashed for a positive without it (the maker would return None).
_NEEDS = {"invented_tool": "tool", "irrelevant_tools": "tool", "wrong_answer": "answer", "premature_answer": "answer"}


@functools.lru_cache(maxsize=16)
def _draws(key: tuple[int, tuple[tuple[str, float], ...]]) -> tuple[tuple[Callable, object, bytes, str | None], ...]:
    """Of a config's `draw_key` (seed, rates): (maker, hash of the (seed, type) prefix, `_draw_bound` of
    the rate, what it needs: `_NEEDS`) per type in MAKERS' order whose rate can choose a positive: the
    prefix is hashed once and copied for each positive's draw."""
    seed, rates = key
    rate_of = dict(rates)
    return tuple((maker, hashlib.sha256(f"{seed}\x1f{kind}\x1f".encode()), _draw_bound(rate_of.get(kind, 0.0)),
                  _NEEDS.get(kind)) for kind, maker in MAKERS.items() if rate_of.get(kind, 0.0) > 0)


def _can_make(record: dict) -> dict[str | None, bool]:
    """Which of `_NEEDS` a positive has: a tool env (invented_tool's, irrelevant_tools' first test),
    an expected answer (`_final_answer`'s)."""
    return {None: True, "tool": record["domain"] == "tool", "answer": record["answer"] is not None}


def _draw_bound(rate: float) -> bytes:
    """A type is drawn when the first 8 bytes of the draw's digest, read as a big-endian n, give
    `n / 2**64 < rate`: that is n below the least n that does not (found by bisection, the float
    division rounds), and a digest below these 8 bytes. One bytes comparison of the digest; the int
    and the division cost more than the copy, update and digest of the hash together."""
    low, high = 0, 2**64 - 1  # (2**64 - 1) / 2**64 rounds to 1.0: never below a rate in [0, 1]
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if mid / 2**64 < rate else (low, mid)
    return low.to_bytes(8, "big")


def _pick(seed: int, key: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\x1f{key}".encode()).digest()[:8], "big") % n


def _turn(content: str, loss: bool = True) -> dict:
    """An assistant turn whose parsed fields match its text."""
    parsed = parse_turn(content)
    return {"role": "assistant", "content": content, "loss": loss, "thought": parsed.thought,
            "action": parsed.action, "reasoning": None, "dialect": parsed.dialect}


def _action_turns(record: dict) -> Iterator[int]:
    """The trained action turns, in order, found as they are asked for: most makers stop at the first."""
    return (i for i, t in enumerate(record["conversations"])
            if t["role"] == "assistant" and t["loss"] and t["action"] is not None)


WORD = re.compile(r"[\w.\-]+")


def _context_text(record: dict) -> str:
    """The non-assistant turns, lowercased and joined by newlines. Each turn is lowered on its own: an
    ASCII tool listing stays on str.lower's fast path when a later turn is not ASCII (twice as fast on
    tool prompts), and the text is the same (a newline bounds the only context rule, the final sigma)."""
    return "\n".join(t["content"].lower() for t in record["conversations"] if t["role"] != "assistant")


def _is_word_of(text: str, word: str) -> bool:
    """Whether `word` is one of the words (maximal runs of `WORD`) of `text`: one search for it
    between non-word characters, not a set of every word of a long prompt."""
    return (WORD.fullmatch(word) is not None and word in text
            and re.search(rf"(?<![\w.\-]){re.escape(word)}(?![\w.\-])", text) is not None)


def _sorted_json() -> Callable[[dict], str]:
    """`json.dumps(..., sort_keys=True)` of a dict. It builds an encoder per call, and so does the
    `encode` of a `JSONEncoder`: half and then 60 % of its time on a small meta. Its C encoder is made
    once here, without the check for circular references (a meta is parsed JSON): the same text."""
    encoder = json.JSONEncoder(sort_keys=True)
    if c_make_encoder is None:
        return encoder.encode
    make = c_make_encoder(None, encoder.default, encode_basestring_ascii, encoder.indent, encoder.key_separator,
                          encoder.item_separator, encoder.sort_keys, encoder.skipkeys, encoder.allow_nan)
    return lambda value: "".join(make(value, 0))


_SORTED_JSON = _sorted_json()


@functools.lru_cache(maxsize=16)
def _negative_meta(parent_meta: str, extra: tuple[tuple[str, str], ...]) -> str:
    """A negative's meta: its parent's with `extra`; a positive's negatives without extra share it."""
    return _SORTED_JSON({**record_meta(parent_meta), **dict(extra)})


# The fields a negative does not take from its parent (`_negative`); `negative_table` takes the rest
# from the parent's row.
OWN_FIELDS = ("id", "kind", "negative_type", "parent_id", "conversations", "reward", "success", "meta")


def _negative(parent: dict, kind: str, conversations: list[dict], extra: dict | None = None) -> dict:
    """A negative keeps its parent's task and expected `answer`: what a reward compares against.
    Only OWN_FIELDS differ from the parent's; its turns are the parent's own dicts where unchanged."""
    return {**parent, "id": f"{parent['id']}#neg-{kind}", "kind": "negative", "negative_type": kind,
            "parent_id": parent["id"], "conversations": conversations,
            "reward": None, "success": False,
            "meta": _negative_meta(parent["meta"], tuple((extra or {}).items()))}


def _replace_name(turn: dict, old: str, new: str) -> dict | None:
    """The turn with the called tool/command renamed, in the turn's own dialect."""
    action = turn["action"]
    if turn["dialect"] == "json_tool":
        call = json.loads(action)
        call["Tool"] = new
        action = json.dumps(call, ensure_ascii=False)
    else:
        at = action.find(old)
        if at < 0:
            return None
        action = action[:at] + new + action[at + len(old):]
    out = _turn(render_turn(turn["dialect"], turn["thought"], action))
    return out if out["action"] is not None and action_name(out["action"], out["dialect"]) == new else None


def _renamed_action(record: dict, names: tuple[str, ...]) -> list[dict] | None:
    turns = record["conversations"]
    text = _context_text(record)
    new = next((n for n in names if not _is_word_of(text, n)), None)
    for i in _action_turns(record):
        old = action_name(turns[i]["action"], turns[i]["dialect"])
        changed = _replace_name(turns[i], old, new) if old and new else None
        if changed is not None:
            # The trajectory stops at the bad action: the environment never answered it.
            return turns[:i] + [changed]
    return None


def make_invalid_action(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """A real trained action edited to break one rule of its env's grammar (its spec, pipeline/envs):
    the first action that some edit breaks, the rule picked by the seed among those it can break.
    A tool the prompt does not offer is `invented_tool`'s, not this type's."""
    grammar = grammar_for(record["env"])
    if grammar is None:
        return None
    turns = record["conversations"]
    for i, turn, context in action_contexts(record):
        if not turn["loss"]:
            continue
        edits = break_action(grammar, turn["action"], context)
        edits.pop("tool.unknown_tool", None)
        rules = sorted(edits)
        start = _pick(seed, record["id"], len(rules)) if rules else 0
        for rule in rules[start:] + rules[:start]:
            changed = _turn(render_turn(turn["dialect"], turn["thought"], edits[rule]))
            if changed["action"] == edits[rule].strip() and changed["dialect"] == turn["dialect"]:
                # The trajectory stops at the bad action: the environment never answered it.
                return _negative(record, "invalid_action", turns[:i] + [changed], extra={"grammar_rule": rule})
    return None


def make_invented_tool(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """A tool-use agent calls a tool it was never offered."""
    if record["domain"] != "tool":
        return None
    made = _renamed_action(record, INVENTED_TOOLS)
    return _negative(record, "invented_tool", made) if made else None


def make_irrelevant_tools(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """Agent-FLAN style: the offered tools (another tool env's) do not fit the request, and the
    agent calls its usual tool anyway instead of saying that it cannot help. The right reply is
    kept in meta `chosen` for the preference pair."""
    turns = record["conversations"]
    first = next(_action_turns(record), None) if record["domain"] == "tool" else None
    if first is None or turns[0]["role"] != "user":
        return None
    donors = pool.tool_prompts_of_other_envs(record["env"], turns[0]["content"])
    if not donors:
        return None
    donor_env, donor_prompt = donors[_pick(seed, record["id"], len(donors))]
    swapped = {**turns[0], "content": donor_prompt}
    conversations = [swapped] + turns[1:first + 1]
    probe = {**record, "conversations": conversations}
    name = action_name(turns[first]["action"], turns[first]["dialect"])
    if name is None or _is_word_of(_context_text(probe), name.lower()):
        return None
    # The right reply to the swapped prompt: finish without calling a tool, in the env's own syntax
    # (AgentGym tool envs end with `finish with Action Input: {"answer": ...}`).
    finish = next((t for t in reversed(turns) if t["role"] == "assistant" and t["action"]
                   and extract_answer(t["action"], t["dialect"]) is not None), None)
    if finish is None or not finish["action"].startswith("finish with Action Input:"):
        return None
    thought = f"None of the available actions can help with this request about {record['env']}."
    chosen = render_turn(finish["dialect"], thought,
                         "finish with Action Input: " + json.dumps({"answer": NO_FITTING_TOOL}))
    return _negative(record, "irrelevant_tools", conversations,
                     extra={"tools_from_env": donor_env, "chosen": chosen})


def make_hallucinated_observation(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """The agent writes the environment's reply itself instead of waiting for it."""
    turns = record["conversations"]
    for i in _action_turns(record):
        if i + 1 >= len(turns) or turns[i + 1]["role"] != "user":
            continue
        observation = turns[i + 1]["content"][:300].split("\n", 1)[0]  # its first line, at most 300 characters
        changed = _turn(f"{turns[i]['content']}\nObservation: {observation}")
        if changed["action"] is not None and changed["dialect"] == turns[i]["dialect"]:
            return _negative(record, "hallucinated_observation", turns[:i] + [changed])
    return None


def _wrong_answer(record: dict, pool: EnvPools, seed: int) -> str | None:
    others = pool.wrong_answers(record["env"], record["answer"])
    if others:
        return others[_pick(seed, record["id"], len(others))]
    number = re.fullmatch(r"-?\d+(?:\.\d+)?", record["answer"] or "")
    if number:
        return str(float(record["answer"]) + 1) if "." in record["answer"] else str(int(record["answer"]) + 1)
    return None


def _answer_turn(final: dict, given: str, wrong: str, thought: str) -> dict | None:
    """`final`'s answer action (it gives `given`, `_final_answer`) in its own syntax, giving `wrong` instead."""
    action = final["action"]
    if action.startswith("finish with Action Input:"):
        action = "finish with Action Input: " + json.dumps({"answer": wrong}, ensure_ascii=False)
    else:
        at = action.rfind(given) if given else -1
        if at < 0:
            return None
        action = action[:at] + wrong + action[at + len(given):]
    out = _turn(render_turn(final["dialect"], thought, action))
    return out if out["action"] and extract_answer(out["action"], out["dialect"]) == wrong else None


def _last_assistant(turns: list[dict]) -> int:
    """The index of the last assistant turn (a positive has one), looked for from the end."""
    for i in range(len(turns) - 1, -1, -1):
        if turns[i]["role"] == "assistant":
            return i
    raise ValueError("no assistant turn")


def _final_answer(record: dict) -> tuple[int, dict] | None:
    turns = record["conversations"]
    i = _last_assistant(turns)
    if record["answer"] is None or turns[i]["action"] is None:
        return None
    if extract_answer(turns[i]["action"], turns[i]["dialect"]) != record["answer"]:
        return None
    return i, turns[i]


def _breaks_grammar(record: dict, conversations: list[dict]) -> bool:
    """Whether `conversations` break the env's grammar where the parent does not: a parent's step
    that breaks our grammar but that the env accepted (grammar-only) is kept and trained, and is no
    fault of the negative."""
    turns = record["conversations"]
    # The turns both share from the start (the same dicts) have the same verdicts: only the rest is
    # checked, the parent's only when the negative breaks a rule there.
    same = next((i for i, (a, b) in enumerate(zip(turns, conversations)) if a is not b and a != b),
                min(len(turns), len(conversations)))
    breaches = grammar_breaches({**record, "conversations": conversations}, same)[1]
    if not breaches:
        return False
    parent = {(i, action) for i, action, _ in grammar_breaches(record, same)[1]}
    return any((i, action) not in parent for i, action, _ in breaches)


def make_wrong_answer(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """The trajectory ends with a wrong final answer (another task's answer of the same env)."""
    final = _final_answer(record)
    wrong = _wrong_answer(record, pool, seed) if final else None
    changed = _answer_turn(final[1], record["answer"], wrong, final[1]["thought"]) if wrong else None
    conversations = record["conversations"][:final[0]] + [changed] if changed else None
    if conversations is None or _breaks_grammar(record, conversations):
        return None
    return _negative(record, "wrong_answer", conversations)


def make_premature_answer(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """The agent answers at its first step, before looking at anything, and gets it wrong."""
    final = _final_answer(record)
    first = next(_action_turns(record), None) if final is not None else None
    if first is None or first >= final[0]:
        return None
    wrong = _wrong_answer(record, pool, seed)
    changed = _answer_turn(final[1], record["answer"], wrong, record["conversations"][first]["thought"]) if wrong else None
    conversations = record["conversations"][:first] + [changed] if changed else None
    if conversations is None or _breaks_grammar(record, conversations):
        return None  # e.g. a KG answer naming a variable no step has made yet: invalid, not just wrong
    return _negative(record, "premature_answer", conversations)


def make_broken_format(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """A turn that drops the Thought/Action markers its prompt asks for (prose, unparseable)."""
    turns = record["conversations"]
    last = _last_assistant(turns)
    for i in _action_turns(record):
        if i == last and record["domain"] == "tool":
            continue  # a tool agent's last turn may be prose; it would not be a format error there
        t = turns[i]
        for text in (f"{t['thought']}\n{t['action']}" if t["thought"] else t["action"],
                     f"{t['thought']} {t['action'][:-1]}"):
            changed = _turn(text)
            if changed["dialect"] == FREE_TEXT:
                return _negative(record, "broken_format", turns[:i] + [changed] + turns[i + 1:])
    return None


def make_action_loop(record: dict, pool: EnvPools, seed: int) -> dict | None:
    """The agent repeats an action although the environment keeps giving the same reply: after the
    first answer, the state stays as it was LOOP_REPEATS - 1 times, and the agent sends it again. A
    reply the env words as progress (TextCraft `Got ...`) would make the repeats no loop."""
    turns = record["conversations"]
    progress = replies_of(record["env"]).progress
    for i in _action_turns(record):
        reply = reply_to(turns, i)
        if reply is not None and (progress is None or not progress.search(reply)):
            repeat = {**turns[i], "loss": True}
            loop = [repeat, turns[i + 1]] * (LOOP_REPEATS - 1) + [repeat]
            return _negative(record, "action_loop", turns[:i + 2] + loop)
    return None


MAKERS: Registry[Callable[[dict, list[dict], int], dict | None]] = Registry("negative type", {
    "invalid_action": make_invalid_action,
    "invented_tool": make_invented_tool,
    "irrelevant_tools": make_irrelevant_tools,
    "hallucinated_observation": make_hallucinated_observation,
    "wrong_answer": make_wrong_answer,
    "premature_answer": make_premature_answer,
    "broken_format": make_broken_format,
    "action_loop": make_action_loop,
})


def drawn_makers(record: dict, config: NegativesConfig = NegativesConfig()) -> list[Callable]:
    """The makers of the types drawn for a record (none unless it is a positive), in type order. It
    reads the record's kind, id, domain and answer, not its turns."""
    if record["kind"] != "positive":
        return []
    key = record["id"].encode()
    can = _can_make(record)
    out = []
    # A type is drawn when the hash of (seed, type, id) falls under its rate; one loop over the types
    # with the id encoded once (~6 us of ~12 a positive less than a call per type). A type the positive
    # cannot show is not drawn (~1 us a draw; 2 of 8 types need a tool env).
    for maker, prefix, bound, needs in _draws(config.draw_key):
        if not can[needs]:
            continue
        digest = prefix.copy()
        digest.update(key)
        # 32 bytes against 8: below when the first 8 are, not when they are equal (longer is greater).
        if digest.digest() < bound:
            out.append(maker)
    return out


def _made(record: dict, makers: list[Callable], pools: EnvPools, seed: int) -> list[dict]:
    return [negative for maker in makers if (negative := maker(record, pools, seed)) is not None]


def negatives_of(record: dict, pools: EnvPools, config: NegativesConfig = NegativesConfig()) -> list[dict]:
    """The negatives of one record (none unless it is a positive), in type order."""
    return _made(record, drawn_makers(record, config), pools, config.seed)


def batch_negatives(records: pa.Table, parents: list[dict], pools: EnvPools, config: NegativesConfig) -> list[list[dict]]:
    """`negatives_of` each of a batch's kept trajectories (`records`, and as dicts without their
    turns `parents`). Only a positive drawn for some type has its turns converted from `records`
    (and set in its dict, `conversations`): a third of the positives draws none at the default
    rates, and the turns are most of what converting a record costs."""
    drawn = [drawn_makers(parent, config) for parent in parents]
    wanted = [i for i, makers in enumerate(drawn) if makers]
    if wanted:
        turns = records["conversations"].take(pa.array(wanted, pa.int64())).to_pylist()
        for i, conversations in zip(wanted, turns):
            parents[i]["conversations"] = conversations
    return [_made(parent, makers, pools, config.seed) if makers else [] for parent, makers in zip(parents, drawn)]


def _turn_rows(negative: list[dict], parent: list[dict], start: int, own: list[dict], base: int,
               placed: dict[int, int]) -> list[int]:
    """Where each turn of a negative's conversation is in the pool `negative_table` takes them from:
    `start` + j for its parent's turn j (the same dict, `_negative`, or an equal one: the same values),
    else `base` + its place in `own`, where it is added once (`placed`: by the turn's id, the pool row
    of each turn in `own`; an action loop repeats its own turn)."""
    rows = []
    for k, turn in enumerate(negative):
        if k < len(parent) and turn is parent[k]:
            rows.append(start + k)
            continue
        row = placed.get(id(turn))
        if row is None:
            # A parent's turn elsewhere (an action loop repeats the reply it loops on). Searched by
            # equality, in C: a new turn (`_turn`) has fewer keys than a staged one, and a dict of
            # another size is unequal at once (no map of the parent's turns per negative).
            if turn in parent:
                rows.append(start + parent.index(turn))
                continue
            row = placed[id(turn)] = base + len(own)
            own.append(turn)
        rows.append(row)
    return rows


def negative_table(records: pa.Table, parents: list[dict], negatives: list[list[dict]]) -> pa.Table:
    """The negatives (per trajectory of `records`, the batch's kept trajectories, and as dicts
    `parents`) as trajectory rows, made column-wise: the fields they share with their parent (all
    but OWN_FIELDS) taken from `records`, their turns from the parents' turns where a negative kept
    its parent's turn (the same dict), converted from Python only where new: the table
    `pa.Table.from_pylist` makes of the negatives, without converting every turn of every one."""
    schema = arrow_schema("trajectory")
    column = records["conversations"]
    conversations = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    offsets = conversations.offsets.to_numpy()
    turns, bounds = conversations.flatten(), (offsets - offsets[0]).tolist()
    taken: list[int] = []
    own: list[dict] = []
    placed: dict[int, int] = {}  # the negatives' turns (alive until the end: their ids are theirs) -> pool row
    rows: list[int] = []
    lengths: list[int] = []
    made = []
    for p, (parent, its_negatives) in enumerate(zip(parents, negatives)):
        for negative in its_negatives:
            at = _turn_rows(negative["conversations"], parent["conversations"], bounds[p], own, len(turns), placed)
            taken += at
            lengths.append(len(at))
            rows.append(p)
            made.append(negative)
    pool = pa.concat_arrays([turns, pa.array(own, turns.type)]) if own else turns
    list_offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
    columns = {"conversations": pa.ListArray.from_arrays(list_offsets, pool.take(pa.array(taken, pa.int64())),
                                                         type=schema.field("conversations").type)}
    for name in OWN_FIELDS:
        if name != "conversations":
            columns[name] = pa.array([n[name] for n in made], schema.field(name).type)
    shared = records.select([name for name in schema.names if name not in columns]).take(pa.array(rows, pa.int64()))
    return pa.Table.from_arrays([columns[name] if name in columns else shared[name] for name in schema.names],
                                schema=schema)
