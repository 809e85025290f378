"""The outputs of a build: one `Output` per config under `data/`, in `OUTPUTS`.

An output names its JSON Schema (schemas/<schema>.schema.json, which gives its Parquet schema), its
line in the dataset card, and how its rows are made:

- `rows`, per kept record: `write_unit` (pipeline/build/assemble.py) calls it on each record the
  global stages kept, in the registry's order, with what the outputs before it made of that record
  (`made`), and stages the rows per unit; shards are cut from those files in unit order. When no
  row maker reads the turns (`reads_turns` False), the records come as dicts without them
  (`conversations`): converting the turns is most of what converting a record costs, and most
  outputs read them in Arrow; of the other fields, only those some maker reads (`reads`). Or `batch`, the same rows
  made per staged batch, of its kept records in Arrow and as dicts (`negatives`: the turns of a
  positive are converted only when a negative type is drawn for it, and set in its dict, where
  the preference pairs and step labels read them). Or
  `table`, per staged batch: its rows made column-wise from the Arrow table of the batch's kept
  records, with the records as dicts and what the row makers made of each
  (preference pairs and step labels read the negatives). An output with both (`negatives`) has its
  rows made per batch, for the makers after it, and staged as its table maker's table. Or none of
  them, `staged` False (`sft`): its rows are the kept records as they are.
- `parts`, once per build: the staged files (path, Arrow bytes, rows) the shards are cut from, made
  from the units' staged files or from elsewhere (`grpo_env` adds the task files' tasks; the tree-search
  configs read the synthetic source's search outputs; `sft`, whose rows are the kept records as they
  are (`staged` False), reads them from the units' staged records, `kept.KeptRecords`, in place of a
  file). None: the output is not written by this build.
- `count`, what of a batch's rows (a row maker's dicts, a table maker's table) the report counts,
  and `report`, the output's sections of report.json.

`finalize` writes, reports and lists every output in this registry, and the card's table of configs
takes its notes from it; adding an output is one `Output` here (and its schema).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trajforge.pipeline.atomic import StreamingTable, read_batches
from trajforge.pipeline.build.config import BuildConfig
from trajforge.pipeline.build.kept import KeptRecords
from trajforge.pipeline.envs.tasks import Task, load_tasks
from trajforge.pipeline.quality.derived import (
    differences,
    grpo_env_row,
    grpo_prompts,
    preference_table,
    record_meta,
    record_task,
    reference_answer,
    step_label_table,
)
from trajforge.pipeline.quality.negatives import NegativesConfig, batch_negatives, negative_table
from trajforge.pipeline.quality.pools import EnvPools
from trajforge.pipeline.quality.search_steps import stage_step_rows
from trajforge.pipeline.registry import Registry
from trajforge.schemas import arrow_schema

# A staged file of an output (or a unit's kept records: `KeptRecords`): (it, uncompressed Arrow bytes, rows).
Part = tuple[str | KeptRecords, int, int]


@dataclass
class UnitContext:
    """What the row makers of one unit read besides the record, and what they note for the build."""
    pools: EnvPools
    negatives: NegativesConfig
    # task id -> the first answer of a synthetic trajectory of it (for the task files' grpo_env rows).
    synthetic_answers: dict[str, str] = field(default_factory=dict)


@dataclass
class UnitOutputs:
    """What `write_unit` staged and counted for one unit; small enough to pass between processes."""
    paths: dict[str, str] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    # Per output, what its `count` found in its rows.
    counts: dict[str, Counter] = field(default_factory=dict)
    # Quarantine rows of the unit's records that a global stage quarantined, in order.
    quarantined: list[dict] = field(default_factory=list)
    synthetic_answers: dict[str, str] = field(default_factory=dict)


@dataclass
class BuildOutputs:
    """The outputs' view of a build after every unit was written: what `parts` and `report` read."""
    units: list
    written: list[UnitOutputs]
    kept_rows: list[np.ndarray]  # per unit, sorted
    # Per unit, {row: (reason, detail)} of the records a global stage quarantined.
    quarantined: list[dict[int, tuple[str, str]]]
    config: BuildConfig
    staged: Path
    # Per unit, {row: repeat} of the kept records whose id repeats an earlier one's (`assemble.unique_ids`).
    repeats: list[dict[int, int]]
    # Filled as the outputs are staged: rows and counts per output.
    rows: dict[str, int] = field(default_factory=dict)
    counts: dict[str, Counter] = field(default_factory=dict)

    def unit_parts(self, name: str) -> list[Part]:
        return [(w.paths[name], w.nbytes[name], w.rows[name]) for w in self.written]

    def kept_parts(self, name: str) -> list[Part]:
        """The units' kept records, as the rows of an output of them as they are (`Output.staged`
        False), which its writers counted."""
        return [(KeptRecords(unit.records_path, rows, repeats), w.nbytes[name], w.rows[name])
                for unit, rows, repeats, w in zip(self.units, self.kept_rows, self.repeats, self.written)]

    @cached_property
    def tasks(self) -> list[Task]:
        return [t for path in self.config.rl_tasks for t in load_tasks(path)]

    @cached_property
    def runnable_tasks(self) -> list[Task]:
        return [t for t in self.tasks if not t.skip_reason]

    @cached_property
    def search_steps(self) -> tuple[dict[str, list[Part]], dict]:
        """The tree-search step rows staged per config, and their counts (pipeline/quality/search_steps.py)."""
        return stage_step_rows(self.units, self.kept_rows, self.quarantined, self.staged)


