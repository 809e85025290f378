"""The `db` environment on the real DBBench fixture tasks, in real SQLite, with upstream scoring."""
from __future__ import annotations

import json

import pytest

from tests.support.paths import FIXTURES
from trajforge.pipeline.envs.tasks import Task, load_tasks, record_to_task
from trajforge.pipeline.synth.envs import make_env

DB_FILE = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"


def operation(sql: str) -> str:
    return f"The table is small; query it.\nAction: Operation\n```sql\n{sql}\n```"


def answer(values) -> str:
    return f"That settles it.\nAction: Answer\nFinal Answer: {values}"


def tasks() -> list[Task]:
    return load_tasks(DB_FILE)


# Hand-written queries for some SELECT-type tasks (the fixtures' own `sql` is unreliable, README).
QUERIES = {
    "What's the biggest Bronze that has less than 0 Silvers?":
        "SELECT MAX(CAST(Bronze AS INTEGER)) FROM `Medal Tally` WHERE CAST(Silver AS INTEGER) < 0;",
    "how many floors does the capitol square have?":
        "SELECT Floors FROM skyscrapers_in_Columbus WHERE Name = 'Capitol Square';",
    "Class of d, and a Frequency MHz smaller than 107.7, and a ERP W smaller than 232 has what call sign?":
        "SELECT `Call sign` FROM `Radio Stations` WHERE Class = 'D' AND CAST(`Frequency MHz` AS REAL) < 107.7\n"
        "  AND CAST(`ERP W` AS REAL) < 232;",
    "Which Attendance is the highest one that has a Record of 15-28?":
        "SELECT MAX(CAST(REPLACE(Attendance, ',', '') AS INTEGER)) FROM `Baseball Team Record` WHERE Record = '15-28';",
    "what is the total number of register listings from dover?":
        "SELECT COUNT(*) FROM historic_sites WHERE `City or town` = 'Dover';",
}


def test_fixture_tasks_load():
    ts = tasks()
    assert len(ts) == 39
    kinds = [t.data["kind"] for t in ts]
    assert kinds.count("modify") == 26 and kinds.count("select") == 13
    assert all(t.data["answer_md5"] for t in ts if t.data["kind"] == "modify")
    assert len({t.id for t in ts}) == 39


@pytest.mark.parametrize("task", [t for t in tasks() if t.data["kind"] == "modify"], ids=lambda t: t.id)
def test_modify_task_reference_statement_reproduces_answer_md5(task: Task):
    with make_env("db") as env:
        prompt = env.reset(task)
        assert prompt.startswith("Additional table information about the question: The name of this table is")
        assert prompt.endswith(f"Question: {task.description}\n")
        r = env.step(operation(task.data["label"][0]))
        assert r.observation == "[]" and r.info["valid"] and not r.info["error"]
        end = env.step(answer("[]"))  # the committed answer is irrelevant for these tasks
        assert end.done and end.info["score"] == 1.0 and end.info["success"] is True
    with make_env("db") as env:
        env.reset(task)
        end = env.step(answer("[]"))  # nothing changed: the table hash differs
        assert end.info["score"] == 0.0


def test_modify_task_without_md5_uses_the_reference_statement():
    line = next(json.loads(text) for text in DB_FILE.read_text().splitlines() if '"UPDATE"' in text)
    del line["answer_md5"]
    task = record_to_task(line, "dev.jsonl")
    assert task.data["answer_md5"] is None
    with make_env("db") as env:
        env.reset(task)
        env.step(operation(line["label"][0]))
        assert env.step(answer("[]")).info["score"] == 1.0
    with make_env("db") as env:
        env.reset(task)
        env.step(operation(f"DELETE FROM `{line['table']['table_name']}`;"))
        assert env.step(answer("[]")).info["score"] == 0.0


@pytest.mark.parametrize("task", [t for t in tasks() if t.data["kind"] == "select"], ids=lambda t: t.id)
def test_select_task_label_scores_1_and_a_wrong_answer_0(task: Task):
    with make_env("db") as env:
        env.reset(task)
        end = env.step(answer(json.dumps(task.data["label"], ensure_ascii=False)))
        assert end.done and end.reward == 1.0
    with make_env("db") as env:
        env.reset(task)
        assert env.step(answer('["certainly not this", "nor this"]')).reward == 0.0


@pytest.mark.parametrize("description", sorted(QUERIES))
def test_select_task_solved_through_sql(description):
    task = next(t for t in tasks() if t.description == description)
    with make_env("db") as env:
        env.reset(task)
        rows = env.step(operation(QUERIES[description]))
        assert rows.info["valid"] and not rows.info["error"] and rows.observation.startswith("[(")
        # The agent pastes the rows as upstream shows them; scoring unpacks the MySQL-style repr.
        end = env.step(answer(rows.observation))
        assert end.info["success"] is True, (rows.observation, task.data["label"])


def test_errors_invalid_actions_and_columns_stored_as_text():
    task = next(t for t in tasks() if t.description == "What's the biggest Bronze that has less than 0 Silvers?")
    with make_env("db") as env:
        env.reset(task)
        r = env.step(operation("SELECT nope FROM `Medal Tally`"))
        assert r.info["valid"] and r.info["error"] and r.observation.startswith("Error: ")
        assert env.step("I would like to see the table").info["valid"] is False
        # The declared action wins over words in the prose.
        r = env.step("I'll check before giving the Final Answer: [1]\nAction: Operation\n```sql\nSELECT 1\n```")
        assert not r.done and r.observation == "[(1,)]"
        # Upstream creates every column as TEXT: MAX compares strings unless the agent casts.
        assert env.step(operation("SELECT MAX(Bronze) FROM `Medal Tally`")).observation == "[('9',)]"
        assert env.step(operation("SELECT MAX(CAST(Bronze AS INTEGER)) FROM `Medal Tally`")).observation == "[(32,)]"
        r = env.step(operation("UPDATE `Medal Tally` SET Gold = '0' WHERE Nation = 'Japan';\n"
                               "SELECT COUNT(*) FROM `Medal Tally` WHERE Gold = '0'"))
        rows = task.data["tables"][0]["rows"]
        expected = sum(1 for row in rows if row[2] == "0" or row[1] == "Japan")
        assert r.observation == f"[({expected},)]"  # several statements: the last one's rows
        assert env.step(answer("[]")).done
        with pytest.raises(RuntimeError):
            env.step(operation("SELECT 1"))
