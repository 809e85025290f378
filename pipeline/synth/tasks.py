"""Task files for synthesis: AgentBench OS / DBBench records and plain JSONL, plus their scoring.

A `Task` is what an environment's `reset` takes (as `task.as_dict()`): `env` names the
environment (`os`, `db`, `agentgym`, and AgentGym's envs run in-process), `description` is the task text, and `data` holds the
env-specific fields, already normalised so that environments never look at upstream spellings:

- `os`: `init` (list of scripts run as separate processes before the episode), `start` (a script
  run in the agent's shell, or None), `evaluation` (`match`, or `check`: a list of scripts / None,
  plus `example`), `image`, `labels`. A script is `{"language": "bash"|"python", "code": str}`.
- `db`: `tables` (`[{"name", "columns": [{"name", "type"}], "rows"}]`), `label`, `kind`
  (`select` | `modify`), `type`, `answer_md5` (INSERT/UPDATE/DELETE), `add_description`.
- `agentgym`: whatever the server needs (`env_name`, `item_id`), passed through; the same for
  `babyai`, `textcraft`, `sciworld` (their env reads `item_id`; TextCraft also the commands and goal
  its description states).

Ids are stable: file name + a hash of the record's canonical JSON, because the upstream index of a
record in its file is not stable across selections (fixtures README).

The scoring rules are upstream's (AgentBench, as the fixtures README describes them); the
environments call them, and so can anyone who holds an answer but no environment.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from trajforge.pipeline.ingest.dialects import parse_answer_list
from trajforge.pipeline.registry import Registry, UnknownName
from trajforge.pipeline.synth.envs import LOCAL_AGENTGYM

# Script text that needs a package registry or the internet; the sandbox has no network, so a
# task whose setup or reference solution needs one cannot pass offline and is marked, not faked.
_NEEDS_NETWORK = re.compile(
    r"\b(?:apt(?:-get)?\s+(?:-\S+\s+)*(?:update|install|upgrade|dist-upgrade)|pip3?\s+install|npm\s+install|"
    r"git\s+clone)\b|\b(?:curl|wget)\b[^\n]*\b(?:https?|ftp)://(?!localhost|127\.)")


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
        parse = TASK_FORMATS[env]
    except UnknownName as exc:
        raise TaskFormatError(str(exc)) from None
    return parse(record, tid, source_file)


def _agentgym_task(record: dict, tid: str, source_file: str, env: str = "agentgym") -> Task:
    if not isinstance(record.get("description", ""), str):
        raise TaskFormatError("description must be a string")
    data = dict(record.get("data") or {})
    data.update({k: v for k, v in record.items() if k not in ("id", "env", "description", "data")})
    return Task(tid, env, record.get("description", ""), data, source_file)


def _infer_env(record: dict) -> str:
    if "table" in record and "label" in record:
        return "db"
    if isinstance(record.get("evaluation"), dict):
        return "os"
    raise TaskFormatError("no `env` field and not an AgentBench OS or DBBench record")


# --- OS ------------------------------------------------------------------------------------------
def _script(value: Any, where: str) -> dict[str, str]:
    """Normalise an upstream script (plain string, {code}, {language, code}) to {language, code}."""
    if isinstance(value, str):
        return {"language": "bash", "code": value}
    if isinstance(value, dict):
        if "file" in value:
            raise _NeedsScriptFile(f"{where} refers to an upstream script file {value['file']!r}")
        if isinstance(value.get("code"), str):
            language = value.get("language", "bash")
            if language not in ("bash", "python"):
                raise TaskFormatError(f"{where}: unknown script language {language!r}")
            return {"language": language, "code": value["code"]}
    raise TaskFormatError(f"{where}: a script is a string or {{language?, code}}, got {value!r}")


class _NeedsScriptFile(TaskFormatError):
    """The record points into upstream's scripts folder, which task files do not carry."""


def _os_task(record: dict, tid: str, source_file: str) -> Task:
    description = record.get("description")
    evaluation = record.get("evaluation")
    if not isinstance(description, str) or not isinstance(evaluation, dict):
        raise TaskFormatError("an OS task needs a string `description` and an `evaluation` object")
    skip = None
    try:
        create = record.get("create")
        # Upstream treats a non-dict `create` (two records hold a copy of `check` there) as
        # "default image, no init".
        create = create if isinstance(create, dict) else {}
        init = create.get("init")
        init_scripts = [] if init is None else [
            _script(s, "create.init") for s in (init if isinstance(init, list) else [init])]
        start = _script(record["start"], "start") if record.get("start") is not None else None
        if "match" in evaluation:
            match = evaluation["match"]
            if not (isinstance(match, str) or (isinstance(match, dict) and ("answer" in match or "regex" in match))):
                raise TaskFormatError(f"evaluation.match: unsupported {match!r}")
            ev: dict[str, Any] = {"match": match}
        elif "check" in evaluation:
            check = evaluation["check"]
            ev = {"check": [None if c is None else _script(c, "evaluation.check")
                            for c in (check if isinstance(check, list) else [check])]}
        else:
            raise TaskFormatError("evaluation needs `match` or `check`")
        ev["example"] = _script(evaluation["example"], "evaluation.example") if evaluation.get("example") else None
        if None in ev.get("check", []) and ev["example"] is None:
            raise TaskFormatError("evaluation.check has a null entry but there is no example to fill it")
    except _NeedsScriptFile as e:
        # Keep the task visible (counted, reported) but unrunnable, with the reason.
        return Task(tid, "os", description, {"raw": record}, source_file, skip_reason=str(e))
    data = {"init": init_scripts, "start": start, "evaluation": ev,
            "image": create.get("local") or "default", "labels": list(record.get("labels") or []),
            # Top-level `example` is ignored upstream; kept as an informational reference solution.
            "example": _script(record["example"], "example") if record.get("example") else None}
    scripts = [*init_scripts, start, ev["example"], *ev.get("check", [])]
    if any(s is not None and _NEEDS_NETWORK.search(s["code"]) for s in scripts):
        skip = "needs the network (package install/download in its setup, check or reference solution); the sandbox is offline"
    return Task(tid, "os", description, data, source_file, skip_reason=skip)