RowMaker = Callable[[dict, dict[str, list[dict]], UnitContext], list[dict]]
# (the batch's kept records in Arrow, the same as dicts without their turns) -> the rows of each record
BatchRowMaker = Callable[[pa.Table, list[dict], UnitContext], list[list[dict]]]
# (the batch's kept records in Arrow, the same as dicts, per row maker what it made of each record)
TableMaker = Callable[[pa.Table, list[dict], dict[str, list[list[dict]]]], pa.Table]


@dataclass(frozen=True)
class Output:
    """One config under data/ (see the module's docstring for each field)."""
    name: str
    schema: str
    note: str
    rows: RowMaker | None = None
    # Whether `rows` reads a record's turns (`conversations`): when no row maker does, the records
    # reach the makers as dicts without them (see the module's docstring).
    reads_turns: bool = True
    # The other fields of a record that its makers (`rows`, `batch`, `table`) read from the dicts: only
    # those are converted from Arrow (`write_unit`), ~40 % of converting a record without its turns.
    reads: tuple[str, ...] = ()
    batch: BatchRowMaker | None = None
    table: TableMaker | None = None
    # False: its rows are the kept records as they are (no maker), which the unit writers count and
    # do not stage; its shards read them from the units' staged records.
    staged: bool = True
    parts: Callable[[BuildOutputs], list[Part] | None] | None = None
    count: Callable[[list[dict] | pa.Table], Iterable | Mapping] | None = None
    report: Callable[[BuildOutputs], dict] | None = None

    def staged_parts(self, build: BuildOutputs) -> list[Part] | None:
        if self.parts is not None:
            return self.parts(build)
        return build.unit_parts(self.name) if self.staged else build.kept_parts(self.name)


# -- row makers (per kept record) and table makers (per staged batch) ---------------------------

def _grpo_prompts(kept: pa.Table, records: list[dict], made: dict) -> pa.Table:
    return grpo_prompts(kept)


def _negatives(kept: pa.Table, records: list[dict], unit: UnitContext) -> list[list[dict]]:
    return batch_negatives(kept, records, unit.pools, unit.negatives)


def _negative_rows(kept: pa.Table, records: list[dict], made: dict) -> pa.Table:
    """The negatives the row maker made, as a table taken column-wise from their parents' rows."""
    return negative_table(kept, records, made["negatives"])


def _differences(records: list[dict], made: dict) -> list:
    """Where each negative of the batch differs from its parent (`derived.differences`): read by the
    preference pairs and the step labels, found once a batch (kept in `made`)."""
    if "negatives:differences" not in made:
        made["negatives:differences"] = differences(records, made["negatives"])
    return made["negatives:differences"]


def _preference_pairs(kept: pa.Table, records: list[dict], made: dict) -> pa.Table:
    """A pair per negative of each record (its parent), where they differ on a reply."""
    return preference_table(kept, records, made["negatives"], _differences(records, made))


def _grpo_env_task(record: dict, made: dict, unit: UnitContext) -> list[dict]:
    """The grpo_env row of a positive's resettable task (repeats go in `_grpo_env_parts`); a
    synthetic positive also lends its answer to its task-file task."""
    if record["kind"] != "positive":
        return []
    task_id = record_meta(record["meta"]).get("task_id") if record["source"] == "synthetic" else None
    if task_id is not None and record["answer"] is not None:
        unit.synthetic_answers.setdefault(task_id, record["answer"])
    task = record_task(record)
    if task is None:
        return []
    return [grpo_env_row(task, record["source"], row_id=task.id, env=record["env"], answer=record["answer"])]


def _step_labels(kept: pa.Table, records: list[dict], made: dict) -> pa.Table:
    return step_label_table(kept, records, made["negatives"], _differences(records, made))


# -- staged parts (per build) ------------------------------------------------------------------

def first_task_rows(parts: list[str], path: Path, seen: set[str]) -> Part:
    """The units' grpo_env rows (`parts`, in unit order) without the tasks in `seen` or an earlier
    row already gave, staged at `path`."""
    with StreamingTable(path, arrow_schema("grpo_env"), durable=False) as writer:
        for part in parts:
            for batch in read_batches(part):
                for row in batch.to_pylist():
                    if row["id"] not in seen:
                        seen.add(row["id"])
                        writer.append(row)
    return str(writer.path), writer.nbytes, writer.count


