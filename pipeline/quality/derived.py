"""Datasets derived from the trajectories: DPO preference pairs and GRPO prompts.

Preference pairs (schemas/preference.schema.json) are in TRL's conversational format: `prompt`,
`chosen` and `rejected` are lists of `{role, content}` messages. A pair comes from a negative and
its parent at the first turn where they differ: the turns before it are the shared prompt, the
parent's turn is chosen, the negative's rejected. When the negative changed the prompt itself
(`irrelevant_tools` swaps the offered tools) the parent has no turn for that context; the negative
then carries the right reply in its meta (`chosen`) and the pair uses the negative's context.

GRPO prompts (schemas/grpo.schema.json) are the conversation up to the first trained assistant
turn, with what a reward needs: the reference answer, the reference actions, env and domain.
Instructions, acknowledgement and upstream demonstrations stay in the prompt: they are the
context the agent acts in.

GRPO environment tasks (schemas/grpo_env.schema.json) are whole episodes to run: the tool-format
prompt, the environment and the task payload it resets to (what the env spec says of them), from task
files and from trajectories recorded on a task an environment can load (AgentTraj-L items).

Step labels (schemas/step_labels.schema.json) supervise a process reward model: each assistant step
of a trajectory labelled good or bad, with where the label comes from (`step_labels_of`).
"""
from __future__ import annotations

import functools
import json
import json.scanner

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajforge.pipeline.envs import recorded_in, spec
from trajforge.pipeline.envs.tasks import Task
from trajforge.schemas import arrow_schema


def _divergence(parent: list[dict], negative: list[dict]) -> int | None:
    for k, (turn, other) in enumerate(zip(negative, parent)):
        # A negative shares its parent's turns up to its change (the same dicts): no comparison there.
        if turn is not other and (turn["role"] != other["role"] or turn["content"] != other["content"]):
            return k
    return len(parent) if len(negative) > len(parent) else None


# JSON's C scanner, called directly: `json.loads` wraps it in three Python calls and two regex
# matches, ~2.5 of ~3 us for a meta of a few keys.
_SCAN_JSON = json.scanner.make_scanner(json.JSONDecoder())


@functools.lru_cache(maxsize=16)
def record_meta(meta: str) -> dict:
    """A record's meta (its JSON text) parsed, shared by the makers that read it (a positive's
    negatives, a negative's pair and step labels ask for the same text): never change the dict in
    place. What `json.loads` returns, or raises: a text the scanner does not read whole (space
    around it, something after it, no JSON at its start) goes to `json.loads`."""
    try:
        value, end = _SCAN_JSON(meta, 0)
    except StopIteration:
        end = -1
    return value if end == len(meta) else json.loads(meta)


def _names(meta: str, key: str) -> bool:
    """Whether a meta (its JSON text) may have `key`: the text of an object names its keys in quotes.
    Most metas have none of the keys the step makers look for, and are not parsed for them."""
    return f'"{key}"' in meta


def _chosen_reply(meta: str) -> str | None:
    """The right reply a negative's meta carries (`chosen`), if any."""
    return record_meta(meta).get("chosen") if _names(meta, "chosen") else None


# Of a negative and its parent: the first turn where they differ (`_divergence`), and the right reply
# the negative's meta carries (`chosen`), if any. Both the pair and the step labels read it.
Difference = tuple[int | None, str | None]


def difference_of(negative: dict, parent: dict) -> Difference:
    return _divergence(parent["conversations"], negative["conversations"]), _chosen_reply(negative["meta"])


def differences(parents: list[dict], negatives: list[list[dict]]) -> list[list[Difference]]:
    """`difference_of` each of `negatives` (per parent) and its parent: found once for a batch's pairs
    and step labels (`preference_table`, `step_label_table`)."""
    return [[difference_of(negative, parent) for negative in its_negatives]
            for parent, its_negatives in zip(parents, negatives)]


def pair_of(negative: dict, parent: dict, difference: Difference | None = None) -> tuple[int, str | None] | None:
    """Where the DPO pair of a negative and its parent is, as (k, chosen): its prompt is the first k
    turns, of the parent's, or the negative's own when it carries the right reply (`chosen`); its
    chosen reply `chosen`, else the parent's turn k; its rejected reply the negative's turn k. None
    when they never differ on a reply. `difference`: theirs, when already found."""
    neg, par = negative["conversations"], parent["conversations"]
    diverged, chosen = difference or difference_of(negative, parent)
    if chosen is not None:
        k = len(neg) - 1
    else:
        k = diverged
        if k is None or k >= len(par) or par[k]["role"] != "assistant":
            return None
    if k == 0 or neg[k]["role"] != "assistant":
        return None
    return k, chosen


