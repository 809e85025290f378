"""The held-out evaluation splits, declared once, per environment.

Every split names its task files (shipped with the package, in `tasks/` beside this module) and how a training trajectory is
recognised as one of its tasks:

- `text`: the task text. AgentBench's OS and DB tasks are written questions; a trajectory whose
  task shares a word n-gram with one (`pipeline.quality.dedup.Contamination`) is the same task.
- `item`: the AgentGym item. BabyAI's missions are a handful of templates ("go to the red ball")
  shared by thousands of levels, so task text says nothing; the level and seed behind the item id
  (`babyai_<n>`) is what makes a task. A trajectory of the split's env whose `source_id` names one
  of its items (AgentTraj-L's `babyai_<n>`, a synthetic `babyai_<n>~k` or `r2-babyai_<n>~k`) is the
  same task.

The build's decontamination reads every split by default (`BuildConfig.decontaminate_splits`), so
their tasks never reach the training data; `trajforge eval` runs them and checks the training
data of the model it evaluates against them (`training_overlap`).

Envs without a split here, and why: `textcraft` (its tasks cannot be rebuilt from an item id, and
the only task texts in reach are AgentTraj-L's training rows), `sciworld` (no task held out from
AgentTraj-L is known with a reference solution here), the `agentgym` HTTP envs and their tool envs
(need a server; run them with `trajforge eval --tasks FILE --agentgym-url URL`).
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from trajforge.pipeline.envs import specs
from trajforge.pipeline.envs.tasks import Task, load_tasks
from trajforge.pipeline.registry import Registry

TASKS = Path(__file__).resolve().parent / "tasks"


@dataclass(frozen=True)
class EvalSplit:
    name: str
    env: str
    files: tuple[str, ...]      # relative to TASKS
    held_out_by: str            # text | item
    about: str

    def paths(self) -> list[Path]:
        return [TASKS / f for f in self.files]

    def tasks(self) -> list[Task]:
        missing = [str(p) for p in self.paths() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"eval split {self.name}: task file(s) not found: {', '.join(missing)} "
                                    f"(they ship in {TASKS}: reinstall trajforge)")
        return [task for path in self.paths() for task in load_tasks(path)]

    def fingerprint(self) -> str:
        """Which version of the split a build was cleaned of."""
        return fingerprint_of(self.paths())


def fingerprint_of(paths: Iterable[Path]) -> str:
    """sha256 of task files' bytes, in order (16 hex digits)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:16]


# Each env spec declares its held-out split (pipeline/envs).
EVAL_SPLITS: Registry[EvalSplit] = Registry("eval split", {
    name: EvalSplit(env=name, **env.eval_split) for name, env in specs().items() if env.eval_split})


# --- recognising a split's tasks in training data ---------------------------------------------------
_ITEM = re.compile(r"^(?:r\d+-)?([a-z_]+?_\d+)(?:~\d+)?$")


def item_key(env: str, source_id: str | None) -> tuple[str, str] | None:
    """(env, `<env>_<n>`) when a training record's `source_id` names an AgentGym item."""
    found = _ITEM.match(source_id or "")
    return (env, found.group(1)) if found else None


def task_item(task: Task) -> tuple[str, str]:
    value = task.data.get("item_id", task.data.get("data_idx"))
    item = value if isinstance(value, str) and "_" in str(value) else f"{task.env}_{value}"
    return task.env, str(item)


@dataclass
class HeldOut:
    """What decontamination matches: the task texts of `text` splits, the items of `item` splits."""
    texts: list[str]
    items: dict[tuple[str, str], str]   # (env, item) -> split name
    splits: dict[str, str]              # split name -> fingerprint

    @classmethod
    def of(cls, splits: Iterable[EvalSplit]) -> HeldOut:
        texts, items, names = [], {}, {}
        for split in splits:
            names[split.name] = split.fingerprint()
            for task in split.tasks():
                if split.held_out_by == "text":
                    texts.append(task.description)
                else:
                    items[task_item(task)] = split.name
        return cls(texts, items, names)

    def item_match(self, env: str, source_id: str | None) -> str | None:
        key = item_key(env, source_id)
        split = self.items.get(key) if key else None
        return None if split is None else f"trajectory of {key[1]}, an item of the eval split {split}"


def declared_held_out() -> HeldOut:
    return HeldOut.of(EVAL_SPLITS.values())


def _held_at_build(train_dir: Path) -> dict[str, str]:
    """Split name -> fingerprint of the splits the build's report lists as held out whole."""
    import json

    try:
        held_out = json.loads((train_dir / "report.json").read_text()).get("held_out", {})
    except (OSError, ValueError):
        held_out = {}
    # A build that spared some tasks of its splits is checked record by record.
    return {} if held_out.get("spared") else held_out.get("splits", {})


def _records_of(split: EvalSplit | None, tasks: list[Task], files: list[Path]) -> int:
    """Records in the sft `files` that are one of `tasks`: by AgentGym item for an `item` split, else by task text."""
    import pyarrow.parquet as pq

    from trajforge.pipeline.quality.dedup import Contamination

    by_item = split is not None and split.held_out_by == "item"
    index = None if by_item else Contamination([t.description for t in tasks])
    items = {task_item(t) for t in tasks} if by_item else set()
    count = 0
    for path in files:
        table = pq.read_table(path, columns=["task", "env", "source_id"]).to_pylist()
        count += (sum(item_key(r["env"], r["source_id"]) in items for r in table) if by_item
                  else sum(hit is not None for hit in index.matches([r["task"] or "" for r in table])))
    return count


def training_overlap(train_dir: str | Path, splits: dict[str, tuple[str, list[Task]]]) -> dict[str, int]:
    """Per split name: records of the training build in `train_dir` that are tasks of the split
    (`splits`: name -> (env, tasks)). A split the build's report lists as held out, at the same
    fingerprint, is clean by construction (0); any other is checked against the build's `sft`
    records, by task text and AgentGym item, as the build's decontamination would."""
    train_dir = Path(train_dir)
    held = _held_at_build(train_dir)
    files = sorted((train_dir / "data" / "sft").glob("*.parquet"))
    if not files and not held:
        raise FileNotFoundError(f"{train_dir}: no data/sft/*.parquet and no report.json; give a `trajforge build` folder")
    overlap = {}
    for name, (_env, tasks) in splits.items():
        split = next((s for s in EVAL_SPLITS.values() if s.name == name), None)
        clean = split is not None and held.get(name) == split.fingerprint()
        overlap[name] = 0 if clean else _records_of(split, tasks, files)
    return overlap