def os_match(answer: str | None, match: str | dict) -> bool:
    """Upstream `match`: exact after strip; {"answer", "strip"}; or {"regex"} with re.search."""
    if answer is None:
        return False
    if isinstance(match, str):
        return answer.strip() == match
    if "regex" in match:
        return re.search(match["regex"], answer) is not None
    return (answer.strip() if match.get("strip", True) else answer) == match["answer"]


# --- DB ------------------------------------------------------------------------------------------
_MODIFY_TYPES = {"INSERT", "UPDATE", "DELETE"}


def _db_task(record: dict, tid: str, source_file: str) -> Task:
    description = record.get("description")
    if not isinstance(description, str):
        raise TaskFormatError("a DB task needs a string `description`")
    raw_tables = record.get("table")
    raw_tables = raw_tables if isinstance(raw_tables, list) else [raw_tables]
    tables = []
    for t in raw_tables:
        try:
            info = t["table_info"]
            tables.append({"name": t["table_name"],
                           "columns": [{"name": c["name"], "type": c.get("type", "TEXT")} for c in info["columns"]],
                           "rows": [list(r) for r in info["rows"]]})
        except (KeyError, TypeError) as e:
            raise TaskFormatError(f"table: missing {e}") from None
    types = record.get("type") or ["other"]
    kind = "modify" if str(types[0]).upper() in _MODIFY_TYPES else "select"
    label = record.get("label")
    label = label if isinstance(label, list) else [label]
    md5 = None
    if record.get("answer_md5"):
        found = re.search(r"[0-9a-f]{32}", str(record["answer_md5"]))
        md5 = found.group(0) if found else None
    data = {"tables": tables, "label": label, "kind": kind, "type": types[0], "answer_md5": md5,
            "add_description": record.get("add_description", "")}
    return Task(tid, "db", description, data, source_file)


# The task formats by env: a record's `env` (or the env its shape shows) picks its parser.
# AgentGym's envs run in-process read AgentGym's task records, under their own env name.
TASK_FORMATS: Registry = Registry("env", {"os": _os_task, "db": _db_task, "agentgym": _agentgym_task, **{
    name: functools.partial(_agentgym_task, env=name) for name in LOCAL_AGENTGYM}})


_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_NULLISH = {"none", "null", "nan", "inf", ""}


def _unpack(values: Iterable[Any]) -> list[Any]:
    """Flatten an answer list: a MySQL-style "[('x',), ('y',)]" string and nested rows become
    their cell values."""
    out: list[Any] = []
    for v in values:
        if isinstance(v, str) and v.strip().startswith("[") and v.strip().endswith("]"):
            parsed = parse_answer_list(v)
            if parsed is not None:
                out.extend(_unpack(parsed))
                continue
        if isinstance(v, (list, tuple)):
            out.extend(_unpack(v))
        else:
            out.append(v)
    return out


def normalize_db_value(value: Any) -> str:
    s = str(value).strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"`":
        s = s[1:-1].strip()
    if s.endswith("%"):
        s = s[:-1].strip()
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if s.lower() in _NULLISH:
        s = "0"
    return s


def _float(s: str) -> float | None:
    try:
        f = float(s)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def db_answers_match(answer: Iterable[Any], label: Iterable[Any], tol: float = 1e-2) -> bool:
    """Upstream DBBench SELECT scoring: per-item normalisation; one value each: numeric within
    `tol` or exact; several: all numeric -> one-to-one match within `tol` ignoring order,
    otherwise set equality."""
    a = [normalize_db_value(v) for v in _unpack(answer)] or ["0"]
    b = [normalize_db_value(v) for v in _unpack(label)] or ["0"]
    if len(a) == 1 and len(b) == 1:
        fa, fb = _float(a[0]), _float(b[0])
        if fa is not None and fb is not None:
            return abs(fa - fb) <= tol
        return a[0] == b[0]
    fa_list, fb_list = [_float(x) for x in a], [_float(x) for x in b]
    if None not in fa_list and None not in fb_list:
        # In one dimension, pairing the sorted values is an optimal one-to-one matching.
        return len(a) == len(b) and all(abs(x - y) <= tol for x, y in zip(sorted(fa_list), sorted(fb_list)))
    return set(a) == set(b)


def table_hash(rows: Iterable[Iterable[Any]]) -> str:
    """Upstream's table hash (MySQL): md5 of the sorted, comma-joined 5-hex prefixes of each
    row's md5(CONCAT_WS(',', cols...)); CONCAT_WS skips NULLs."""
    row_hashes = sorted(
        hashlib.md5(",".join(str(v) for v in row if v is not None).encode()).hexdigest()[:5] for row in rows)
    return hashlib.md5(",".join(row_hashes).encode()).hexdigest()


# --- prompts ---------------------------------------------------------------------------------------
def task_prompt(task: Task) -> str:
    """The first user message as upstream words it (the environments' reset returns this)."""
    if task.env == "os":
        return f"Now, I will start a new problem in a new OS. My problem is:\n\n{task.description}"
    if task.env == "db":
        return (f"Additional table information about the question: {task.data.get('add_description', '')}\n"
                f"Question: {task.description}\n")
    return task.description