def preference_table(records: pa.Table, parents: list[dict], negatives: list[list[dict]],
                     found: list[list[Difference]] | None = None) -> pa.Table:
    """The DPO pairs (`pair_of`) of a batch's kept trajectories (`records`, and as dicts `parents`) and
    their `negatives` (per trajectory), in order, made column-wise: a prompt of the parent's turns and
    its chosen reply are taken from `records`, the rest from the negative's turns; the parent's
    fields (`parent_id`, source, domain, env) taken from `records` too. `found`: their
    `differences`, when already found."""
    schema = arrow_schema("preference")
    turns, bounds = _batch_turns(records)
    new: list[tuple[str, str]] = []  # messages not of the parents' turns, after them
    of: list[int] = []  # per pair: its parent's row in `records`
    negative_ids: list[str] = []
    negative_types: list[str] = []
    spans: list[tuple[int, int, int, int, int, int]] = []  # per pair: prompt, chosen, rejected
    for p, (parent, start, its_negatives, its_differences) in enumerate(zip(
            parents, bounds[:-1].tolist(), negatives, found or differences(parents, negatives))):
        for negative, difference in zip(its_negatives, its_differences):
            pair = pair_of(negative, parent, difference)
            if pair is None:
                continue
            k, chosen = pair
            neg, at = negative["conversations"], len(turns) + len(new)
            if chosen is None:
                spans.append((start, start + k, start + k, start + k + 1, at, at + 1))
            else:
                new += [(t["role"], t["content"]) for t in neg[:k]] + [("assistant", chosen)]
                spans.append((at, at + k, at + k, at + k + 1, at + k + 1, at + k + 2))
            new.append((neg[k]["role"], neg[k]["content"]))
            of.append(p)
            negative_ids.append(negative["id"])
            negative_types.append(negative["negative_type"])
    roles, contents = zip(*new) if new else ((), ())
    pool = pa.StructArray.from_arrays([pa.concat_arrays([turns.field("role"), pa.array(roles, pa.string())]),
                                       pa.concat_arrays([turns.field("content"), pa.array(contents, pa.string())])],
                                      fields=list(schema.field("prompt").type.value_type))
    spans_at = np.asarray(spans, dtype=np.int64).reshape(-1, 3, 2)
    columns = {name: _lists(pool, spans_at[:, [i]], schema.field(name).type)
               for i, name in enumerate(("prompt", "chosen", "rejected"))}
    parent_rows = pa.array(of, pa.int64())
    negative_id = pa.array(negative_ids, pa.string())
    columns.update(id=pc.binary_join_element_wise(negative_id, "#pair", ""), parent_id=records["id"].take(parent_rows),
                   negative_id=negative_id, negative_type=pa.array(negative_types, pa.string()),
                   **{name: records[name].take(parent_rows) for name in ("source", "domain", "env")})
    return pa.Table.from_arrays([columns[name] for name in schema.names], schema=schema)


def _batch_turns(records: pa.Table) -> tuple[pa.StructArray, np.ndarray]:
    """The turns of every trajectory of `records` in one array, and the bounds of each trajectory's
    turns in it (the list offsets, from 0)."""
    column = records["conversations"]
    conversations = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()  # the chunk uncopied
    offsets = conversations.offsets.to_numpy()
    return conversations.flatten(), offsets - offsets[0]


def _ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices of every range [start, end) in turn, and the list offsets that cut them apart."""
    lengths = ends - starts
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], lengths), offsets


def _lists(pool: pa.StructArray, spans: np.ndarray, messages: pa.ListType) -> pa.ListArray:
    """One list of `pool`'s messages per row of `spans` (rows x ranges x [start, end)): its ranges in turn."""
    at, offsets = _ranges(spans[:, :, 0].ravel(), spans[:, :, 1].ravel())
    return pa.ListArray.from_arrays(offsets[::spans.shape[1]], pool.take(at), type=messages)


