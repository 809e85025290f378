"""Task files: the records an env's `task_format` reads (its spec), as `Task`s.

A `Task` is what an environment's `reset` takes (as `task.as_dict()`): `env` names the
environment (a spec with a runtime), `description` is the task text, and `data` holds the
env-specific fields, already normalised by the env's task format so that environments never look
at upstream spellings (each env spec's module documents its fields).

A file is a JSON array or single object, or JSON Lines; a record names its env (`env`), or is in
the upstream shape one env `recognizes` (AgentBench OS, DBBench).

Ids are stable: file name + a hash of the record's canonical JSON, because the upstream index of a
record in its file is not stable across selections (fixtures README).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trajforge.pipeline.envs import spec, specs
from trajforge.pipeline.registry import Registry, UnknownName


class TaskFormatError(ValueError):
    """A task record that none of the supported formats describes."""


@dataclass(frozen=True)
class Task:
    id: str
    env: str
    description: str
    data: dict[str, Any] = field(default_factory=dict)
    source_file: str = ""
    # Set when the task cannot run here (e.g. it needs the network); runners skip it with this.
    skip_reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def coerce_task(task: Task | dict) -> Task:
    """Accept a Task, its `as_dict()`, or a bare upstream/plain record (env inferred)."""
    if isinstance(task, Task):
        return task
    if not isinstance(task, dict):
        raise TaskFormatError(f"a task is a dict or Task, not {type(task).__name__}")
    if {"id", "env", "description", "data"} <= task.keys():
        return Task(**{k: task[k] for k in ("id", "env", "description", "data", "source_file", "skip_reason")
                       if k in task})
    return record_to_task(task, source_file="")


# --- loading ------------------------------------------------------------------------------------
def load_tasks(path: str | Path) -> list[Task]:
    """Read one task file: a JSON array or single object (AgentBench OS), or JSON Lines
    (DBBench lines, AgentBench OS objects, or plain `{"env", "description", ...}` records)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    records: list[Any]
    try:
        whole = json.loads(stripped) if stripped[:1] in "[{" else None
    except json.JSONDecodeError:
        whole = None  # not one JSON document: JSON Lines
    if isinstance(whole, list):
        records = whole
    elif isinstance(whole, dict):
        records = [whole]
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TaskFormatError(f"{path}:{lineno}: not JSON: {e}") from None
    tasks = []
    for n, record in enumerate(records):
        try:
            tasks.append(record_to_task(record, source_file=path.name))
        except TaskFormatError as e:
            raise TaskFormatError(f"{path} record {n}: {e}") from None
    return tasks


def record_id(record: Any, source_file: str) -> str:
    digest = hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:12]
    return f"{source_file or 'task'}#{digest}"


def record_to_task(record: Any, source_file: str) -> Task:
    if not isinstance(record, dict):
        raise TaskFormatError(f"a task record is a JSON object, not {type(record).__name__}")
    env = record.get("env") or _infer_env(record)
    tid = str(record["id"]) if record.get("id") is not None else record_id(record, source_file)
    try:
        parse = task_formats()[env]
    except UnknownName as exc:
        raise TaskFormatError(str(exc)) from None
    return parse(record, tid, source_file)


def task_formats() -> Registry:
    """The task format of every env that reads task records, by env name."""
    return Registry("env", {name: s.task_format for name, s in specs().items() if s.task_format})


def _infer_env(record: dict) -> str:
    found = next((name for name, env in specs().items() if env.recognizes and env.recognizes(record)), None)
    if found is None:
        raise TaskFormatError("no `env` field and not in the upstream shape of any env "
                              f"({', '.join(n for n, s in specs().items() if s.recognizes)})")
    return found


def task_prompt(task: Task) -> str:
    """The first user message as upstream words it (the environments' reset returns this)."""
    return spec(task.env).task_prompt(task)