def _grpo_env_parts(build: BuildOutputs) -> list[Part]:
    """The task files' runnable tasks first (a task takes the first answer of a synthetic trajectory
    of it when its file knows none), then each kept positive's resettable task, once."""
    answers: dict[str, str] = {}
    for part in build.written:
        for task_id, answer in part.synthetic_answers.items():
            answers.setdefault(task_id, answer)
    with StreamingTable(build.staged / "grpo_env.arrow", arrow_schema("grpo_env"), durable=False) as task_rows:
        for task in build.runnable_tasks:
            task_rows.append(grpo_env_row(task, "tasks", answer=reference_answer(task) or answers.get(task.id)))
    records = first_task_rows([w.paths["grpo_env"] for w in build.written], build.staged / "grpo_env_records.arrow",
                              {t.id for t in build.runnable_tasks})
    return [(str(task_rows.path), task_rows.nbytes, task_rows.count), records]


def _search_step_parts(name: str) -> Callable[[BuildOutputs], list[Part] | None]:
    return lambda build: build.search_steps[0].get(name)


# -- counts and report sections ----------------------------------------------------------------

def _negative_types(rows: pa.Table) -> list[str]:
    return rows["negative_type"].to_pylist()


def _labelled_steps(rows: pa.Table) -> Counter:
    """(label source, label) of every labelled message, counted in Arrow: the messages are neither
    copied into one chunk nor converted to Python (1.4 % of the unit writers' instructions at 20k)."""
    messages = pc.list_flatten(rows["messages"])
    label = pc.struct_field(messages, "label")
    pairs = pa.table({"source": pc.struct_field(messages, "label_source"), "label": label}).filter(pc.is_valid(label))
    counted = pairs.group_by(["source", "label"], use_threads=False).aggregate([([], "count_all")])
    return Counter(dict(zip(zip(counted["source"].to_pylist(), counted["label"].to_pylist()),
                            counted["count_all"].to_pylist())))


def _negatives_report(build: BuildOutputs) -> dict:
    negatives, pairs = build.rows["negatives"], build.rows["preference"]
    return {"negatives": {"total": negatives, "by_type": dict(sorted(build.counts["negatives"].items())),
                          "preference_pairs": pairs, "without_pair": negatives - pairs}}


def _grpo_report(build: BuildOutputs) -> dict:
    return {"grpo_prompts": build.rows["grpo"]}


def _grpo_env_report(build: BuildOutputs) -> dict:
    return {"grpo_env": {"rows": build.rows["grpo_env"],
                         "unrunnable_tasks": len(build.tasks) - len(build.runnable_tasks)}}


def _step_labels_report(build: BuildOutputs) -> dict:
    steps = {f"{source}:{'good' if label else 'bad'}": n for (source, label), n in sorted(build.counts["step_labels"].items())}
    return {"step_labels": {"rows": build.rows["step_labels"], "steps": steps}}


def _search_steps_report(build: BuildOutputs) -> dict:
    counts = build.search_steps[1]
    return {"search_steps": counts} if counts else {}


# In this order: a row maker reads what the outputs before it made of the record (`made`).
OUTPUTS: Registry[Output] = Registry("output", {output.name: output for output in [
    Output("sft", "trajectory", "positive trajectories for supervised fine-tuning (loss on assistant turns)",
           staged=False),
    Output("negatives", "trajectory", "trajectories with a known defect (`negative_type`, `parent_id`)",
           batch=_negatives, table=_negative_rows, count=_negative_types, report=_negatives_report,
           reads=("id", "kind", "domain", "env", "answer", "meta")),
    Output("preference", "preference", "chosen/rejected pairs for DPO", table=_preference_pairs, reads=("meta",)),
    Output("grpo", "grpo", "prompts with reference answers for GRPO", table=_grpo_prompts, report=_grpo_report),
    Output("grpo_env", "grpo_env", "environment tasks (os, db, agentgym) for multi-turn GRPO with tool calls",
           rows=_grpo_env_task, reads_turns=False, parts=_grpo_env_parts, report=_grpo_env_report,
           reads=("kind", "source", "source_id", "source_file", "env", "task", "answer", "meta")),
    Output("step_labels", "step_labels", "assistant steps labelled good/bad for process reward models",
           table=_step_labels, count=_labelled_steps, report=_step_labels_report, reads=("meta",)),
    Output("step_pairs", "step_pairs", "step-level DPO pairs from tree searches: at a shared prefix, a step that "
           "led to success vs one that did not", parts=_search_step_parts("step_pairs"), report=_search_steps_report),
    Output("step_values", "step_values", "process-reward labels from tree searches: per step, the share of "
           "rollouts through it that succeeded", parts=_search_step_parts("step_values"), report=_search_steps_report),
]})


def card_notes() -> dict[str, str]:
    """Config name -> its line in the dataset card."""
    return {output.name: output.note for output in OUTPUTS.values()}