def grpo_prompts(records: pa.Table) -> pa.Table:
    """The RL prompts of the positive trajectories of `records` (trajectory rows), made column-wise:
    each positive's conversation up to its first trained assistant turn, with its reference answer
    and actions (those of the trained turns from there on); none for a positive without a trained
    assistant turn after its first turn."""
    schema = arrow_schema("grpo")
    # Ranges over every record's turns, the positives picked by `has`: filtering the records first
    # would copy every column of theirs, the turns' texts included.
    turns, bounds = _batch_turns(records)
    starts, ends = bounds[:-1], bounds[1:]
    action = turns.field("action")
    trained = np.asarray(pc.and_(pc.equal(turns.field("role"), "assistant"), turns.field("loss")))
    trained_at = np.flatnonzero(trained)
    after = np.searchsorted(trained_at, starts)
    first = np.append(trained_at, ends[-1] if len(ends) else 0)[after]
    has = (first > starts) & (first < ends) & np.asarray(pc.equal(records["kind"], "positive"), dtype=bool)
    starts, ends, first = starts[has], ends[has], first[has]
    prompt_at, prompt_offsets = _ranges(starts, first)
    messages = pa.StructArray.from_arrays([turns.field("role").take(prompt_at), turns.field("content").take(prompt_at)],
                                          fields=list(schema.field("prompt").type.value_type))
    acted = np.flatnonzero(trained & np.asarray(pc.fill_null(pc.not_equal(action, ""), False)))
    actions_at, actions_offsets = _ranges(np.searchsorted(acted, first), np.searchsorted(acted, ends))
    columns = {
        "prompt": pa.ListArray.from_arrays(prompt_offsets, messages, type=schema.field("prompt").type),
        "expected_actions": pa.ListArray.from_arrays(actions_offsets, action.take(acted[actions_at]),
                                                     type=schema.field("expected_actions").type),
        "first_action": action.take(first), "dialect": turns.field("dialect").take(first)}
    kept = records.select([name for name in schema.names if name not in columns]).filter(pa.array(has))
    return pa.Table.from_arrays([columns[name] if name in columns else kept[name] for name in schema.names],
                                schema=schema)


def grpo_env_row(task: Task, source: str, row_id: str | None = None, env: str | None = None,
                 answer: str | None = None) -> dict:
    """The RL task of a `pipeline.envs.tasks.Task` (schemas/grpo_env.schema.json): its env's tool-format
    instructions and the first observation where the task fixes it (an env that sends its own at
    reset gets ""), the environment to run it in, and the task payload it resets to."""
    environment = spec(task.env)
    first = environment.first_prompt(task) if environment.first_prompt else ""
    return {"id": row_id or task.id, "source": source, "environment": task.env,
            "env": env or task.data.get("env_name") or task.env, "task": task.description,
            "prompt": [{"role": "system", "content": environment.tool_instructions},
                       {"role": "user", "content": first}],
            "env_task": json.dumps(task.as_dict(), ensure_ascii=False, sort_keys=True),
            "answer": answer if answer is not None else reference_answer(task)}


def reference_answer(task: Task) -> str | None:
    """What a correct episode answers, where the task file says (its env spec knows where: an OS
    `match` answer, a DB SELECT label); tasks scored by a check script or a table hash have none."""
    return spec(task.env).reference_answer(task)


def record_task(record: dict) -> Task | None:
    """The task an environment can reset to for a recorded trajectory (AgentTraj-L items, read by the
    spec of the env the trajectory runs in), or None."""
    environment = recorded_in(record["env"])
    return environment.recorded_task(record) if environment.recorded_task else None


GOOD, BAD = 1, 0  # step labels


# The sources of the labels: good steps of a trajectory, bad ones (`step_label_table` adds `negative`).
LABEL_SOURCES = pa.array(["refused", "critical", "salvage", "trajectory"])
REFUSED, CRITICAL, SALVAGE, TRAJECTORY = range(4)


