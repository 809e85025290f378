"""DBBench-style SQL environment on SQLite, one in-memory database per episode.

Upstream (AgentBench DBBench) runs MySQL and creates every column as TEXT, inserting `str(value)`
whatever the declared type; we do the same in SQLite, so comparisons and MAX/MIN behave as they
did for the upstream trajectories (strings unless the agent casts). SQLite accepts MySQL's
backtick-quoted names, which the reference statements use.

Actions (DBBench dialect, the action part of the turn or the whole turn):
  `Operation` + a ```sql block  -> the statement runs; the observation is `str(rows)`, the
                                    list-of-tuples repr upstream's cursor.fetchall() gives.
  `Answer` + `Final Answer: [...]` -> the episode ends and is scored: SELECT-type tasks compare
                                    the answer with `label`; INSERT/UPDATE/DELETE tasks compare
                                    the table hash with `answer_md5` (or with the hash the
                                    reference statement produces when the task has no md5).
"""
from __future__ import annotations

import sqlite3
from typing import Any

from trajforge.pipeline.envs.db import (
    _DECLARED,
    _FINAL,
    _SQL_BLOCK,
    db_answers_match,
    parse_answer,
    table_hash,
    task_prompt,
)
from trajforge.pipeline.envs.tasks import Task, coerce_task
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, StepResult


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def build_database(tables: list[dict]) -> sqlite3.Connection:
    # The episode uses its connection sequentially, possibly from a worker thread of the agent loop.
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    for t in tables:
        cols = ", ".join(f"{_quote(c['name'])} TEXT" for c in t["columns"])
        conn.execute(f"CREATE TABLE {_quote(t['name'])} ({cols})")
        marks = ", ".join("?" for _ in t["columns"])
        conn.executemany(f"INSERT INTO {_quote(t['name'])} VALUES ({marks})",
                         [[None if v is None else str(v) for v in row] for row in t["rows"]])
    return conn


def current_table_hash(conn: sqlite3.Connection, table: dict) -> str:
    cols = ", ".join(_quote(c["name"]) for c in table["columns"])
    return table_hash(conn.execute(f"SELECT {cols} FROM {_quote(table['name'])}").fetchall())


def run_sql(conn: sqlite3.Connection, sql: str) -> str:
    """Run one or more statements; the observation is the last statement's rows as upstream shows
    them, or the error text (the agent sees it and can correct the query)."""
    statements, buf = [], ""
    for line in sql.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            statements.append(buf)
            buf = ""
    if buf.strip():
        statements.append(buf)
    rows: list[Any] = []
    try:
        for statement in statements:
            rows = conn.execute(statement).fetchall()
    except (sqlite3.Error, sqlite3.Warning) as e:
        return f"Error: {e}"
    return str(rows)


class DbEnv(ClosingEnvironment):
    name = "db"

    def __init__(self) -> None:
        self._conn: sqlite3.Connection | None = None
        self._task: Task | None = None
        self._done = False

    def reset(self, task: Task | dict) -> str:
        self.close()
        self._task = coerce_task(task)
        if self._task.env != "db":
            raise ValueError(f"task {self._task.id} is for env {self._task.env!r}, not 'db'")
        self._conn = build_database(self._task.data["tables"])
        self._done = False
        return task_prompt(self._task)

    def step(self, action: str) -> StepResult:
        if self._conn is None or self._task is None or self._done:
            raise RuntimeError("step() before reset() or after the episode ended")
        declared = _DECLARED.search(action)
        final = _FINAL.search(action) if not declared or declared.group(1) == "Answer" else None
        if final:
            answer = parse_answer(final.group(1))
            self._done = True
            score = self.score(answer)
            return StepResult("", reward=score or 0.0, done=True,
                              info={"valid": True, "answer": answer, "score": score,
                                    "success": None if score is None else score == 1.0})
        block = _SQL_BLOCK.search(action)
        if not block:
            return StepResult("Invalid action: expected `Action: Operation` with a ```sql block, or "
                              "`Action: Answer` with `Final Answer: [...]`.", info={"valid": False})
        observation = run_sql(self._conn, block.group(1))
        return StepResult(observation, info={"valid": True, "sql": block.group(1).strip(),
                                             "error": observation.startswith("Error: ")})

    def score(self, answer: list[Any]) -> float | None:
        assert self._task is not None and self._conn is not None
        data = self._task.data
        if data["kind"] == "select":
            return float(db_answers_match(answer, data["label"]))
        expected = data.get("answer_md5")
        table = data["tables"][0]
        if expected is None:
            reference = data["label"][0] if data["label"] and isinstance(data["label"][0], str) else None
            if reference is None:
                return None
            ref_conn = build_database(data["tables"])
            try:
                if run_sql(ref_conn, reference).startswith("Error: "):
                    return None
                expected = current_table_hash(ref_conn, table)
            finally:
                ref_conn.close()
        return float(current_table_hash(self._conn, table) == expected)

    def snapshot(self) -> tuple[bytes, Task | None, bool]:
        """The episode's state (a copy of the database), for `restore`: tree search branches from it."""
        if self._conn is None:
            raise RuntimeError("snapshot() before reset()")
        return self._conn.serialize(), self._task, self._done

    def restore(self, state: tuple[bytes, Task | None, bool]) -> None:
        """Go back to a `snapshot`; the snapshot stays usable (restoring copies it)."""
        data, task, done = state
        self.close()
        self._conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self._conn.deserialize(data)
        self._task, self._done = task, done

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
