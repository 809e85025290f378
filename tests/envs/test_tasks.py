"""Task files (AgentBench OS/DB and plain JSONL) and the upstream scoring rules."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.support.paths import FIXTURES
from trajforge.pipeline.envs.db import db_answers_match, normalize_db_value, table_hash
from trajforge.pipeline.envs.os import os_match
from trajforge.pipeline.envs.tasks import Task, TaskFormatError, coerce_task, load_tasks, task_prompt

AB = FIXTURES / "tasks" / "agentbench"


def test_array_single_object_and_jsonl_files_load():
    assert len(load_tasks(AB / "os" / "dev.json")) == 3  # array
    single = load_tasks(AB / "os" / "4-N4.json")          # one object, not an array
    assert len(single) == 1 and single[0].env == "os"
    assert single[0].data["start"]["code"].endswith("su - jack") and single[0].data["init"] == []
    db = load_tasks(AB / "db" / "dev.jsonl")
    assert len(db) == 39 and {t.env for t in db} == {"db"}


def test_init_start_and_evaluation_are_normalised():
    interval, which_file, exec_test = load_tasks(AB / "os" / "dev.json")
    assert interval.data["init"] == [] and interval.data["start"]["language"] == "bash"
    assert "python3 -c" in interval.data["start"]["code"]
    assert which_file.data["init"][0]["code"].startswith("mkdir /root/r1")
    assert exec_test.data["evaluation"] == {"match": "Awesome-AgentBench", "example": None}
    assert exec_test.data["example"]["code"] == "chmod 777 test && ~/test"  # top-level: informational
    (q47,) = load_tasks(AB / "os" / "4-Q47.json")
    checks = q47.data["evaluation"]["check"]
    assert [c["language"] for c in checks] == ["python", "bash", "bash"]
    assert q47.data["start"] == {"language": "bash", "code": "mkdir /home/user2 && cd /home/user2"}
    suid = next(t for t in load_tasks(AB / "os" / "6-new.json") if "SUID" in t.description)
    assert suid.data["init"] == [{"language": "bash", "code": "chmod u+s /usr/bin/find"}]
    assert suid.data["evaluation"]["example"] == {"language": "bash", "code": "chmod u-s /usr/bin/find"}
    assert suid.data["image"] == "default" and suid.data["labels"] == ["permission"]


def test_ids_are_stable_and_content_addressed(tmp_path):
    first = [t.id for t in load_tasks(AB / "os" / "6-new.json")]
    copy = tmp_path / "6-new.json"
    shutil.copy(AB / "os" / "6-new.json", copy)
    assert [t.id for t in load_tasks(copy)] == first  # same file name + record -> same id
    assert len(set(first)) == len(first) and all(i.startswith("6-new.json#") for i in first)
    records = json.loads(copy.read_text())
    records[0]["description"] += " (edited)"
    copy.write_text(json.dumps(records))
    changed = [t.id for t in load_tasks(copy)]
    assert changed[0] != first[0] and changed[1:] == first[1:]


def test_plain_jsonl_tasks(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        {"id": "os-1", "env": "os", "description": "say hi", "evaluation": {"match": "hi"}},
        {"env": "agentgym", "description": "buy a lamp", "env_name": "webshop", "item_id": "webshop_12"},
        {"env": "agentgym", "description": "", "data": {"env_name": "babyai", "data_idx": 3}},
        json.loads((AB / "db" / "dev.jsonl").read_text().splitlines()[0]),
        {"description": "AgentBench OS record on one line", "evaluation": {"check": "true"}},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    ts = load_tasks(path)
    assert [t.env for t in ts] == ["os", "agentgym", "agentgym", "db", "os"]
    assert ts[0].id == "os-1"
    assert ts[1].data == {"env_name": "webshop", "item_id": "webshop_12"}
    assert ts[2].data == {"env_name": "babyai", "data_idx": 3}
    assert ts[4].data["evaluation"]["check"] == [{"language": "bash", "code": "true"}]
    # Round trip through the dict form environments receive.
    assert coerce_task(ts[3].as_dict()) == ts[3]
    assert coerce_task(lines[0]).id == "os-1"


def test_unrunnable_tasks_are_marked_with_a_reason():
    skipped = {t.description: t.skip_reason for t in load_tasks(AB / "os" / "6-new.json") if t.skip_reason}
    assert len(skipped) == 2 and all("network" in r for r in skipped.values())
    needs_file = coerce_task({"description": "count", "evaluation": {
        "check": [None, {"language": "python", "file": "check/integer-match.py"}], "example": "ls | wc -l"}})
    assert needs_file.skip_reason and "check/integer-match.py" in needs_file.skip_reason
    download = coerce_task({"description": "d", "evaluation": {"check": "wget -q https://example.com/x"}})
    local = coerce_task({"description": "d", "evaluation": {"check": "curl -s http://localhost:8000/"}})
    assert download.skip_reason and local.skip_reason is None


@pytest.mark.parametrize("content, message", [
    ('{"env": "chess", "description": "x"}', "unknown env"),
    ('{"description": "x"}\nnot json\n', ":2: not JSON"),
    ('[1, 2]', "JSON object"),
    ('{"description": "x", "evaluation": {}}', "match` or `check"),
    ('{"description": "x", "evaluation": {"check": [null]}}', "no example"),
    ('{"description": 5, "evaluation": {"match": "x"}}', "description"),
])
def test_bad_task_files_fail_with_a_clear_error(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(TaskFormatError, match=message):
        load_tasks(path)


def test_os_match_rules():
    assert os_match("  love\n", "love") and not os_match("Love", "love") and not os_match(None, "love")
    assert os_match("value: 42 units", {"regex": r"\b42\b"}) and not os_match("420", {"regex": r"\b42\b"})
    assert os_match(" x ", {"answer": "x", "strip": True}) and not os_match(" x ", {"answer": "x", "strip": False})


def test_db_answer_rules():
    assert normalize_db_value(" '1,234' ") == "1234" and normalize_db_value("45%") == "45"
    assert normalize_db_value("NULL") == "0" and normalize_db_value(None) == "0"
    assert normalize_db_value("1,2") == "1,2"  # not a thousands separator
    assert db_answers_match(["3.004"], ["3"]) and not db_answers_match(["3.02"], ["3"])  # tolerance 1e-2
    assert db_answers_match([], ["none"]) and db_answers_match(["[(None,)]"], ["none"])
    assert db_answers_match(["[('b',), ('a',)]"], ["a", "b"])          # MySQL-style string unpacked
    assert db_answers_match([("1.0",), ("2",)], ["2.001", "1"])       # numeric, one-to-one, any order
    assert not db_answers_match(["1", "1"], ["1", "2"])
    assert db_answers_match(["x", "y", "x"], ["y", "x"])              # set semantics for text
    assert not db_answers_match(["x"], ["x", "y"])
    assert db_answers_match(["Checco D'Angelo"], ["Checco D'Angelo"]) and not db_answers_match(["a"], ["b"])


def test_table_hash_follows_mysql_concat_ws():
    # CONCAT_WS skips NULLs, so a NULL cell hashes like a missing one; row order does not matter.
    assert table_hash([["a", None, "b"], ["c", "d", "e"]]) == table_hash([["c", "d", "e"], ["a", "b"]])
    assert table_hash([["a", "b"]]) != table_hash([["a", "c"]])


def test_task_prompts_are_upstream_wording():
    os_task = Task("t", "os", "do it")
    assert task_prompt(os_task) == "Now, I will start a new problem in a new OS. My problem is:\n\ndo it"
    db_task = Task("d", "db", "Q?", {"add_description": "The name of this table is T."})
    assert task_prompt(db_task) == "Additional table information about the question: The name of this table is T.\nQuestion: Q?\n"