def turn_labels(turns: pa.StructArray, bounds: np.ndarray, metas: list[str]) -> tuple[pa.Array, pa.Array]:
    """The step label of each of `turns` (the turns of trajectories the build keeps: they succeeded,
    or show the right behaviour; trajectory i's are turns[bounds[i]:bounds[i + 1]], its meta metas[i]),
    and its source: a trained step is good, named `critical` when select-steps flagged it, `salvage`
    when it came from a failed run's prefix that a salvage continuation completed, else
    `trajectory`; a step validation masked because the env refused it (meta `masked_steps`) is bad
    (`refused`); the rest is context (null)."""
    assistant = np.asarray(pc.equal(turns.field("role"), "assistant"), dtype=bool)
    trained = assistant & np.asarray(pc.fill_null(turns.field("loss"), False), dtype=bool)
    critical = np.asarray(pc.fill_null(turns.field("critical"), False), dtype=bool)
    refused, salvaged = np.zeros(len(turns), dtype=bool), np.zeros(len(turns), dtype=bool)
    for i, text in enumerate(metas):
        if _names(text, "masked_steps") or _names(text, "beneficial_steps"):
            start, end = bounds[i], bounds[i + 1]
            meta = record_meta(text)
            masked = [start + step["turn"] for step in meta.get("masked_steps", []) if 0 <= step["turn"] < end - start]
            refused[masked] = True
            # beneficial_steps: indexes of the salvaged record's actions in its replayed prefix
            actions = start + np.flatnonzero(assistant[start:end] & np.asarray(
                pc.fill_null(pc.not_equal(turns.field("action").slice(start, end - start), ""), False), dtype=bool))
            steps = [k for k in set(meta.get("beneficial_steps", [])) if 0 <= k < len(actions)]
            salvaged[actions[steps]] = True
    refused &= assistant
    trained &= ~refused
    source = np.select([refused, trained & critical, trained & salvaged, trained], [REFUSED, CRITICAL, SALVAGE, TRAJECTORY], -1)
    labelled = source >= 0
    label = pa.array(np.where(refused, BAD, GOOD), mask=~labelled)
    return label, LABEL_SOURCES.take(pa.array(source, mask=~labelled))


_TURN = arrow_schema("trajectory").field("conversations").type.value_type


def labelled_messages(record: dict) -> list[dict]:
    """The step_labels messages of a kept trajectory: its turns with their `turn_labels`."""
    turns = pa.array(record["conversations"], _TURN)
    label, source = turn_labels(turns, np.array([0, len(turns)]), [record["meta"]])
    return _labelled(record["conversations"], zip(label.to_pylist(), source.to_pylist()))


def _labelled(turns: list[dict], labels) -> list[dict]:
    return [{"role": t["role"], "content": t["content"], "label": label, "label_source": source}
            for t, (label, source) in zip(turns, labels)]


def step_labels_of(record: dict) -> dict | None:
    """The step_labels row of a kept trajectory, or None when no step of it is labelled."""
    messages = labelled_messages(record)
    if all(m["label"] is None for m in messages):
        return None
    return {**dict(zip(STEP_ROW, _step_row(record, record, "positive"))), "messages": messages}


STEP_ROW = ("id", "record_id", "kind", "negative_type", "source", "domain", "env")


def _step_row(of: dict, parent: dict, kind: str) -> tuple:
    """The fields of a step_labels row (STEP_ROW) but its messages, those of the trajectory `of` (a
    kept one or a negative of `parent`)."""
    return f"{of['id']}#steps", of["id"], kind, of["negative_type"], parent["source"], parent["domain"], parent["env"]


def negative_steps(negative: dict, parent: dict, difference: Difference | None = None) -> tuple[int, int] | None:
    """Where a negative's step_labels row stops, as (same, bad): it is its turns up to the step where
    it goes wrong (`bad`: the rejected turn of its preference pair), that step bad (`negative`), the
    `same` first of them labelled as in the parent (the context is still the parent's), those
    between unlabelled; None when the wrong step is no assistant turn. Nothing after the first error
    is labelled: what follows a wrong step says nothing about the steps themselves. `difference`:
    theirs, when already found."""
    neg = negative["conversations"]
    diverged, chosen = difference or difference_of(negative, parent)
    bad = len(neg) - 1 if chosen is not None else diverged
    if bad is None or neg[bad]["role"] != "assistant":
        return None
    return (bad if diverged is None else min(diverged, bad)), bad


