"""The synthesis job and flow end to end: loopback server, real environments, resume, faults, key hygiene."""
from __future__ import annotations

import json
import logging
import random
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.openai_server import Server, down_url, fixture_policy
from tests.support.paths import FIXTURES, REPO
from tests.support.tables import declared_rows
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.llm.client import LLMConfig, ServerUnreachable
from trajforge.pipeline.synth.folder import USAGE_KEYS
from trajforge.pipeline.synth.job import SynthConfig, synthesize

AGENTBENCH = FIXTURES / "tasks" / "agentbench"
DB_FILE = AGENTBENCH / "db" / "dev.jsonl"
OS_FILES = sorted((AGENTBENCH / "os").glob("*.json"))
SECRET = "sk-live-SECRET-0123456789abcdef"
MODEL = "deepseek-ai/DeepSeek-R1"


def _config(server: Server | str, out: Path, tasks: Path = DB_FILE, env: str = "db", n: int = 2, model: str = MODEL,
            episode_concurrency: int = 16, **llm) -> SynthConfig:
    """A job against `server` (or a base URL)."""
    base_url = server if isinstance(server, str) else server.base_url
    return SynthConfig(tasks=str(tasks), env=env, out=str(out), n=n, episode_concurrency=episode_concurrency,
                       llm=LLMConfig(model=model, base_url=base_url, api_key=SECRET,
                                     **{"backoff_base_s": 0.01, **llm}))


def _outcomes(out: Path, env: str) -> tuple[list[dict], list[dict], list[dict]]:
    records = pq.read_table(out / "data" / "synthetic" / f"{env}.parquet").to_pylist()
    failures = [f for f in declared_rows(out / "failures.parquet", "synth_failures") if f["env"] == env]
    unselected_path = out / "unselected.parquet"
    unselected = declared_rows(unselected_path, "synth_failures") if unselected_path.exists() else []
    return records, failures, unselected


def _assert_every_episode_once(out: Path, env: str, tasks: int, n: int) -> tuple[list[dict], list[dict]]:
    records, failures, unselected = _outcomes(out, env)
    ids = [r["id"] for r in records] + [f["id"] for f in failures] + [u["id"] for u in unselected]
    assert len(ids) == len(set(ids)) == tasks * n, Counter(ids).most_common(3)
    assert all(f["reason"] for f in failures)
    return records, failures


def _assert_valid_with_reasoning(records: list[dict]) -> None:
    for record in records:
        assert validate_record(record) is None, record["id"]
        assert record["source"] == "synthetic" and record["success"] is True
        assistant = [t for t in record["conversations"] if t["role"] == "assistant"]
        assert assistant and all(t["reasoning"] for t in assistant)
        meta = json.loads(record["meta"])
        assert meta["generator"]["model"] == MODEL and meta["reward"] >= 1.0 and meta["sampling"]["temperature"] == 0.6


