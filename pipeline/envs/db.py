"""AgentBench DBBench: a question about a table, or a change to it (runtime: SQLite, pipeline/synth/envs/db.py).

Task records (DBBench lines, recognised by `table` and `label`) become `data`: `tables`
(`[{"name", "columns": [{"name", "type"}], "rows"}]`), `label`, `kind` (`select` | `modify`), `type`,
`answer_md5` (INSERT/UPDATE/DELETE), `add_description`. The scoring rules are upstream's (AgentBench,
as the fixtures README describes them); the env calls them, and so can anyone who holds an answer
but no environment.

Actions: `Operation` + a ```sql block, `Answer` + `Final Answer: [...]`; as tools `execute_sql`, `submit`.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from typing import Any

from trajforge.pipeline.envs import Argument, EnvSpec, Tool
from trajforge.pipeline.envs.grammar import INVENTED_VERBS, Breach, Context, Grammar, Replies, starts
from trajforge.pipeline.envs.tasks import Task, TaskFormatError
from trajforge.pipeline.ingest.dialects import parse_answer_list, parse_literal

NAME = "db"


# --- tasks and scoring ---------------------------------------------------------------------------
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
    return Task(tid, NAME, description, data, source_file)


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


def reference_answer(task: Task) -> str | None:
    """A SELECT task's label (JSON list); a task scored by a table hash has none."""
    return json.dumps(task.data["label"], ensure_ascii=False) if task.data["kind"] == "select" else None


def task_prompt(task: Task) -> str:
    """The first user message as upstream words it."""
    return (f"Additional table information about the question: {task.data.get('add_description', '')}\n"
            f"Question: {task.description}\n")


# --- actions -------------------------------------------------------------------------------------
_SQL_BLOCK = re.compile(r"```sql\s*\n(.*?)```", re.S | re.I)
_FINAL = re.compile(r"Final Answer:\s*(.*)", re.S)
# The declared action (`Action: Operation` / `Action: Answer`, or the bare word the parsed action
# starts with) decides when a turn holds both a SQL block and the words "Final Answer".
_DECLARED = re.compile(r"(?:^|\n)\s*(?:Action:\s*)?(Operation|Answer)\b")


def parse_answer(text: str) -> list[Any]:
    """`Final Answer: [...]` as a list; a bare value becomes a one-element list."""
    raw = text.strip()
    listed = parse_answer_list(raw)
    if listed is not None:
        return listed
    value = parse_literal(raw, (str, int, float, bool))
    return [raw if value is None else value]


# The agent's instructions, in DBBench's action syntax.
INSTRUCTIONS = (
    "I will ask you a question about a table; answer it, or change the table as asked, by operating a "
    "SQLite database with SQL. In every turn, explain briefly what you will do, then take exactly one "
    "action.\n\nTo run one SQL statement:\n\nAction: Operation\n```sql\nSELECT * FROM `table` WHERE "
    "`column` = 'value';\n```\n\nI will reply with the raw result. Quote table and column names with "
    "backticks. When you are done (also after a change to the table), commit your answer:\n\n"
    "Action: Answer\nFinal Answer: [\"ANSWER1\", \"ANSWER2\", ...]\n\n"
    "The answer is a list of the values only. Every statement must be one line of SQL inside the block.")

# The same actions as tool calls.
TOOL_INSTRUCTIONS = ("I will ask you a question about a table; answer it, or change the table as asked, by operating a "
                     "SQLite database. Think briefly, then call exactly one tool per turn: `execute_sql` runs one SQL "
                     "statement (quote names with backticks) and returns the raw rows; `submit` commits your answer, a "
                     "list of the values only such as [\"ANSWER1\", \"ANSWER2\"] (also after a change to the table).")

TOOLS = (
    Tool("execute_sql", "Run one SQL statement on the task's database and return the raw result rows.",
         (Argument("query", "One SQL statement; quote table and column names with backticks."),),
         "The result rows as a list of tuples, or the error message.",
         lambda query: f"Action: Operation\n```sql\n{query}\n```"),
    Tool("submit", "Commit the final answer and end the episode.",
         (Argument("answer", 'The list of answer values only, e.g. ["ANSWER1", "ANSWER2"]; after a change to the '
                             'table, [].'),),
         "A note that the episode is over.", lambda answer: f"Action: Answer\nFinal Answer: {answer}"),
)


