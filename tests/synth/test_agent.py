"""The agent loop end to end: real HTTP to the loopback server, real environments, upstream scoring."""
from __future__ import annotations

import asyncio
import json
import logging

import pytest

from tests.support.openai_server import Reply, Server, fixture_policy
from tests.support.paths import FIXTURES
from trajforge.pipeline.envs.tasks import load_tasks
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.llm.client import LLMConfig, OpenAIBackend
from trajforge.pipeline.synth.agent import AgentConfig, conversation_for, run_episode
from trajforge.pipeline.synth.envs import EnvFailure, make_env
from trajforge.pipeline.synth.envs.db import DbEnv

DB_FILE = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"
DB_TASKS = {t.description: t for t in load_tasks(DB_FILE)}
# A SELECT task whose reference SQL is right, and an UPDATE scored by the table hash.
SELECT = DB_TASKS["how many floors does the capitol square have?"]
UPDATE = next(t for t in DB_TASKS.values() if t.data["kind"] == "modify" and t.data["type"] == "UPDATE")


def _episode(server: Server, task, model="deepseek-ai/DeepSeek-R1", config=AgentConfig(), sample=0, env=None, **llm):
    async def go():
        backend = OpenAIBackend(LLMConfig(model=model, base_url=server.base_url, api_key="sk-test",
                                          backoff_base_s=0.01, **llm))
        try:
            return await run_episode(backend, env or (lambda: make_env(task.env)), task, sample, config)
        finally:
            await backend.aclose()
    return asyncio.run(go())


def _db_server(**kw) -> Server:
    return Server(fixture_policy(db_files=[DB_FILE]), **kw)


@pytest.mark.parametrize("task", [SELECT, UPDATE], ids=["select", "update"])
def test_db_episode_becomes_a_valid_record_with_reasoning(task):
    with _db_server(shapes=("reasoning_content", "think")) as server:
        episode = _episode(server, task)
    assert episode.status == "success", (episode.reason, episode.detail)
    record = episode.record
    assert validate_record(record) is None
    assert record["id"] == f"synthetic/{task.id}~0" and record["source"] == "synthetic"
    assert record["reward"] == 1.0 and record["success"] is True
    assistant = [t for t in record["conversations"] if t["role"] == "assistant"]
    assert len(assistant) == 2 and all(t["reasoning"] and "<think>" not in t["reasoning"] for t in assistant)
    assert assistant[0]["action"].startswith("Operation") and assistant[-1]["action"].startswith("Answer")
    # R1: no system turn; the instructions lead the first user turn, then upstream's task prompt.
    first = record["conversations"][0]
    assert first["role"] == "user" and "SQLite" in first["content"] and task.description in first["content"]
    meta = json.loads(record["meta"])
    assert meta["generator"]["model"] == "deepseek-ai/DeepSeek-R1"
    assert meta["sampling"] == {"temperature": 0.6, "top_p": 0.95} and meta["reward"] == 1.0
    assert [s["valid"] for s in meta["steps"]] == [True, True]


def test_qwq_records_keep_the_system_turn():
    with _db_server() as server:
        episode = _episode(server, SELECT, model="Qwen/QwQ-32B")
    assert episode.status == "success"
    assert [t["role"] for t in episode.record["conversations"]][:2] == ["system", "user"]
    assert json.loads(episode.record["meta"])["sampling"]["top_k"] == 40


@pytest.mark.parametrize("shape", ["action_in_reasoning", "unclosed_think"])
def test_actions_recovered_from_reasoning_are_used_and_marked(shape):
    with _db_server(shapes=(shape,)) as server:
        episode = _episode(server, SELECT)
    assert episode.status == "success"
    assert {s.reasoning_issue for s in episode.steps} == {shape}
    assert validate_record(episode.record) is None


def test_empty_and_truncated_replies_are_reprompted_and_logged():
    faults = {1: "empty", 2: "truncate", 4: "empty"}
    with _db_server(fault=lambda n, body: faults.get(n)) as server:
        episode = _episode(server, SELECT)
    assert episode.status == "success"
    assert [(s.valid, s.issue) for s in episode.steps] == [
        (False, "empty_response"), (False, "truncated"), (True, None), (False, "empty_response"), (True, None)]
    assert server.calls == 5
    # The re-prompt went to the server; the rejected replies are not in the record.
    assert "cut off" in server.requests[2]["messages"][-1]["content"]
    assert len([t for t in episode.record["conversations"] if t["role"] == "assistant"]) == 2