def test_db_synthesis_writes_valid_records_and_a_rerun_makes_zero_calls(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    out = tmp_path / "out"
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        report = synthesize(_config(server, out))
        calls = server.calls
        assert report["llm"]["calls"] == calls > 0
        assert report["llm"]["attempts"] == calls
        records, failures = _assert_every_episode_once(out, "db", 39, 2)
        _assert_valid_with_reasoning(records)
        assert len(records) == report["tasks_with_record"] >= 20  # best-of-2: one record per solved task
        # The reference SQL upstream is sometimes broken: those tasks fail, scored, with the reason kept.
        assert {f["reason"] for f in failures} == {"wrong_answer"}
        # Token totals add up over every episode: records, failures and unselected successes.
        _, _, unselected = _outcomes(out, "db")
        for key in USAGE_KEYS:
            total = (sum(json.loads(r["meta"])["usage"].get(key, 0) for r in records)
                     + sum(row["usage"][key] for row in failures + unselected))
            assert report["usage"][key] == total and (total > 0), key
        assert report["llm"]["usage"] == {k: report["usage"][k] for k in report["llm"]["usage"]}
        # This server answers the same request the same way: every task's two samples are identical.
        assert report["tasks_with_identical_samples"] == 39
        assert "the very same replies in all their samples" in caplog.text
        first = (out / "data" / "synthetic" / "db.parquet").read_bytes()

        again = synthesize(_config(server, out))
        assert server.calls == calls and again["llm"]["calls"] == 0 and again["episodes_resumed"] == 78
        assert pq.read_table(out / "data" / "synthetic" / "db.parquet").to_pylist() == records

        # A crash that lost the episode journal: episodes replay, every call comes from the cache.
        (out / ".synth" / "episodes.sqlite").unlink()
        for extra in (out / ".synth").glob("episodes.sqlite-*"):
            extra.unlink()
        replay = synthesize(_config(server, out))
        assert server.calls == calls and replay["llm"]["cache_hits"] == calls
        assert pq.read_table(out / "data" / "synthetic" / "db.parquet").to_pylist() == records
    assert f"Bearer {SECRET}" in server.authorizations
    assert SECRET not in caplog.text
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert first


FAULTS = ("429", "500", "reset", "malformed", "truncate", "empty", "slow")


def test_under_injected_faults_every_episode_ends_once_with_a_reason(tmp_path):
    rng = random.Random(4)
    plan: dict[int, str | None] = {}

    def fault(number: int, body: dict) -> str | None:
        return plan.setdefault(number, rng.choice(FAULTS) if rng.random() < 0.35 else None)

    out = tmp_path / "out"
    with Server(fixture_policy(db_files=[DB_FILE]), fault=fault, slow_s=1.5, retry_after="0.1") as server:
        report = synthesize(_config(server, out, max_retries=2, timeout_s=0.5))
    assert set(server.faults) == set(FAULTS)
    records, failures = _assert_every_episode_once(out, "db", 39, 2)
    _assert_valid_with_reasoning(records)
    reasons = Counter(f["reason"] for f in failures)
    assert set(reasons) <= {"wrong_answer", "truncated", "empty_response", "no_answer", "format_error",
                            "llm_error:rate_limited", "llm_error:server_error", "llm_error:connection",
                            "llm_error:malformed_response", "llm_error:timeout"}
    assert report["llm"]["retries"] > 0

    # Transient failures are not journaled: a later run without faults completes them.
    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        after = synthesize(_config(server, out))
    assert not any(r.startswith("llm_error") for r in after["failure_reasons"])
    _assert_every_episode_once(out, "db", 39, 2)


def _sandbox_reason() -> str | None:
    try:
        from trajforge.pipeline.synth.envs.os_sandbox import sandbox_unavailable_reason
    except ImportError as exc:
        return f"os env not importable: {exc}"
    return sandbox_unavailable_reason()


def test_os_synthesis_in_the_real_sandbox(tmp_path):
    reason = _sandbox_reason()
    if reason:
        pytest.skip(f"no sandbox here: {reason}")
    out = tmp_path / "out"
    tasks = tmp_path / "os_tasks.json"
    # Every OS fixture task in one AgentBench-style array (the loader reads arrays and single objects).
    tasks.write_text(json.dumps([t for p in OS_FILES for t in (lambda d: d if isinstance(d, list) else [d])(
        json.loads(p.read_text()))]))
    with Server(fixture_policy(os_files=OS_FILES)) as server:
        report = synthesize(_config(server, out, tasks=tasks, env="os", n=1))
        calls = server.calls
        records, failures = _assert_every_episode_once(out, "os", report["tasks"], 1)
        _assert_valid_with_reasoning(records)
        solved = {r["task"] for r in records}
        assert "execute ~/test and get the output." in solved  # start script: su - jack, the agent is jack
        assert any("SUID" in task for task in solved)           # a check task scored by its check script
        assert {f["reason"] for f in failures} <= {"wrong_answer", "skipped", "env_error"}
        assert synthesize(_config(server, out, tasks=tasks, env="os", n=1))["llm"]["calls"] == 0
        assert server.calls == calls


UNAUTHORIZED_TASK = "what is the total number of register listings from dover?"


def test_cli_synth_flow_and_the_build_reads_the_output(tmp_path, monkeypatch, capsys, caplog):
    """The one test that pays for Prefect: `trajforge synth` through the flow, then a build unit.

    The server echoes each request, Authorization header included, in its error bodies (a 500 now and
    then, and 401 for one task): the bodies are kept in the failure details, and no trace of the key
    reaches an output file, the request cache, a log, the printed output or Prefect's database. Then a
    server that is down: exit 1 with one clear line.
    """
    from trajforge.flows.cli import main
    from trajforge.flows.config import read_config
    from trajforge.pipeline.build import BuildConfig, process_unit
    from trajforge.sources import get_source

    caplog.set_level(logging.INFO)
    monkeypatch.setenv("MY_LLM_KEY", SECRET)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    out = tmp_path / "out"

    def fault(number: int, body: dict) -> str | None:
        if UNAUTHORIZED_TASK in body["messages"][0]["content"]:
            return "401"
        return "500" if number % 7 == 0 else None

    # The shipped example config (DBBench fixture tasks, this model), with options over it.
    monkeypatch.chdir(REPO)
    assert read_config(str(REPO / "configs" / "synth.yaml"))["llm"]["model"] == MODEL
    with Server(fixture_policy(db_files=[DB_FILE]), fault=fault, echo_request=True) as server:
        code = main(["synth", "--config", str(REPO / "configs" / "synth.yaml"), "--base-url", server.base_url,
                     "--n", "1", "--out", str(out), "--api-key-env", "MY_LLM_KEY",
                     "--sampling", "temperature=0.5", "--max-retries", "3", "--timeout", "30"])
    assert code == 0 and f"Bearer {SECRET}" in server.authorizations
    assert server.faults["401"] == 1 and server.faults["500"] > 1
    assert all(r["temperature"] == 0.5 for r in server.requests)
    printed = capsys.readouterr()
    assert "tasks with a record" in printed.out and SECRET not in printed.out + printed.err
    records, failures = _assert_every_episode_once(out, "db", 39, 1)
    [unauthorized] = [f for f in failures if f["reason"] == "llm_error:client_error"]
    assert "HTTP 401" in unauthorized["detail"] and "Incorrect API key" in unauthorized["detail"]
    assert "Bearer [REDACTED]" in unauthorized["detail"]
    assert len([r for r in caplog.records if "the server answered HTTP 500" in r.getMessage()]) == 1
    assert SECRET not in caplog.text

    down = tmp_path / "down"
    started = time.monotonic()
    code = main(["synth", "--tasks", str(DB_FILE), "--env", "db", "--model", MODEL, "--base-url", down_url(),
                 "--n", "1", "--out", str(down), "--api-key-env", "MY_LLM_KEY", "--episodes", "1"])
    assert code == 1 and time.monotonic() - started < 30  # a guard: it took 137 s of retries before
    printed = capsys.readouterr()
    assert "trajforge: synth stopped: http://127.0.0.1:" in printed.err
    assert "refused the connection and has not answered since the job started" in printed.err
    assert not (down / "report.json").exists()
    assert SECRET not in printed.out + printed.err + caplog.text
    for path in list(out.rglob("*")) + list(down.rglob("*")) + list((tmp_path / "prefect").rglob("*")):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path

    [unit_file] = get_source("synthetic").files(str(out))
    unit = process_unit("synthetic", unit_file, tmp_path / "staging", BuildConfig())
    assert unit.written == len(records) and unit.quarantined == 0
    built = pa.ipc.open_file(unit.records_path).read_all().to_pylist()
    assert {r["id"] for r in built} == {r["id"] for r in records}
    # The build passes synthetic records through whole: reasoning and generator metadata survive.
    by_id = {r["id"]: r for r in records}
    for record in built:
        assert record["meta"] == by_id[record["id"]]["meta"] and "model" in record["meta"]
        assert record["conversations"] == by_id[record["id"]]["conversations"]
        assert all(t["reasoning"] for t in record["conversations"] if t["role"] == "assistant")
        assert json.loads(record["meta"])["sampling"]["temperature"] == 0.5


TRUNCATED_TASK = "how many floors does the capitol square have?"


def test_a_strict_server_gets_only_the_fields_it_knows_and_the_outputs_say_what_was_sent(tmp_path, caplog):
    """transformers serve rejects QwQ's top_k with 422: it is dropped once, and the report and meta say so."""
    caplog.set_level(logging.WARNING)
    out = tmp_path / "out"

    def fault(number: int, body: dict) -> str | None:  # one task's replies are always cut off
        return "truncate" if TRUNCATED_TASK in body["messages"][1]["content"] else None

    with Server(fixture_policy(db_files=[DB_FILE]), strict=True, sampling=True, fault=fault) as server:
        report = synthesize(_config(server, out, model="Qwen/QwQ-32B", episode_concurrency=4))
    sent = {"temperature": 0.6, "top_p": 0.95}
    assert report["llm"]["sampling"] == sent and report["llm"]["sampling_dropped"] == ["top_k"]
    # Only the requests in flight before the first answer carried top_k, and every one was rejected
    # (a retry without it may reach the server before another of those in flight).
    carried = sum("top_k" in body for body in server.requests)
    assert 1 <= carried == server.faults["422"] <= 4
    records, failures = _assert_every_episode_once(out, "db", 39, 2)
    assert records and all(json.loads(r["meta"])["sampling"] == sent for r in records)
    assert len([r for r in caplog.records if "rejects top_k" in r.getMessage()]) == 1
    # A server that samples: no task's samples are identical, and no warning.
    assert report["tasks_with_identical_samples"] == 0 and "the very same replies" not in caplog.text
    # The rejected replies' text and the tokens they cost are kept with the failure.
    cut = [f for f in failures if f["reason"] == "truncated"]
    assert len(cut) == 2
    for row in cut:
        rejected = json.loads(row["rejected"])
        assert len(rejected) == 3 and all(r["issue"] == "truncated" and r["finish_reason"] == "length"
                                          and r["content"].startswith("<think>") for r in rejected)
        assert row["usage"]["completion_tokens"] > 0 and row["usage"]["prompt_tokens"] > 0


def test_a_server_that_goes_away_stops_the_job_and_a_rerun_resumes(tmp_path):
    out = tmp_path / "out"
    # The server answers 30 requests, then every connection is dropped before an answer (as when killed).
    with Server(fixture_policy(db_files=[DB_FILE]), fault=lambda n, body: "reset" if n > 30 else None) as server:
        with pytest.raises(ServerUnreachable, match="10 requests in a row could not connect") as info:
            synthesize(_config(server, out, episode_concurrency=4))
    assert "Rerun the same command" in info.value.detail
    assert not (out / "report.json").exists() and not (out / "failures.parquet").exists()

    with Server(fixture_policy(db_files=[DB_FILE])) as server:
        report = synthesize(_config(server, out))
    assert report["episodes_resumed"] > 0 and report["episodes_resumed"] + report["episodes_run"] == 78
    assert not any(r.startswith("llm_error") for r in report["failure_reasons"])
    _assert_every_episode_once(out, "db", 39, 2)


def test_a_server_that_is_down_fails_the_job_at_once(tmp_path):
    out = tmp_path / "out"
    started = time.monotonic()
    # Default backoff: without the breaker, 78 episodes x 9 attempts would take minutes.
    with pytest.raises(ServerUnreachable, match="ConnectionRefusedError"):
        synthesize(_config(down_url(), out, backoff_base_s=0.5))
    assert time.monotonic() - started < 30
    assert not (out / "report.json").exists()
