"""Salvage of failed runs (EEF): real failures from synthesis, replayed in real SQLite and the real sandbox."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.openai_server import FixturePolicy, Server, fixture_policy
from tests.support.paths import FIXTURES
from tests.support.tables import declared_rows
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.llm.client import LLMConfig
from trajforge.pipeline.synth.job import SynthConfig, synthesize
from trajforge.pipeline.synth.salvage import SalvageConfig, read_failures, salvage

AGENTBENCH = FIXTURES / "tasks" / "agentbench"
DB_FILE = AGENTBENCH / "db" / "dev.jsonl"
OS_FILES = sorted((AGENTBENCH / "os").glob("*.json"))
MODEL = "deepseek-ai/DeepSeek-R1"
DETOUR = {"db": "Operation\n```sql\nSELECT 'detour';\n```", "os": "bash\n```bash\necho detour\n```"}


def detour_policy(policy: FixturePolicy) -> FixturePolicy:
    """The reference solution with a wrong step before the last: the final answer is then read from
    the detour's output, so match tasks fail for real. The first action is the beneficial one."""
    for script in policy.scripts.values():
        env = "db" if script.steps[0][1]("").startswith("Operation") else "os"
        script.steps.insert(-1, ("Let me double-check with one more command.", lambda _obs, a=DETOUR[env]: a))
    return policy


def _llm(server: Server) -> LLMConfig:
    return LLMConfig(model=MODEL, base_url=server.base_url, api_key="EMPTY", backoff_base_s=0.01)


def _sandbox_reason() -> str | None:
    try:
        from trajforge.pipeline.synth.envs.os_sandbox import sandbox_unavailable_reason
    except ImportError as exc:
        return f"os env not importable: {exc}"
    return sandbox_unavailable_reason()


