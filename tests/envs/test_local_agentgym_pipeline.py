"""AgentGym's BabyAI and TextCraft, in-process, through every stage that runs an environment:
synthesis, salvage, the RL tasks and the TRL adapter, and record validation. A scripted policy
behind the loopback OpenAI-compatible server solves one real task of each env (AgentTraj-L items)
and fails the other; salvage then keeps the failure's prefix and finishes it with a policy that
knows the way."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

pytest.importorskip("minigrid", reason="the `envs` extra (minigrid) is not installed")

from tests.support.local_agentgym import PLANS, STUCK, GoalPolicy  # noqa: E402
from tests.support.openai_server import Server  # noqa: E402
from tests.support.oracles import grpo_env_rows  # noqa: E402
from tests.support.paths import FIXTURES  # noqa: E402
from trajforge.pipeline.envs.tasks import load_tasks  # noqa: E402
from trajforge.pipeline.envs.tool_calls import tool_messages, trajectory_prompt  # noqa: E402
from trajforge.pipeline.ingest.validate import grammar_breaches, validate_record  # noqa: E402
from trajforge.pipeline.llm.client import LLMConfig  # noqa: E402
from trajforge.pipeline.synth.agent import AgentConfig  # noqa: E402
from trajforge.pipeline.synth.job import SynthConfig, synthesize  # noqa: E402
from trajforge.pipeline.synth.salvage import SalvageConfig, salvage  # noqa: E402
from trajforge.schemas import first_error  # noqa: E402
from trajforge.training.environments import make_factories  # noqa: E402

TASKS = FIXTURES / "tasks" / "agentgym"
SOLVED = {"babyai": "go to the blue ball", "textcraft": "Goal: craft leather."}
FAILED = {"babyai": "go to the red ball", "textcraft": "Goal: craft yellow terracotta."}
def _llm(server: Server) -> LLMConfig:
    return LLMConfig(model="deepseek-ai/DeepSeek-R1", base_url=server.base_url, api_key="sk-test",
                     backoff_base_s=0.01)


@pytest.fixture(scope="module", params=["babyai", "textcraft"])
def synthesized(request, tmp_path_factory):
    env = request.param
    out = tmp_path_factory.mktemp(f"synth-{env}")
    with Server(GoalPolicy(stuck=True)) as server:
        report = synthesize(SynthConfig(tasks=str(TASKS / f"{env}.jsonl"), env=env, out=str(out), n=1,
                                        llm=_llm(server)))
    return env, out, report


def test_synthesis_solves_one_real_task_and_fails_the_other(synthesized):
    env, out, report = synthesized
    assert (report["tasks"], report["records"], report["failures"]) == (2, 1, 1)
    (record,) = pq.read_table(out / "data" / "synthetic" / f"{env}.parquet").to_pylist()
    assert record["env"] == env and record["reward"] == 1.0 and SOLVED[env] in record["task"]
    # The record holds the benchmark's own instructions and the env's first observation (one user
    # turn: R1 takes no system turn).
    first = record["conversations"][0]["content"]
    assert first.startswith(("You are an exploration master", "You are given few useful crafting"))
    assert SOLVED[env] in first
    # Validation: the record passes every check, each action by the env's own grammar.
    assert validate_record(record) is None
    checked, breaches = grammar_breaches(record)
    assert checked >= 2 and breaches == []
    (failure,) = pq.read_table(out / "failures.parquet").to_pylist()
    assert failure["reason"] == "max_turns" and failure["env"] == env
    assert len([t for t in json.loads(failure["conversations"]) if t["role"] == "assistant"]) == 8


def test_salvage_finishes_the_failures_prefix_in_a_fresh_env(synthesized, tmp_path):
    env, out, _ = synthesized
    with Server(GoalPolicy()) as server:
        report = salvage(SalvageConfig(failures=[str(out / "failures.parquet")], tasks=str(TASKS / f"{env}.jsonl"),
                                       out=str(tmp_path), llm=_llm(server), agent=AgentConfig(max_turns=14)))
    assert report["outcomes"] == {"salvaged": 1}
    (row,) = pq.read_table(tmp_path / "salvage.parquet").to_pylist()
    (record,) = pq.read_table(tmp_path / "data" / "synthetic" / f"{env}.parquet").to_pylist()
    assert record["reward"] == 1.0 and validate_record(record) is None
    actions = [t["action"] for t in record["conversations"] if t["role"] == "assistant"]
    (failure,) = pq.read_table(out / "failures.parquet").to_pylist()
    failed = [t["action"] for t in json.loads(failure["conversations"]) if t["role"] == "assistant"]
    # The kept prefix is the failure's own first actions, less those that changed nothing (the stuck
    # policy repeats itself); the continuation reaches the goal.
    meta = json.loads(record["meta"]) if isinstance(record["meta"], str) else record["meta"]
    kept, dropped = meta["prefix_from"], {int(i) for i in meta["dropped_steps"]}
    assert row["prefix_steps"] == 7 and kept == sorted(kept) and set(kept) | dropped == set(range(7))
    assert row["dropped_steps"] == len(dropped) and not set(kept) & dropped
    assert actions[:len(kept)] == [failed[i] for i in kept] and actions[len(kept):]


@pytest.mark.parametrize("env", ["babyai", "textcraft"])
def test_rl_tasks_run_in_the_trl_adapter_and_score_1_and_0(env):
    tasks = load_tasks(TASKS / f"{env}.jsonl")
    rows, unrunnable = grpo_env_rows(tasks, [])  # what `trajforge build --rl-tasks` writes
    assert unrunnable == 0 and len(rows) == 2
    assert all(first_error("grpo_env", row) is None and row["environment"] == env for row in rows)
    factory = make_factories([env], max_turns=6)[env]
    for row in rows:
        adapter = factory()
        observation = adapter.reset(**row)
        goal = next(g for g in PLANS if g in observation)
        plan = PLANS[goal]
        if goal in SOLVED.values():
            for step in range(4):
                answer = adapter.act(plan(observation) if callable(plan) else plan[min(step, len(plan) - 1)])
                observation = answer
            assert adapter.get_reward() == 1.0
        else:
            for n in range(3):
                adapter.act(STUCK[goal](n))
            assert adapter.get_reward() == 0.0
        assert not adapter._is_open
    factory.close_all()


def test_a_local_env_trajectory_renders_as_the_act_tool(synthesized):
    env, out, _ = synthesized
    (record,) = pq.read_table(out / "data" / "synthetic" / f"{env}.parquet").to_pylist()
    rendered = tool_messages(record, trajectory_prompt(record), tools=[])
    calls = [m["tool_calls"][0]["function"] for m in rendered["messages"] if m.get("tool_calls")]
    assert calls and {c["name"] for c in calls} == {"act"}
    assert calls[-1]["arguments"]["action"] in (PLANS[SOLVED[env]][-1] if env == "textcraft" else "go to blue ball 1",)