def step_label_table(records: pa.Table, parents: list[dict], negatives: list[list[dict]],
                     found: list[list[Difference]] | None = None) -> pa.Table:
    """The step_labels rows of a batch's kept trajectories (`records`, and as dicts `parents`) and of
    their `negatives` (per trajectory), those with a labelled step: a trajectory's row, then its
    negatives' (`negative_steps`). Made column-wise: each message is a trajectory's turn (role and
    content taken from `records`) or a negative's own turn, with its label; a row's fields
    (STEP_ROW) are its trajectory's, taken from `records`, or its negative's. `found`: the
    negatives' `differences`, when already found."""
    schema = arrow_schema("step_labels")
    turns, bounds = _batch_turns(records)
    label, source = turn_labels(turns, bounds, [parent["meta"] for parent in parents])
    labelled = np.concatenate([[0], np.cumsum(np.asarray(label.is_valid(), dtype=bool))])
    # Every turn of the batch's trajectories, then the negatives' own turns (`own`): the messages are
    # taken from them, each row's as two ranges (of its parent's turns, of its own).
    own: list[dict] = []
    negative_rows: list[tuple[int, int, int]] = []  # per negative's row: its parent's, `same`, its own turns' end
    negative_ids: list[str] = []
    negative_types: list[str] = []
    for p, (parent, its_negatives, its_differences) in enumerate(zip(
            parents, negatives, found or differences(parents, negatives))):
        for negative, difference in zip(its_negatives, its_differences):
            steps = negative_steps(negative, parent, difference)
            if steps is not None:
                same, bad = steps
                own += negative["conversations"][same:bad + 1]
                negative_rows.append((p, same, len(own)))
                negative_ids.append(negative["id"])
                negative_types.append(negative["negative_type"])
    negative_at = np.asarray(negative_rows, dtype=np.int64).reshape(-1, 3)
    rows, spans = _step_rows(bounds, labelled, negative_at, len(turns))
    # The last own turn of each negative is its bad step (`negative`); the others are unlabelled.
    bad = np.zeros(len(own), dtype=bool)
    bad[negative_at[:, 2] - 1] = True
    pool = pa.StructArray.from_arrays(
        [pa.concat_arrays([turns.field("role"), pa.array([t["role"] for t in own], pa.string())]),
         pa.concat_arrays([turns.field("content"), pa.array([t["content"] for t in own], pa.string())]),
         pa.concat_arrays([label, pa.array(np.full(len(own), BAD), pa.int64(), mask=~bad)]),
         pa.concat_arrays([source, pa.array(["negative"], pa.string()).take(pa.array(np.zeros(len(own), dtype=np.int64), mask=~bad))])],
        fields=list(schema.field("messages").type.value_type))
    messages = _lists(pool, spans, schema.field("messages").type)
    return pa.Table.from_arrays([*_step_columns(records, rows, negative_ids, negative_types), messages], schema=schema)


def _step_rows(bounds: np.ndarray, labelled: np.ndarray, negative_rows: np.ndarray, own_at: int) -> tuple[np.ndarray, np.ndarray]:
    """The step_labels rows of a batch in order, as (parent row, negative or not, the negative's place)
    rows, and their message spans (rows x [parent turns, own turns] x [start, end): `_lists`): each
    trajectory with a labelled turn (`labelled`: the count of labelled turns before each), then its
    negatives (`negative_rows`: parent row, turns kept as the parent's, own turns' end in the pool
    after `own_at`)."""
    starts = bounds[:-1]
    positive = np.flatnonzero(labelled[bounds[1:]] > labelled[starts])
    parent, same, own_end = negative_rows.T
    own_start = np.concatenate([[0], own_end])[:-1]
    at = np.concatenate([positive, parent])
    order = np.argsort(2 * at + np.repeat([0, 1], [len(positive), len(parent)]), kind="stable")
    rows = np.stack([at, np.repeat([0, 1], [len(positive), len(parent)]),
                     np.concatenate([np.zeros(len(positive), dtype=np.int64), np.arange(len(parent))])], axis=1)[order]
    spans = np.stack([
        np.concatenate([starts[positive], starts[parent]]),
        np.concatenate([bounds[1:][positive], starts[parent] + same]),
        np.concatenate([np.full(len(positive), own_at), own_at + own_start]),
        np.concatenate([np.full(len(positive), own_at), own_at + own_end])], axis=1)[order]
    return rows, spans.reshape(-1, 2, 2)


def _step_columns(records: pa.Table, rows: np.ndarray, negative_ids: list[str], negative_types: list[str]) -> list:
    """The STEP_ROW columns of the step_labels `rows` (`_step_rows`): a trajectory's own fields from
    `records`, a negative's id and type, its parent's source, domain and env."""
    negative = rows[:, 1] == 1
    # A row's trajectory: a kept one (its row in `records`) or a negative (after them).
    of = pa.array(np.where(negative, records.num_rows + rows[:, 2], rows[:, 0]), pa.int64())
    record_id = pa.concat_arrays([_array(records["id"]), pa.array(negative_ids, pa.string())]).take(of)
    negative_type = pa.concat_arrays([_array(records["negative_type"]), pa.array(negative_types, pa.string())]).take(of)
    kind = pa.array(["positive", "negative"], pa.string()).take(pa.array(negative.astype(np.int64)))
    parents = pa.array(rows[:, 0], pa.int64())
    return [pc.binary_join_element_wise(record_id, "#steps", ""), record_id, kind, negative_type,
            *(records[name].take(parents) for name in ("source", "domain", "env"))]


def _array(column: pa.ChunkedArray) -> pa.Array:
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
