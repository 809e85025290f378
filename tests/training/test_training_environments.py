"""Multi-turn GRPO in our environments: the `grpo_env` tasks, the TRL adapters driven by a scripted
policy (reference solution -> 1.0, wrong answer -> 0.0), one action format from SFT to RL, and
two real GRPO steps whose rollouts run in SQLite and in the OS sandbox.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.support.oracles import grpo_env_rows
from tests.support.paths import FIXTURES
from tests.support.sandbox import sandbox_leftovers
from trajforge.pipeline.envs.tasks import load_tasks
from trajforge.pipeline.envs.tool_calls import action_text, tool_call, tool_messages
from trajforge.pipeline.quality.derived import grpo_env_row, record_task
from trajforge.schemas import first_error
from trajforge.training.environments import EPISODE_OVER, EnvironmentFactory, ToolEnvironment, make_factories
from trajforge.training.rewards import tool_call_reward

TASKS = FIXTURES / "tasks" / "agentbench"
DB_FILE = TASKS / "db" / "dev.jsonl"
OS_FILE = TASKS / "os" / "4-N4.json"  # `execute ~/test`: run it, answer its output ("love")
DB_SELECT = "how many floors does the capitol square have?"
DB_QUERY = "SELECT Floors FROM skyscrapers_in_Columbus WHERE Name = 'Capitol Square';"

_missing = [t for t in ("bwrap", "unshare") if shutil.which(t) is None]
needs_sandbox = pytest.mark.skipif(bool(_missing) or os.geteuid() != 0,
                                   reason="the OS sandbox needs bwrap, unshare and root")


def db_task():
    return next(t for t in load_tasks(DB_FILE) if t.description == DB_SELECT)


def os_task():
    (task,) = load_tasks(OS_FILE)
    return task


# --- the grpo_env tasks ----------------------------------------------------------------------------
def test_grpo_env_rows_from_task_files_are_valid_and_reset_to_their_task():
    tasks = load_tasks(DB_FILE) + [t for f in sorted((TASKS / "os").glob("*.json")) for t in load_tasks(f)]
    rows, unrunnable = grpo_env_rows(tasks, [])
    assert unrunnable == 2 and len(rows) == len(tasks) - 2  # the two sudo tasks need the network
    assert all(first_error("grpo_env", row) is None for row in rows)
    by_id = {row["id"]: row for row in rows}
    db = by_id[db_task().id]
    assert db["environment"] == "db" and json.loads(db["answer"]) == db_task().data["label"]
    assert json.loads(db["env_task"]) == db_task().as_dict()
    assert db["prompt"][1]["content"].endswith(f"Question: {DB_SELECT}\n")
    assert by_id[os_task().id]["answer"] == "love"
    # Check-scored OS tasks and table-changing DB tasks have no answer to compare.
    assert {row["answer"] for row in rows if row["environment"] == "db" and "INSERT" in row["task"]} <= {None}


def test_grpo_env_rows_from_trajectories_only_where_an_env_can_reset(fixtures_build):
    from tests.support.tiny_model import read_config

    records = read_config(fixtures_build, "sft")
    rows, _ = grpo_env_rows([], records)
    agentgym = [r for r in records if record_task(r) is not None]
    assert rows and len(rows) == len({record_task(r).id for r in agentgym})
    assert {row["source"] for row in rows} == {"agenttraj_l"}  # AgentInstruct rows hold no loadable task
    for row in rows:
        assert first_error("grpo_env", row) is None
        payload = json.loads(row["env_task"])
        assert row["environment"] == "agentgym" and payload["data"]["env_name"] == row["env"]
        assert isinstance(payload["data"]["item_id"], int)


def test_synthetic_trajectory_lends_its_answer_to_a_task_without_one():
    task = next(t for t in load_tasks(DB_FILE) if t.data["kind"] == "modify")
    record = {"kind": "positive", "source": "synthetic", "meta": json.dumps({"task_id": task.id}),
              "answer": "[]", "env": "db", "source_id": f"{task.id}~0"}
    (row,), _ = grpo_env_rows([task], [record])
    assert row["id"] == task.id and row["answer"] == "[]"


def test_build_writes_a_grpo_env_config_that_load_dataset_reads(tmp_path, raw_dir, monkeypatch):
    from datasets import load_dataset

    from trajforge.pipeline.build import BuildConfig, finalize, process_unit
    from trajforge.sources import get_source

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    config = BuildConfig(rl_tasks=(str(DB_FILE), str(OS_FILE)))
    source = get_source("agenttraj_l")
    files = [f for f in source.files(raw_dir / "agenttraj_l") if f.path.name.startswith("webshop")]
    units = [process_unit("agenttraj_l", f, tmp_path / ".staging", config) for f in files]
    report = finalize(units, tmp_path, config)
    data = load_dataset(str(tmp_path), "grpo_env", split="train")
    assert report["grpo_env"] == {"rows": len(data), "unrunnable_tasks": 0}
    environments = data["environment"]
    assert environments.count("db") == 39 and environments.count("os") == 1 and environments.count("agentgym") > 0
    assert "grpo_env" in (tmp_path / "README.md").read_text()


# --- the adapters, driven by a scripted policy --------------------------------------------------------
def test_db_adapter_reference_solution_scores_1_and_a_wrong_answer_0():
    row = grpo_env_row(db_task(), "tasks")
    factory = EnvironmentFactory("db", max_concurrent=2)
    env = factory()
    assert env.reset(**row) is None  # the prompt already holds the first observation
    assert env.execute_sql(query=DB_QUERY) == "[('26',)]"
    assert factory.open_count() == 1
    env.submit(answer=row["answer"])
    assert env.execute_sql(query=DB_QUERY) == EPISODE_OVER
    assert env.get_reward() == 1.0 and factory.open_count() == 0
    env.reset(**row)
    env.submit(answer='["25"]')
    assert env.get_reward() == 0.0 and factory.open_count() == 0


def test_an_unfinished_episode_scores_0_and_max_turns_ends_it():
    row = grpo_env_row(db_task(), "tasks")
    env = EnvironmentFactory("db", max_turns=1)()
    env.reset(**row)
    env.execute_sql(query=DB_QUERY)
    assert env.submit(answer=row["answer"]).startswith("No turns left")
    assert env.get_reward() == 0.0


def test_open_sandboxes_are_bounded_and_close_all_closes_them():
    row = grpo_env_row(db_task(), "tasks")
    factory = EnvironmentFactory("db", max_concurrent=2)
    first, second, third = factory(), factory(), factory()
    first.reset(**row)
    second.reset(**row)
    with pytest.raises(RuntimeError, match="max_concurrent_envs"):
        third.reset(**row)
    assert factory.open_count() == 2
    factory.close_all()
    assert factory.open_count() == 0
    third.reset(**row)  # the slots are free again
    factory.close_all()


def test_a_task_for_another_environment_is_refused():
    with pytest.raises(ValueError, match="not 'db'"):
        EnvironmentFactory("db")().reset(**grpo_env_row(os_task(), "tasks"))
    with pytest.raises(ValueError, match="env_settings"):
        make_factories(["db"], {"os": {}})


@needs_sandbox
def test_os_adapter_reference_solution_scores_1_and_a_wrong_answer_0():
    task = os_task()
    row = grpo_env_row(task, "tasks")
    factory = EnvironmentFactory("os", max_concurrent=1, step_timeout=15)
    env = factory()
    env.reset(**row)
    sandboxes = [env._env.sandbox.name]
    output = env.bash(command=task.data["evaluation"]["example"]["code"])
    assert output.strip().splitlines()[-1] == "love"
    env.answer(text="love")
    assert env.get_reward() == 1.0 and factory.open_count() == 0
    env.reset(**row)
    sandboxes.append(env._env.sandbox.name)
    env.answer(text="hate")
    assert env.get_reward() == 0.0 and factory.open_count() == 0
    assert not [found for name in sandboxes for found in sandbox_leftovers(name)]


def test_agentgym_adapter_scores_with_the_servers_reward(serve):
    server, url = serve()
    task = record_task({"source": "agenttraj_l", "env": "guess", "source_id": "guess_4", "task": "Guess.",
                        "source_file": "guess_train.json"})
    row = grpo_env_row(task, "agenttraj_l", env="guess")
    env = EnvironmentFactory("agentgym", base_url=url)()
    assert env.reset(**row).startswith("Guess my number")  # the server's first observation
    assert env.act(action="guess 1") == "correct"  # (7 * 4 + 3) % 10
    assert env.get_reward() == 1.0 and server.envs == {}
    env.reset(**row)
    assert env.act(action="guess 2") == "lower"
    assert env.get_reward() == 0.0 and server.envs == {}


# --- one action format --------------------------------------------------------------------------------
def test_every_action_round_trips_through_its_tool_call():
    actions = {"os": ["Act: bash\n\n```bash\nls -la\n```", "Act: answer(42)", "Act: finish"],
               "db": ["Action: Operation\n```sql\nSELECT 1;\n```", "Action: Answer\nFinal Answer: [\"x\"]"],
               "agentgym": ["Action: search[red shoes]"]}
    for environment, texts in actions.items():
        for text in texts:
            call = tool_call(environment, text)
            assert tool_call(environment, action_text(environment, call["name"], call["arguments"])) == call
    assert tool_call("os", "Act: dance") is None
    with pytest.raises(ValueError, match="unknown tool"):
        action_text("db", "bash", {"command": "ls"})


def test_tool_call_reward_scores_the_share_of_well_formed_calls():
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "execute_sql", "arguments": {"query": "SELECT 1"}}}]}
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}}]}
    tool = {"role": "tool", "name": "execute_sql", "content": "[(1,)]"}
    words = {"role": "assistant", "content": "done"}
    rewards = tool_call_reward([[call, tool, words], [call, tool, bad, tool, words], [words], [words]],
                               environment=["db", "db", "db", None])
    assert rewards == [1.0, 0.5, 0.0, None]
    # The single-reply rewards leave episodes to their environment's score.
    from trajforge.training.rewards import accuracy_reward, format_reward

    episodes = {"environment": ["db"], "answer": ['["26"]'], "rendering": [None], "dialect": [None]}
    assert accuracy_reward([[call, tool, words]], **episodes) == [None]
    assert format_reward([[call, tool, words]], **episodes) == [None]


def test_sft_example_and_rl_rollout_of_a_task_share_one_action_format(tmp_path):
    """The SFT `tools` rendering of a trajectory and an RL rollout of the same task: same prompt
    tokens (tools included), and every trained SFT reply parses (as TRL parses a generation) to a
    call that the adapter runs, giving the observation the SFT example shows."""
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema
    from trl.chat_template_utils import add_response_schema, parse_response

    from tests.support.tiny_model import build_tokenizer, tool_chat_template

    tokenizer = add_response_schema(build_tokenizer(["SELECT Floors FROM x"] * 20, chat_template=tool_chat_template()))
    tokenizer.save_pretrained(tmp_path)
    tokenizer = add_response_schema(AutoTokenizer.from_pretrained(tmp_path))
    row = grpo_env_row(db_task(), "tasks")
    env = EnvironmentFactory("db")()
    tools = [env.execute_sql, env.submit]
    env.reset(**row)
    record = {"env": "db", "conversations": [
        {"role": "user", "content": "ReAct instructions + question"},
        {"role": "assistant", "content": "", "thought": "Look it up.",
         "action": f"Operation\n```sql\n{DB_QUERY}\n```"},
        {"role": "user", "content": "[('26',)]"},
        {"role": "assistant", "content": "", "thought": "Done.", "action": "Answer\nFinal Answer: [\"26\"]"}]}
    example = tool_messages(record, row["prompt"], [get_json_schema(t) for t in tools])
    rl_prompt = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"]
    sft_prompt = tokenizer.apply_chat_template(example["messages"][:2], tools=example["tools"],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert sft_prompt == rl_prompt
    observations = []
    for k, message in enumerate(example["messages"]):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(example["messages"][:k], tools=example["tools"],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        through = tokenizer.apply_chat_template(example["messages"][:k + 1], tools=example["tools"], tokenize=True,
                                                return_dict=True)["input_ids"]
        assert through[:len(before)] == before
        parsed = parse_response(tokenizer, through[len(before):], prefix=before, tools=tools)
        (call,) = parsed["tool_calls"]
        assert call["function"] == message["tool_calls"][0]["function"]
        observations.append(getattr(env, call["function"]["name"])(**call["function"]["arguments"]))
    assert observations[0] == example["messages"][3]["content"] == "[('26',)]"
    assert env.get_reward() == 1.0


# --- two GRPO steps with rollouts in SQLite and the OS sandbox -------------------------------------------
CONFIGS = Path(__file__).resolve().parents[2] / "training" / "configs"


def first_reply(tokenizer, prompt: list[dict], tools: list, call: dict) -> tuple[str, str]:
    """(prompt text, assistant reply) as the chat template renders a first turn that makes one
    tool call: what SFT on the `tools` rendering teaches."""
    head = tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        prompt + [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}],
        tools=tools, tokenize=False)
    assert full.startswith(head)
    return head, full[len(head):]


def write_grpo_env(rows: list[dict], folder: Path) -> Path:
    """A release folder whose `grpo_env` config holds `rows`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trajforge.schemas import arrow_schema

    (folder / "data" / "grpo_env").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema("grpo_env")),
                   folder / "data" / "grpo_env" / "train-00000-of-00001.parquet")
    return folder