def tool_call(action: str) -> dict | None:
    declared = _DECLARED.search(action)
    final = _FINAL.search(action) if not declared or declared.group(1) == "Answer" else None
    if final:
        return {"name": "submit", "arguments": {"answer": final.group(1).strip()}}
    block = _SQL_BLOCK.search(action)
    return {"name": "execute_sql", "arguments": {"query": block.group(1).strip()}} if block else None


# --- evaluation ----------------------------------------------------------------------------------
def reference_steps(task: Task) -> list | None:
    """The oracle: run the reference statement of an INSERT/UPDATE/DELETE task and commit; commit the
    `label` of a question."""
    label = task.data.get("label") or []
    if task.data.get("kind") == "modify":
        if not label or not isinstance(label[0], str):
            return None
        return [f"I apply the reference statement.\nAction: Operation\n```sql\n{label[0]}\n```",
                "The table is changed.\nAction: Answer\nFinal Answer: []"]
    answer = json.dumps([str(v) for v in label], ensure_ascii=False)
    return [f"The reference answer.\nAction: Answer\nFinal Answer: {answer}"]


# --- grammar -------------------------------------------------------------------------------------
_DB_OPERATION = re.compile(r"Operation\s*\n\s*```sql\s*\n.*\S.*```\s*", re.S | re.I)
# DBBench shows MySQL's errors (`1054 (42S22): Unknown column ...`), our DB env SQLite's (`Error: ...`)
# and `Invalid action: ...` for a turn it cannot parse.
DB_REPLIES = Replies({"db.sql_error": starts(r"\d{4} \([0-9A-Z]{5}\): ", r"Error: "),
                      "db.invalid_action": starts(r"Invalid action: ")})
_DB_ANSWER = re.compile(r"Answer\s*\nFinal Answer:\s*(?P<answer>.*\S)\s*", re.S)


def _db_check(action: str, context: Context) -> Breach | None:
    text = action.strip()
    if text.startswith("Operation"):
        return None if _DB_OPERATION.fullmatch(text) else Breach(
            "db.sql_block", f"{text[:120]!r}: `Operation` needs one ```sql code block")
    if text.startswith("Answer"):
        m = _DB_ANSWER.fullmatch(text)
        ok = m is not None and parse_answer_list(m["answer"]) is not None
        return None if ok else Breach("db.final_answer",
                                      f"{text[:120]!r}: `Answer` needs `Final Answer: [...]`, a list")
    return Breach("db.command", f"{text[:120]!r} is neither `Operation` + SQL nor `Answer` + `Final Answer`")


def _db_breaks(action: str, context: Context) -> dict[str, str]:
    text = action.strip()
    head, _, rest = text.partition("\n")
    out = {"db.command": f"{INVENTED_VERBS[0].title()}\n{rest}"}
    if head.strip() == "Operation":
        out["db.sql_block"] = "Operation\n" + re.sub(r"```(?:sql)?", "", rest).strip()
    if head.strip() == "Answer":
        out["db.final_answer"] = "Answer\n" + rest.replace("[", "", 1)[::-1].replace("]", "", 1)[::-1]
    return out


def _db_terminal(action: str) -> bool:
    return action.strip().startswith("Answer")


GRAMMAR = Grammar(NAME, "AgentBench DBBench prompt: `Operation` + a ```sql block, or `Answer` + `Final Answer: [...]`",
                  {"db.command": "Operation or Answer",
                   "db.sql_block": "`Operation` is followed by a ```sql code block",
                   "db.final_answer": "`Answer` is followed by `Final Answer:` and a list"},
                  _db_check, _db_breaks, _db_terminal, "with `Action: Answer` + `Final Answer: [...]`",
                  replies=DB_REPLIES)

SPECS = [EnvSpec(
    NAME, grammar=GRAMMAR, recorded_here=True, runtime="trajforge.pipeline.synth.envs.db:DbEnv", task_format=_db_task,
    recognizes=lambda record: "table" in record and "label" in record, first_prompt=task_prompt,
    instructions=INSTRUCTIONS, tool_instructions=TOOL_INSTRUCTIONS, tools=TOOLS, tool_call=tool_call,
    reference_answer=reference_answer, replayable=True,
    eval_split={"name": "agentbench-db-dev", "files": ("agentbench/db/dev.jsonl",),
                "held_out_by": "text",
                "about": "AgentBench DBBench dev, 39 tasks in SQLite"},
    reference_steps=reference_steps,
    random_moves=("I give up.\nAction: Answer\nFinal Answer: []",
                  "I look at the tables.\nAction: Operation\n```sql\nSELECT name FROM sqlite_master;\n```"))]