@pytest.fixture(scope="module")
def db_failures(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("failed_db")
    with Server(detour_policy(fixture_policy(db_files=[DB_FILE]))) as server:
        synthesize(SynthConfig(tasks=str(DB_FILE), env="db", out=str(out), n=1, llm=_llm(server)))
    return out / "failures.parquet"


@pytest.fixture(scope="module")
def db_solvable(tmp_path_factory) -> set[str]:
    """Task ids the reference solution solves without the detour (some upstream references are broken)."""
    out = tmp_path_factory.mktemp("plain_db")
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        synthesize(SynthConfig(tasks=str(DB_FILE), env="db", out=str(out), n=1, llm=_llm(server)))
    return {json.loads(r["meta"])["task_id"] for r in pq.read_table(out / "data" / "synthetic" / "db.parquet").to_pylist()}


def _salvage(server: Server, failures: Path, tasks: Path, out: Path, **kw) -> dict:
    return salvage(SalvageConfig(failures=[str(failures)], tasks=str(tasks), out=str(out), llm=_llm(server), **kw))


def _check_outcomes(out: Path, failures: Path) -> tuple[list[dict], dict[str, dict]]:
    rows = declared_rows(out / "salvage.parquet", "salvage_outcomes")
    failed_ids = [f.id for f in read_failures(failures)]
    # Every failure ends exactly once, with an outcome and, unless salvaged, a reason.
    assert sorted(r["id"] for r in rows) == sorted(failed_ids) and len(set(failed_ids)) == len(failed_ids)
    assert all(r["outcome"] == "salvaged" or r["detail"] for r in rows)
    records = [rec for p in sorted((out / "data" / "synthetic").glob("*.parquet")) for rec in pq.read_table(p).to_pylist()]
    return records, {r["id"]: r for r in rows}


def test_salvage_keeps_the_beneficial_prefix_and_drops_the_failing_remainder(db_failures, db_solvable, tmp_path):
    failures = {f.id: f for f in read_failures(db_failures)}
    detoured = [f for f in failures.values() if any("detour" in (t.get("action") or "") for t in f.actions)]
    assert len(detoured) >= 10 and all(len(f.actions) == 3 for f in detoured)
    out = tmp_path / "salvaged"
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        report = _salvage(server, db_failures, DB_FILE, out, max_calls=None, max_prefixes=2)
        calls = server.calls
        records, rows = _check_outcomes(out, db_failures)
        # Salvaged: exactly the failures whose task the reference's first action solves.
        expected = {f.id for f in detoured if f.task_id in db_solvable}
        assert {json.loads(r["meta"])["salvaged_from"] for r in records} == expected
        assert report["outcomes"]["salvaged"] == len(records) == len(expected) > 0
        for record in records:
            assert validate_record(record) is None and record["source"] == "synthetic" and record["success"]
            meta = json.loads(record["meta"])
            failure = failures[meta["salvaged_from"]]
            row = rows[failure.id]
            # The longest prefix (reference + detour) was tried first and failed; one action is beneficial.
            assert (meta["prefix_steps"], meta["beneficial_steps"], row["prefixes_tried"]) == (1, [0], 2)
            assistant = [t for t in record["conversations"] if t["role"] == "assistant"]
            assert assistant[0]["content"] == failure.actions[0]["content"]
            assert not any("detour" in t["action"] for t in assistant)   # the failing remainder is not there
            assert all(t["loss"] for t in assistant) and row["record_id"] == record["id"]
        # Tasks whose reference itself is wrong upstream cannot be salvaged: both prefixes tried, a
        # reason kept; a reference that fails with an SQL error is dropped, leaving one prefix to try.
        unsalvaged = [r for r in rows.values() if r["outcome"] != "salvaged"]
        assert {r["outcome"] for r in unsalvaged} <= {"no_prefix_succeeded", "no_prefix"}
        tried = [(r["prefixes_tried"], failures[r["id"]].observations[0].startswith("Error: "))
                 for r in unsalvaged if r["outcome"] == "no_prefix_succeeded"]
        assert {t for t, _ in tried} == {1, 2} and all(t == (1 if errored else 2) for t, errored in tried)
        assert report["replay_mismatches"] == 0 and report["dropped_steps"] == {}
        assert report["llm"]["calls"] == calls == report["budget"]["spent"]

        again = _salvage(server, db_failures, DB_FILE, out, max_calls=None, max_prefixes=2)
        assert server.calls == calls and again["llm"]["calls"] == 0 and again["episodes_run"] == 0
        assert again["outcomes"] == report["outcomes"]
        assert _check_outcomes(out, db_failures)[0] == records


NOISE = [("Let me try this.", lambda _obs: "Operation\nSELECT 1;"),                    # no SQL block: refused
         ("Let me look at another table.", lambda _obs: "Operation\n```sql\nSELECT * FROM no_such_table;\n```")]


def noisy_policy(policy: FixturePolicy) -> FixturePolicy:
    """The detour policy with, after the reference query, a step the env refuses, one it answers
    with an error, and the reference query again (the same answer: it changes nothing)."""
    for script in detour_policy(policy).scripts.values():
        script.steps[1:1] = [*NOISE, script.steps[0]]
    return policy


def test_salvage_drops_refused_failed_and_repeated_steps(db_solvable, tmp_path):
    with Server(noisy_policy(fixture_policy(db_files=[DB_FILE]))) as server:
        synthesize(SynthConfig(tasks=str(DB_FILE), env="db", out=str(tmp_path / "failed"), n=1, llm=_llm(server)))
    failures_path = tmp_path / "failed" / "failures.parquet"
    # The tasks answered by a query (a task that changes the table is judged by the table, which
    # the detour does not touch, so there the longest prefix succeeds).
    failures = {f.id: f for f in read_failures(failures_path)
                if f.task_id in db_solvable and "```sql\nSELECT" in f.actions[0]["action"]}
    assert len(failures) >= 2 and all(len(f.actions) == 6 for f in failures.values())
    out = tmp_path / "salvaged"
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        report = _salvage(server, failures_path, DB_FILE, out, max_calls=None, max_prefixes=2)
    records, rows = _check_outcomes(out, failures_path)
    salvaged = {json.loads(r["meta"])["salvaged_from"]: r for r in records}
    assert set(failures) <= set(salvaged)
    for failure_id, failure in failures.items():
        record, row = salvaged[failure_id], rows[failure_id]
        meta = json.loads(record["meta"])
        # Prefixes: the first five actions less the dropped ones (reference + detour: fails), then
        # the first four (the reference alone: succeeds); the first three would keep the same steps.
        assert (row["prefixes_tried"], meta["prefix_steps"], meta["prefix_from"], meta["beneficial_steps"]) == \
            (2, 4, [0], [0])
        assert meta["dropped_steps"] == {"1": "refused", "2": "error", "3": "no_change"} and row["dropped_steps"] == 3
        actions = [t["action"] for t in record["conversations"] if t["role"] == "assistant"]
        assert actions[0] == failure.actions[0]["action"] and len(actions) == 2
        assert not any("SELECT 1;" in a or "no_such_table" in a for a in actions)
        assert validate_record(record) is None
    assert report["dropped_steps"]["refused"] == len(salvaged) and report["dropped_steps"]["error"] >= len(salvaged)
    assert report["beneficial_steps"] == sum(len(json.loads(r["meta"])["prefix_from"]) for r in records)


def test_salvage_requires_the_replay_to_agree_with_the_record(db_failures, db_solvable, tmp_path):
    """A recorded observation the replay does not give back: the prefix stops before it, and the
    disagreement is kept in the row; at the first step, nothing is salvaged."""
    import pyarrow as pa

    table = pq.read_table(db_failures)
    rows = table.to_pylist()
    first, second = sorted(f.id for f in read_failures(db_failures) if f.task_id in db_solvable and len(f.actions) == 3)[:2]
    for row in rows:
        turns = json.loads(row["conversations"])
        observed = [i + 1 for i, t in enumerate(turns) if t["role"] == "assistant" and t.get("action")]
        if row["id"] in (first, second):
            turns[observed[0 if row["id"] == first else 1]]["content"] = "[('a table that has changed since',)]"
        row["conversations"] = json.dumps(turns)
    path = tmp_path / "failures.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        report = _salvage(server, path, DB_FILE, tmp_path / "out", max_calls=None, max_prefixes=2)
    records, outcomes = _check_outcomes(tmp_path / "out", path)
    assert outcomes[first]["outcome"] == "replay_mismatch" and outcomes[first]["prefixes_tried"] == 0
    assert outcomes[first]["detail"].startswith("step 0: recorded \"[('a table that has changed since',)]\"")
    assert outcomes[second]["outcome"] == "salvaged" and outcomes[second]["prefixes_tried"] == 1
    assert outcomes[second]["replay_mismatch"].startswith("step 1: ")
    assert first not in {json.loads(r["meta"])["salvaged_from"] for r in records}
    assert report["replay_mismatches"] == 2 and report["outcomes"]["replay_mismatch"] == 1


def test_budgets_hold(db_failures, tmp_path):
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        one_prefix = _salvage(server, db_failures, DB_FILE, tmp_path / "one", max_calls=None, max_prefixes=1)
        _, rows = _check_outcomes(tmp_path / "one", db_failures)
        # Only the longest prefix (which keeps the detour) is tried: nothing is salvaged.
        assert all(r["prefixes_tried"] <= 1 for r in rows.values()) and "salvaged" not in one_prefix["outcomes"]

        before = server.calls
        small = _salvage(server, db_failures, DB_FILE, tmp_path / "small", max_calls=7, max_prefixes=2)
        assert server.calls - before == small["llm"]["calls"] == small["budget"]["spent"] <= 7
        assert small["outcomes"]["budget_exhausted"] > 0 and small["budget"]["refused"] > 0
        _check_outcomes(tmp_path / "small", db_failures)

        # A larger budget later pays only for what the small run did not get: its calls are cached.
        before = server.calls
        full = _salvage(server, db_failures, DB_FILE, tmp_path / "small", max_calls=None, max_prefixes=2)
        assert "budget_exhausted" not in full["outcomes"] and full["episodes_resumed"] > 0
        assert server.calls - before == full["llm"]["calls"]
        # Here every continuation is one call (the answer after the replayed prefix), so the two runs
        # together paid exactly one call per prefix tried.
        assert small["llm"]["calls"] + full["llm"]["calls"] == full["prefixes_tried"]


def test_failures_that_cannot_be_replayed_end_with_a_reason(fixtures_build, tmp_path):
    records = [r for p in sorted((fixtures_build / "data" / "sft").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    picked = [next(r for r in records if r["env"] == "alfworld"), next(r for r in records if r["env"] == "os")]
    import pyarrow as pa

    from trajforge.schemas import arrow_schema

    path = tmp_path / "unsuccessful.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "success": False} for r in picked] + records[:3],
                                        schema=arrow_schema("trajectory")), path)
    assert len(read_failures(path)) == 2  # rows with success unknown or true are not failures
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        report = salvage(SalvageConfig(failures=[str(path)], tasks=str(DB_FILE), out=str(tmp_path / "out"),
                                       llm=_llm(server)))
        assert server.calls == 0
    assert report["outcomes"] == {"env_not_replayable": 1, "no_task": 1}
    _check_outcomes(tmp_path / "out", path)


def test_os_salvage_in_the_real_sandbox(tmp_path):
    reason = _sandbox_reason()
    if reason:
        pytest.skip(f"no sandbox here: {reason}")
    tasks = tmp_path / "os_tasks.json"
    tasks.write_text(json.dumps([t for p in OS_FILES for t in (lambda d: d if isinstance(d, list) else [d])(
        json.loads(p.read_text()))]))
    failed = tmp_path / "failed"
    with Server(detour_policy(fixture_policy(os_files=OS_FILES))) as server:
        synthesize(SynthConfig(tasks=str(tasks), env="os", out=str(failed), n=1, llm=_llm(server)))
    failures = failed / "failures.parquet"
    wrong = [f for f in read_failures(failures) if f.reason == "wrong_answer"]
    assert wrong, Counter(f.reason for f in read_failures(failures))
    out = tmp_path / "salvaged"
    with Server(fixture_policy(os_files=OS_FILES)) as server:
        report = _salvage(server, failures, tasks, out, max_prefixes=2)
    records, rows = _check_outcomes(out, failures)
    assert report["outcomes"].get("salvaged", 0) == len(records) > 0
    for record in records:
        meta = json.loads(record["meta"])
        assert meta["beneficial_steps"] == [0] and validate_record(record) is None
        assert not any("detour" in (t["action"] or "") for t in record["conversations"])
    # A task whose setup races a background job can show another output on replay: that failure
    # is not salvaged on the recorded thoughts, and the row says which step disagreed.
    assert {r["outcome"] for r in rows.values()} <= {"salvaged", "no_prefix_succeeded", "no_prefix",
                                                     "not_a_task_failure", "replay_mismatch"}
    assert all(r["detail"].startswith("step ") for r in rows.values() if r["outcome"] == "replay_mismatch")


def test_salvage_cli_runs_the_flow(db_failures, tmp_path, capsys):
    from trajforge.flows.cli import main

    out = tmp_path / "cli"
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        assert main(["salvage", str(db_failures), "--tasks", str(DB_FILE), "--out", str(out), "--model", MODEL,
                     "--base-url", server.base_url, "--max-prefixes", "2", "--max-calls", "5"]) == 0
        assert server.calls <= 5
    report = json.loads((out / "report.json").read_text())
    printed = capsys.readouterr().out
    assert report["budget"]["spent"] == report["llm"]["calls"] == server.calls
    assert f"{report['llm']['calls']} LLM calls (budget 5)" in printed and "budget_exhausted=" in printed


def test_unsuccessful_records_are_salvaged_through_their_task_text(db_failures, db_solvable, tmp_path):
    """Records that end without success (no synthesis task id) find their task by its description."""
    import pyarrow as pa

    from trajforge.pipeline.envs.tasks import load_tasks
    from trajforge.schemas import arrow_schema

    tasks = {t.id: t for t in load_tasks(DB_FILE)}
    failures = [f for f in read_failures(db_failures) if f.task_id in db_solvable and len(f.actions) == 3]
    assert failures
    records = [{"id": f"agentinstruct/db_failed_{i}", "schema_version": "1.1.0", "source": "agentinstruct",
                "source_id": f"db_failed_{i}", "source_file": "db", "license": "other", "domain": "db", "env": "db",
                "kind": "positive", "negative_type": None, "parent_id": None, "rendering": "native",
                "loss_flags": "inferred", "demo_turns": 0, "task": tasks[f.task_id].description, "answer": None,
                "reward": 0.0, "success": False, "conversations": f.turns, "meta": "{}"}
               for i, f in enumerate(failures)]
    path = tmp_path / "records.parquet"
    pq.write_table(pa.Table.from_pylist(records, schema=arrow_schema("trajectory")), path)
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        report = salvage(SalvageConfig(failures=[str(path)], tasks=str(DB_FILE), out=str(tmp_path / "out"),
                                       llm=_llm(server), max_prefixes=2))
    salvaged, rows = _check_outcomes(tmp_path / "out", path)
    assert report["outcomes"] == {"salvaged": len(records)}
    assert sorted(json.loads(r["meta"])["salvaged_from"] for r in salvaged) == sorted(r["id"] for r in records)
    assert all(r["id"].startswith("synthetic/agentinstruct_db_failed_") and validate_record(r) is None for r in salvaged)