def train_grpo_env(model: Path, data: Path, out: Path, *overrides: str, generate=None):
    """(trainer, the batches it generated and scored) after training with grpo_env_tiny.yaml;
    `generate` stands in for the model's sampling when given."""
    from trajforge.training.arguments import GRPOTrainConfig, parse
    from trajforge.training.grpo import build_trainer, close_environments

    data_args, training_args, model_args = parse(GRPOTrainConfig, [
        "--config", str(CONFIGS / "grpo_env_tiny.yaml"), "--model_name_or_path", str(model),
        "--dataset_name", str(data), "--output_dir", str(out), *overrides])
    trainer = build_trainer(data_args, training_args, model_args)
    if generate is not None:
        trainer.model.generate = generate
    batches = []
    score = trainer._generate_and_score_completions

    def spy_score(inputs):
        batches.append(score(inputs))
        return batches[-1]

    trainer._generate_and_score_completions = spy_score
    try:
        trainer.train()
    finally:
        close_environments(trainer)
    return trainer, batches


@needs_sandbox
def test_two_grpo_steps_run_episodes_in_sqlite_and_the_os_sandbox(fixtures_build, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from tests.support.tiny_model import build_tiny_model, fit_texts, tool_chat_template
    from trajforge.pipeline.synth.envs.os_sandbox import OsSandboxEnv

    torch.set_num_threads(1)
    rows = [grpo_env_row(db_task(), "tasks"), grpo_env_row(os_task(), "tasks")]
    data = write_grpo_env(rows, tmp_path / "release")
    # A policy that has seen one tool call per task (as after SFT on the `tools` rendering), so
    # that its samples call the tools; a random one would never write a well-formed call. On the
    # DB task it submits the right answer, so the environment's score is not always 0.
    tiny = build_tiny_model(tmp_path / "tiny", fixtures_build, chat_template=tool_chat_template())
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    probe = {"db": EnvironmentFactory("db")(), "os": EnvironmentFactory("os")()}
    calls = {"db": {"name": "submit", "arguments": {"answer": '["26"]'}},
             "os": {"name": "bash", "arguments": {"command": "cat ~/test"}}}
    tools = {"db": [probe["db"].execute_sql, probe["db"].submit],
             "os": [probe["os"].answer, probe["os"].bash, probe["os"].finish]}
    turns = [first_reply(tokenizer, row["prompt"], tools[row["environment"]], calls[row["environment"]])
             for row in rows]
    policy = fit_texts(tiny, [reply for _, reply in turns], tmp_path / "policy", steps=100, max_length=2048,
                       contexts=[context for context, _ in turns])

    sandboxes: list[str] = []
    reset = OsSandboxEnv.reset

    def spy_reset(self, task):
        try:
            return reset(self, task)
        finally:
            if self.sandbox is not None:
                sandboxes.append(self.sandbox.name)

    monkeypatch.setattr(OsSandboxEnv, "reset", spy_reset)
    scores: dict[str, list[float]] = {"db": [], "os": []}
    get_reward = ToolEnvironment.get_reward

    def spy_get_reward(self):
        scores[self.environment].append(get_reward(self))
        return scores[self.environment][-1]

    monkeypatch.setattr(ToolEnvironment, "get_reward", spy_get_reward)
    trainer, batches = train_grpo_env(policy, data, tmp_path / "out", "--temperature", "0.3")
    factories = trainer.environment_factories
    instances = [i for f in factories.values() for i in f.instances]
    # The model's calls reached both environments, and the environments answered.
    for name in ("db", "os"):
        assert any(i.actions for i in factories[name].instances), name
    assert any("Permission denied" in o or "love" in o for i in factories["os"].instances for o in i.observations)
    # Observations came back in the completions, masked out of the loss (tool_mask 0), and only they.
    masked_text = ""
    for batch in batches:
        for ids, mask in zip(batch["completion_ids"], batch["tool_mask"]):
            masked_text += tokenizer.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m == 0])
            assert "<tool_response>" not in tokenizer.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m])
    observed = [o for i in instances for o in i.observations]
    assert observed and all(o.strip()[:20] in masked_text for o in observed)
    # The environments' own scores are rewards of the run, and every sandbox is closed.
    logged = [entry for entry in trainer.state.log_history if "rewards/DbEnvironment/mean" in entry]
    assert len(logged) == 2 and len(scores["db"]) == len(scores["os"]) == 4  # 2 rollouts per task and step
    for name, column in (("db", "rewards/DbEnvironment/mean"), ("os", "rewards/OsEnvironment/mean")):
        per_step = [sum(scores[name][k:k + 2]) / 2 for k in (0, 2)]
        assert [entry[column] for entry in logged] == pytest.approx(per_step), name
    assert 1.0 in scores["db"]
    assert all(f.open_count() == 0 for f in factories.values())
    assert sandboxes and not [found for name in sandboxes for found in sandbox_leftovers(name)]