def test_format_retries_are_bounded():
    with Server(lambda messages: Reply("Hmm.", "I am not sure what to do here."), shapes=("think",)) as server:
        episode = _episode(server, SELECT, config=AgentConfig(max_format_retries=2))
    assert (episode.status, episode.reason) == ("failure", "format_error")
    assert server.calls == 3 and [s.issue for s in episode.steps] == ["format_error"] * 3


def test_max_turns_ends_an_episode_that_never_answers():
    query = "Think: look again.\nAction: Operation\n```sql\nSELECT COUNT(*) FROM skyscrapers_in_Columbus;\n```"
    with Server(lambda messages: Reply("Let me look.", query)) as server:
        episode = _episode(server, SELECT, config=AgentConfig(max_turns=3))
    assert (episode.status, episode.reason) == ("failure", "max_turns") and server.calls == 3
    assert [t["role"] for t in episode.turns].count("assistant") == 3


def test_wrong_answer_is_a_failure_with_the_score():
    answer = "Think: I guess.\nAction: Answer\nFinal Answer: [\"99\"]"
    with Server(lambda messages: Reply("A guess.", answer)) as server:
        episode = _episode(server, SELECT)
    assert (episode.status, episode.reason, episode.reward) == ("failure", "wrong_answer", 0.0)
    assert episode.turns[-1]["action"].startswith("Answer")


def test_llm_failure_is_transient_with_its_reason():
    with _db_server(fault=lambda n, body: "500") as server:
        episode = _episode(server, SELECT, max_retries=1)
    assert (episode.status, episode.reason) == ("failure", "llm_error:server_error") and episode.transient


def test_env_that_cannot_start_fails_with_a_reason():
    os_task = load_tasks(FIXTURES / "tasks" / "agentbench" / "os" / "4-N4.json")[0]
    with _db_server() as server:
        episode = _episode(server, os_task.__class__(**{**os_task.as_dict(), "env": "db"}))
    assert (episode.status, episode.reason) == ("failure", "env_error") and "reset" in episode.detail
    assert server.calls == 0


class _BuggyDb(DbEnv):
    """A bug in environment code: an exception no environment declares."""

    def step(self, action):
        return {}["missing column"]


class _DownDb(DbEnv):
    def step(self, action):
        raise EnvFailure("the database server is down")


def test_env_bug_is_a_transient_env_error_with_its_traceback_logged_once(caplog):
    with _db_server() as server, caplog.at_level(logging.ERROR, "trajforge.agent"):
        episodes = [_episode(server, SELECT, sample=n, env=_BuggyDb) for n in range(3)]
    assert all((e.reason, e.transient) == ("env_error", True) and "KeyError" in e.detail for e in episodes)
    assert caplog.text.count("Traceback") == 1 and "missing column" in caplog.text
    assert 'return {}["missing column"]' in caplog.text


def test_declared_env_failure_is_an_env_error_without_a_traceback(caplog):
    with _db_server() as server, caplog.at_level(logging.ERROR, "trajforge.agent"):
        episode = _episode(server, SELECT, env=_DownDb)
    assert (episode.reason, episode.transient) == ("env_error", True) and "server is down" in episode.detail
    assert "Traceback" not in caplog.text


def test_conversation_folds_the_system_turn_for_r1_only():
    turns = [{"role": "system", "content": "S", "loss": False}, {"role": "user", "content": "U", "loss": False},
             {"role": "assistant", "content": "A", "loss": True, "reasoning": "R"}]
    r1 = conversation_for("DeepSeek-R1", turns)
    assert [(t["role"], t["content"]) for t in r1] == [("user", "S\n\nU"), ("assistant", "A")]
    assert r1[1]["reasoning"] == "R"
    assert conversation_for("Qwen/QwQ-32B", turns) == turns
