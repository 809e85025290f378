"""`trajforge eval` through the real CLI (in process: argument parsing, the Prefect flow, the agent loop,
real SQLite, BabyAI and the OS sandbox) against policies behind the loopback OpenAI-compatible server;
the metrics; the build's default decontamination against the declared eval splits."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.openai_server import Reply, Server
from tests.support.paths import FIXTURES, RAW
from tests.support.tables import declared_rows
from trajforge.flows.cli import main
from trajforge.pipeline.evaluation.metrics import pass_at_k, wilson
from trajforge.pipeline.evaluation.splits import EVAL_SPLITS
from trajforge.pipeline.synth.envs.os_sandbox import sandbox_unavailable_reason

DB_DEV = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"
MODEL = "deepseek-ai/DeepSeek-R1"


def _eval(tmp_path: Path, name: str, *args: str) -> tuple[int, dict]:
    out = tmp_path / name
    code = main(["eval", "--out", str(out), "--results", str(tmp_path / "results"), *args])
    report = json.loads((out / "eval.json").read_text()) if (out / "eval.json").exists() else {}
    return code, report


def _db_line(n: int) -> dict:
    return json.loads(DB_DEV.read_text().splitlines()[n])


# --- a model that fails in every way, one way per task ------------------------------------------
def _failing_tasks(path: Path) -> dict[str, str]:
    """Seven DB tasks (six real dev questions and one whose table cannot be built), each with the way
    the scripted model handles it."""
    selects = [t for t in map(json.loads, DB_DEV.read_text().splitlines()) if t["type"][0] not in ("INSERT", "UPDATE")]
    ways = ["success", "format_error", "turn_cap", "timeout", "wrong_answer", "refused_action"]
    broken = {**selects[0], "description": "How many rows does the broken table have?"}
    broken["table"] = {**broken["table"], "table_info": {**broken["table"]["table_info"],
                                                         "rows": [["1", "2", "3", "4", "5", "6", "7", "8", "9"]]}}
    tasks = [*selects[1:7], broken]
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return {t["description"]: way for t, way in zip(tasks, [*ways, "env_error"])}


class FailingModel:
    def __init__(self, ways: dict[str, str]):
        self.ways = ways

    def way(self, messages: list[dict]) -> str | None:
        prompt = next((m["content"] for m in messages if m["role"] == "user"), "")
        return next((w for d, w in self.ways.items() if f"Question: {d}" in prompt), None)

    def __call__(self, messages: list[dict]) -> Reply:
        way = self.way(messages)
        if way is None:  # BabyAI: an action the env does not know, every turn
            return Reply("I will fly.", "Thought:\nFly.\n\nAction:\nfly to the moon")
        task = next(t for t in map(json.loads, DB_DEV.read_text().splitlines())
                    if self.ways.get(t["description"]) == way) if way not in ("env_error",) else None
        content = {
            "success": lambda: "Answer.\nAction: Answer\nFinal Answer: " + json.dumps(task["label"]),
            "format_error": lambda: "I am not sure what to do.",
            "turn_cap": lambda: "Look again.\nAction: Operation\n```sql\nSELECT 1;\n```",
            "timeout": lambda: "Answer.\nAction: Answer\nFinal Answer: []",
            "wrong_answer": lambda: 'Guess.\nAction: Answer\nFinal Answer: ["certainly not"]',
            "refused_action": lambda: "Try.\nAction: Operation\nSELECT 1;",
            "env_error": lambda: "Answer.\nAction: Answer\nFinal Answer: []",
        }[way]()
        return Reply("Thinking about it.", content)


def test_eval_counts_every_failure_reason_and_flags_the_broken_task_file(tmp_path):
    ways = _failing_tasks(tmp_path / "db_tasks.jsonl")
    model = FailingModel(ways)
    slow = lambda _n, body: "slow" if model.way(body["messages"]) == "timeout" else None  # noqa: E731
    with Server(model, fault=slow, slow_s=3) as server:
        code, report = _eval(tmp_path, "failing", "--model", MODEL, "--base-url", server.base_url, "--label", "failing",
                             "--tasks", f"db={tmp_path / 'db_tasks.jsonl'}", "--env", "babyai", "--max-turns", "3",
                             "--timeout", "1", "--max-retries", "0", "--n", "2")
    assert code == 0
    db = report["envs"]["db"]["model"]
    # Each task fails its own way in both samples; the broken table fails as env_error.
    assert db["outcomes"] == {"success": 2, "wrong_answer": 2, "format_error": 2, "refused_action": 2,
                              "turn_cap": 2, "env_error": 2, "timeout": 2}
    assert db["success_rate"] == round(2 / 14, 4) and db["pass_at_k"] == {"1": round(1 / 7, 4), "2": round(1 / 7, 4)}
    low, high = db["success_ci95"]
    assert low < 2 / 14 < high and (low, high) == tuple(round(x, 4) for x in wilson(2, 14))
    assert db["refused_actions"] == 2 * 3 and db["mean_tokens"] > 0
    # The oracle fails the task whose table cannot be built: the task file is broken, and the report says so.
    assert report["envs"]["db"]["policies"]["oracle"]["outcomes"] == {"success": 6, "env_error": 1}
    assert report["envs"]["db"]["broken"] is True
    # BabyAI: every action refused until the turn cap.
    babyai = report["envs"]["babyai"]["model"]
    assert babyai["outcomes"] == {"refused_action": 14} and babyai["refused_actions"] == 14 * 3
    assert report["envs"]["babyai"]["broken"] is False
    episodes = declared_rows(tmp_path / "failing" / "episodes.parquet", "eval_episodes")
    assert len([e for e in episodes if e["policy"] == "model"]) == 14 + 14
    html = (tmp_path / "failing" / "report.html").read_text()
    assert "broken" in html and all((tmp_path / "failing" / "report_files" / p).stat().st_size > 1000
                                    for p in ("success.png", "outcomes.png", "pass_at_k.png"))


# --- oracle, random and two checkpoints ---------------------------------------------------------
def babyai_solver(good: bool):
    """A "checkpoint" for BabyAI: the good one goes to the goal object once it sees it, the bad one turns."""
    def policy(messages: list[dict]) -> Reply:
        goal = re.search(r"Your goal: go to (?:the|a) (\w+ \w+)", messages[0]["content"])
        seen = messages[-1]["content"]
        obj = goal.group(1) if goal else ""
        action = (f"go to {obj} 1" if f"{obj} 1" in seen else "turn left") if good and goal else "turn left"
        if good and goal and obj.endswith("door"):
            door = re.search(rf"{obj.split()[0]} (?:closed |locked )?door 1", seen)
            action = f"go to {door.group(0)}" if door else "turn left"
        return Reply("Plan.", f"Thought:\nGo.\n\nAction:\n{action}")
    return policy


def test_calibration_on_the_declared_splits_and_two_checkpoints_in_one_table(tmp_path):
    with Server(babyai_solver(True)) as good, Server(babyai_solver(False)) as bad:
        code_a, a = _eval(tmp_path, "ckpt-a", "--model", MODEL, "--base-url", good.base_url, "--label", "ckpt-a",
                          "--env", "babyai", "--env", "db", "--max-turns", "4")
        code_b, b = _eval(tmp_path, "ckpt-b", "--model", MODEL, "--base-url", bad.base_url, "--label", "ckpt-b",
                          "--env", "babyai", "--max-turns", "4", "--no-calibration")
    assert code_a == code_b == 0
    for env in ("babyai", "db"):
        policies = a["envs"][env]["policies"]
        assert policies["oracle"]["success_rate"] == 1.0 and a["envs"][env]["broken"] is False
        assert policies["random"]["success_rate"] <= 0.2
        assert a["envs"][env]["split"] == EVAL_SPLITS[env].name
    assert a["envs"]["babyai"]["model"]["success_rate"] > b["envs"]["babyai"]["model"]["success_rate"] == 0.0
    rows = declared_rows(tmp_path / "results" / "results.parquet", "eval_results")
    babyai = {r["label"]: r for r in rows if r["env"] == "babyai"}
    assert set(babyai) == {"ckpt-a", "ckpt-b", "policy/oracle", "policy/random"}
    assert babyai["ckpt-a"]["success_rate"] == a["envs"]["babyai"]["model"]["success_rate"]
    assert babyai["ckpt-b"]["success_rate"] == 0.0 and babyai["ckpt-a"]["oracle_success"] == 1.0
    assert len({r["run"] for r in rows}) == 2
    import polars as pl

    csv = pl.read_csv(tmp_path / "results" / "results.csv")
    assert csv.height == len(rows) and sorted(csv.filter(pl.col("policy") == "model")["label"]) == ["ckpt-a", "ckpt-a", "ckpt-b"]


@pytest.mark.skipif(sandbox_unavailable_reason() is not None, reason=f"OS sandbox: {sandbox_unavailable_reason()}")
def test_eval_in_the_os_sandbox(tmp_path):
    answers = lambda messages: Reply("Guess.", "Think: I guess.\n\nAct: answer(42)")  # noqa: E731
    with Server(answers) as server:
        code, report = _eval(tmp_path, "os", "--model", MODEL, "--base-url", server.base_url, "--env", "os")
    assert code == 0
    entry = report["envs"]["os"]
    assert entry["policies"]["oracle"]["success_rate"] == 1.0 and entry["broken"] is False
    assert entry["policies"]["random"]["success_rate"] == 0.0
    # Two tasks need the network: not run, and not counted in the rates.
    assert entry["model"]["not_runnable"] == 2 and entry["model"]["episodes"] == 13
    assert entry["model"]["outcomes"] == {"wrong_answer": 13, "not_runnable": 2}


# --- held out by construction -------------------------------------------------------------------
def _planted_source(tmp_path: Path) -> tuple[Path, str]:
    """AgentInstruct's db rows with one row's question replaced by a DBBench dev question."""
    source = tmp_path / "planted"
    source.mkdir()
    rows = [json.loads(line) for line in (RAW / "agentinstruct" / "db.jsonl").read_text().splitlines() if line.strip()]
    question = _db_line(3)["description"]
    turn = next(i for i, t in enumerate(rows[0]["conversations"]) if t["from"] == "human" and "?" in t["value"] and i > 1)
    rows[0]["conversations"][turn]["value"] = re.sub(r"(?s)^.*?\n", f"{question}\n", rows[0]["conversations"][turn]["value"], count=1)
    (source / "db.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return source, rows[0]["id"]


def _build(source: Path, out: Path, **config):
    from trajforge.pipeline.build import BuildConfig, finalize, process_unit
    from trajforge.sources import get_source

    build_config = replace(BuildConfig(), **config)
    units = [process_unit("agentinstruct", f, out / ".staging", build_config)
             for f in get_source("agentinstruct").files(str(source))]
    return finalize(units, out, build_config)


def test_default_decontamination_holds_the_eval_splits_out_and_eval_refuses_a_model_trained_on_them(tmp_path):
    source, planted = _planted_source(tmp_path)
    report = _build(source, tmp_path / "clean")
    quarantine = pq.read_table(tmp_path / "clean" / "quarantine" / "quarantine.parquet").to_pylist()
    caught = [q for q in quarantine if q["reason"] == "contaminated"]
    assert [q["source_id"] for q in caught] == [str(planted)] and "evaluation task" in caught[0]["detail"]
    assert set(report["held_out"]["splits"]) == {s.name for s in EVAL_SPLITS.values()}
    assert "agentbench-db-dev" in (tmp_path / "clean" / "README.md").read_text()
    # Switched off, the planted task reaches the training data; eval finds it there and refuses.
    dirty = _build(source, tmp_path / "dirty", decontaminate_splits=False)
    assert dirty["total"]["written"] == report["total"]["written"] + 1 and dirty["held_out"]["splits"] == {}
    code, _ = _eval(tmp_path, "refused", "--env", "db", "--train-data", str(tmp_path / "dirty"))
    assert code == 2
    code, warned = _eval(tmp_path, "warned", "--env", "db", "--train-data", str(tmp_path / "dirty"), "--allow-overlap")
    assert code == 0 and warned["envs"]["db"]["training_overlap"] == 1 and "training data" in warned["warnings"][0]
    code, clean = _eval(tmp_path, "clean-eval", "--env", "db", "--train-data", str(tmp_path / "clean"))
    assert code == 0 and clean["envs"]["db"]["training_overlap"] == 0 and "warnings" not in clean


def test_an_agentgym_item_of_a_split_is_contaminated_whatever_its_text():
    from trajforge.pipeline.evaluation.splits import declared_held_out

    held = declared_held_out()
    assert held.item_match("babyai", "babyai_200000")
    assert held.item_match("babyai", "r2-babyai_200004~1")
    assert held.item_match("babyai", "babyai_1003") is None   # AgentTraj-L's training item
    assert held.item_match("textcraft", "babyai_200000") is None


# --- the statistics -------------------------------------------------------------------------------
def test_wilson_and_pass_at_k_against_known_values():
    assert wilson(0, 10) == (0.0, pytest.approx(0.2775, abs=1e-4))
    low, high = wilson(5, 10)
    assert (round(low, 4), round(high, 4)) == (0.2366, 0.7634)
    assert pass_at_k(10, 0, 1) == 0.0 and pass_at_k(10, 10, 5) == 1.0
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2) and pass_at_k(5, 1, 2) == pytest.approx(0.4)
    assert pass_at_k(4, 2, 3) == 1.0