def test_max_concurrent_envs_must_cover_one_generation_batch():
    from trajforge.training.arguments import GRPOTrainConfig, parse
    from trajforge.training.grpo import environment_factories

    _, training_args, _ = parse(GRPOTrainConfig, [
        "--config", str(CONFIGS / "grpo_env_tiny.yaml"), "--model_name_or_path", "m", "--dataset_name", "d",
        "--max_concurrent_envs", "3"])
    with pytest.raises(ValueError, match="max_concurrent_envs=3 is below the 4 rollouts"):
        environment_factories(training_args)


def test_sft_in_the_tools_format_trains_on_calls_not_on_observations(fixtures_build, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tests.support.tiny_model import build_tokenizer, read_config, tool_chat_template
    from trajforge.training.data import IGNORE, prepare_sft, tools_rendering

    records = [r for r in read_config(fixtures_build, "sft") if r["env"] in ("os", "db", "webshop")][:12]
    build_tokenizer(["<tool_call> SELECT bash"] * 20, chat_template=tool_chat_template()).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    rendered = [tools_rendering(r) for r in records]
    assert sum(r is not None for r in rendered) >= 6
    data, stats = prepare_sft(Dataset.from_list(records), tokenizer, max_length=None, action_format="tools")
    assert stats.kept + stats.dropped_no_tool_call + stats.dropped_no_loss == len(records)
    assert stats.kept == sum(r is not None for r in rendered)
    kept = [r for r in rendered if r is not None]
    for example, ids, labels in zip(kept, data["input_ids"], data["labels"]):
        trained = tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE])
        untrained = tokenizer.decode([t for t, label in zip(ids, labels) if label == IGNORE])
        assert trained.count("<tool_call>") == sum(m["role"] == "assistant" for m in example["messages"])
        assert "<tool_response>" not in trained and "# Tools" in untrained
        assert untrained.count("<tool_response>") == sum(m["role"] == "tool" for m in example["messages"])


# --- multi-turn episodes: query, read the observation, answer -----------------------------------------
DB_DOVER = "what is the total number of register listings from dover?"


class ScriptedPolicy:
    """Stands in for sampling in a real GRPO run (the network still computes every log-prob and
    gradient): it reads the conversation it is given, as rendered so far, and writes the next reply
    as the chat template renders it. First it calls `execute_sql` with the task's reference query;
    after the result it calls `submit` with the values it read there (every second episode a wrong
    value instead); after that it says it is done."""

    def __init__(self, tokenizer, queries: dict[str, str]):
        self.tokenizer, self.queries, self.submits = tokenizer, queries, 0
        probe = EnvironmentFactory("db")()
        self.tools = [probe.execute_sql, probe.submit]

    def reply_text(self, message: dict) -> str:
        head = self.tokenizer.apply_chat_template([{"role": "user", "content": "-"}], tools=self.tools,
                                                  add_generation_prompt=True, tokenize=False)
        full = self.tokenizer.apply_chat_template([{"role": "user", "content": "-"}, message], tools=self.tools,
                                                  tokenize=False)
        return full[len(head):]

    def next_message(self, text: str) -> dict:
        import ast
        import re

        results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if not results:
            question = next(q for q in self.queries if q in text)
            call = {"name": "execute_sql", "arguments": {"query": self.queries[question]}}
        elif len(results) == 1:
            values = [str(v) for row in ast.literal_eval(results[0]) for v in row]
            self.submits += 1
            answer = json.dumps(values if self.submits % 2 else ["0"])
            call = {"name": "submit", "arguments": {"answer": answer}}
        else:
            return {"role": "assistant", "content": "Done."}
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}

    def generate(self, input_ids, attention_mask, **_):
        import torch

        replies = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            text = self.tokenizer.decode([t for t, m in zip(ids, mask) if m])
            reply = self.reply_text(self.next_message(text))
            replies.append(self.tokenizer(reply, add_special_tokens=False)["input_ids"])
        width = max(map(len, replies))
        pad = self.tokenizer.pad_token_id
        tail = torch.tensor([r + [pad] * (width - len(r)) for r in replies], dtype=input_ids.dtype)
        return torch.cat([input_ids, tail], dim=1)


def test_multi_turn_grpo_episodes_read_the_observation_and_are_scored_by_the_env(fixtures_build, tmp_path,
                                                                                  monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from tests.support.tiny_model import build_tiny_model, tool_chat_template

    torch.set_num_threads(1)
    tasks = [t for t in load_tasks(DB_FILE) if t.description in (DB_SELECT, DB_DOVER)]
    data = write_grpo_env([grpo_env_row(t, "tasks") for t in tasks], tmp_path / "release")
    tiny = build_tiny_model(tmp_path / "tiny", fixtures_build, chat_template=tool_chat_template())
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    references = {r["description"]: r["sql"]["query"] for r in map(json.loads, DB_FILE.read_text().splitlines())
                  if r["description"] in (DB_SELECT, DB_DOVER)}
    policy = ScriptedPolicy(tokenizer, references)

    episodes: list[tuple[list[str], list[str], float]] = []
    get_reward = ToolEnvironment.get_reward

    def spy_get_reward(self):
        episodes.append((list(self.actions), list(self.observations), get_reward(self)))
        return episodes[-1][2]

    monkeypatch.setattr(ToolEnvironment, "get_reward", spy_get_reward)
    trainer, batches = train_grpo_env(tiny, data, tmp_path / "out", "--environments", "db", "--env_settings", "{}",
                                      "--max_turns", "3", "--max_completion_length", "1024", generate=policy.generate)
    # Every episode queried, got the rows back, and answered from them; the env scored the answer:
    # the Capitol Square rows are its answer, the Dover reference query is wrong upstream (it counts
    # 2 listings, the task's answer is 17), so what the policy read there scores 0.
    assert len(episodes) == 8
    for actions, observations, score in episodes:
        assert len(actions) == 2 and actions[0].startswith("Action: Operation\n```sql\nSELECT")
        assert actions[1].startswith("Action: Answer\nFinal Answer: ") and observations[1] == "Episode finished."
        read = json.dumps([str(v) for row in __import__("ast").literal_eval(observations[0]) for v in row])
        capitol = "skyscrapers_in_Columbus" in actions[0]
        assert observations[0] == ("[('26',)]" if capitol else "[(2,)]")
        assert score == (1.0 if capitol and actions[1].endswith(read) else 0.0), (actions, observations, score)
    scores = [score for *_, score in episodes]
    assert 1.0 in scores and 0.0 in scores
    logged = [entry for entry in trainer.state.log_history if "rewards/DbEnvironment/mean" in entry]
    assert [entry["rewards/DbEnvironment/mean"] for entry in logged] == pytest.approx(
        [sum(scores[k:k + 4]) / 4 for k in (0, 4)])
    # In each completion both calls are trained on, and both observations are masked out.
    for batch in batches:
        for ids, mask in zip(batch["completion_ids"], batch["tool_mask"]):
            ids, mask = ids.tolist(), mask.tolist()
            trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
            masked = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
            assert trained.count("<tool_call>") == 2 and "Done." in trained
            assert "<tool_response>" not in trained and masked.count("<tool_response>") == 2
            assert "Episode finished." in masked and ("[('26',)]" in masked or "[(2,)]" in masked)


def test_max_prompt_tokens_counts_the_prompt_as_trl_renders_it_with_the_tools(tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from tests.support.tiny_model import build_tokenizer, tool_chat_template
    from trajforge.training.grpo import limit_prompts, prompt_tokens

    build_tokenizer(["SELECT Floors FROM x"] * 20, chat_template=tool_chat_template()).save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    row = grpo_env_row(db_task(), "tasks")
    probe = EnvironmentFactory("db")()
    # TRL renders each prompt with its environment's public methods as tools, in name order.
    rendered = len(tokenizer.apply_chat_template(row["prompt"], tools=[probe.execute_sql, probe.submit],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
    from trajforge.training.environments import tool_schemas

    without = prompt_tokens(tokenizer, row["prompt"])
    assert prompt_tokens(tokenizer, row["prompt"], tool_schemas("db")) == rendered > 2 * without
    rows = Dataset.from_list([row])
    assert len(limit_prompts(rows, tokenizer, rendered, with_tools=True)) == 1
    with pytest.raises(ValueError, match="no GRPO row left"):
        limit_prompts(rows, tokenizer, rendered - 1, with_tools=True)
    assert len(limit_prompts(rows, tokenizer, rendered - 1)) == 1  # what the count without the tools let through
