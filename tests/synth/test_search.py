"""Tree search in synthesis: real agent loop, real envs, the real openai client against the loopback server."""
from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.support.paths import FIXTURES
from tests.support.search_policy import LOST_THOUGHT, SeededServer, noisy_policy
from trajforge.flows.cli import _synth_run, parser
from trajforge.flows.config import SYNTH, merge, synth_config
from trajforge.pipeline.build import BuildConfig, finalize, process_unit
from trajforge.pipeline.envs.tasks import load_tasks
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.llm.client import LLMConfig
from trajforge.pipeline.synth.config import AgentConfig, SearchConfig, SynthConfig
from trajforge.pipeline.synth.envs import make_env
from trajforge.pipeline.synth.job import synthesize
from trajforge.pipeline.synth.search import step_pairs, step_values, tree_counts
from trajforge.schemas import first_error
from trajforge.sources import get_source

DB_FILE = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"
TEXTCRAFT = FIXTURES / "tasks" / "agentgym" / "textcraft.jsonl"
BABYAI = FIXTURES / "tasks" / "agentgym" / "babyai.jsonl"
MODEL = "deepseek-ai/DeepSeek-R1"
MAX_TURNS = 6


def _search(server, out: Path, tasks: Path = TEXTCRAFT, env: str = "textcraft", n: int = 4, **search) -> dict:
    search = {"branch": 3, "max_calls": 40, "stop_on_success": False, **search}
    config = SynthConfig(tasks=str(tasks), env=env, out=str(out), n=n,
                         llm=LLMConfig(model=MODEL, base_url=server.base_url, api_key="EMPTY", backoff_base_s=0.01,
                                       max_retries=0, max_connection_failures=0),
                         agent=AgentConfig(seed=7, max_turns=MAX_TURNS), search=SearchConfig(**search))
    return synthesize(config)


def _read(out: Path, name: str, env: str = "textcraft") -> list[dict]:
    return pq.read_table(out / "search" / name / f"{env}.parquet").to_pylist()


def _children(nodes: list[dict]) -> dict[str, list[dict]]:
    kids = defaultdict(list)
    for node in nodes:
        if node["parent_id"]:
            kids[node["parent_id"]].append(node)
    return kids


def _by_task(nodes: list[dict]) -> dict[str, list[dict]]:
    trees = defaultdict(list)
    for node in nodes:
        trees[node["task_id"]].append(node)
    return trees


def _check_counts(nodes: list[dict]) -> None:
    """Every node's visits are its own arrivals plus its children's visits, and match the recount."""
    kids = _children(nodes)
    recount = tree_counts(nodes)
    for node in nodes:
        assert node["visits"] == node["arrivals"] + sum(c["visits"] for c in kids[node["id"]])
        assert node["successes"] == node["arrivals"] * node["success"] + sum(c["successes"] for c in kids[node["id"]])
        assert recount[node["id"]] == (node["visits"], node["successes"])
        assert node["value"] == (node["successes"] / node["visits"] if node["visits"] else None)
        assert node["arrivals"] == 0 or node["terminal"]
        assert node["depth"] <= MAX_TURNS and (node["depth"] < MAX_TURNS or node["terminal"])


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, list[dict]]:
    """The nodes of a textcraft search per strategy, each with a 30% per-step error rate."""
    out = {}
    with SeededServer(noisy_policy(0.3)) as server:
        for strategy in ("best_of_n", "beam", "mcts", "dfsdt"):
            folder = tmp_path_factory.mktemp(strategy)
            _search(server, folder, strategy=strategy)
            out[strategy] = _read(folder, "nodes")
    return out


def test_best_of_n_is_the_prefix_tree_of_n_rollouts(trees):
    for nodes in _by_task(trees["best_of_n"]).values():
        _check_counts(nodes)
        root = next(n for n in nodes if n["parent_id"] is None)
        kids = _children(nodes)
        # N rollouts, each one proposal per state: the proposals at a state are the rollouts through it.
        assert root["visits"] == 4 == sum(c["proposals"] for c in kids[root["id"]])
        for node in nodes:
            if not node["terminal"]:
                assert sum(c["proposals"] for c in kids[node["id"]]) == node["visits"]


def test_beam_keeps_k_states_per_depth_and_proposes_k_at_each(trees):
    for nodes in _by_task(trees["beam"]).values():
        _check_counts(nodes)
        kids = _children(nodes)
        expanded = [n for n in nodes if kids[n["id"]]]
        # A dead beam restarts (from states left out, or the root) until the budget is spent.
        assert sum(n["calls"] for n in nodes) == 40
        # A state gets K proposals each time it is in the beam; only the one being expanded when the
        # budget ran out may have a share of K.
        short = [n for n in expanded if sum(c["proposals"] for c in kids[n["id"]]) % 3]
        assert len(short) <= 1
        # The beam is the top K by estimate (share of proposals): no expanded state ranks below one left out.
        for depth in {n["depth"] for n in expanded}:
            level = [n for n in nodes if n["depth"] == depth + 1 and not n["terminal"]]
            share = {n["id"]: n["proposals"] / 3 for n in level}
            kept = [share[n["id"]] for n in level if kids[n["id"]]]
            left = [share[n["id"]] for n in level if not kids[n["id"]]]
            if kept and left and len(kept) == 3:
                assert min(kept) >= max(left)


def test_mcts_visits_and_branching(trees):
    for nodes in _by_task(trees["mcts"]).values():
        _check_counts(nodes)
        kids = _children(nodes)
        root = next(n for n in nodes if n["parent_id"] is None)
        assert root["visits"] == sum(n["arrivals"] for n in nodes) >= 2
        # Selection and widening go on until the budget is spent; a state has at most
        # max(K, ceil(sqrt(K * visits))) proposals (progressive widening), the root more when nothing below is open.
        assert sum(n["calls"] for n in nodes) == 40
        assert all(sum(c["proposals"] for c in kids[n["id"]]) <= max(3, math.ceil(math.sqrt(3 * n["visits"])))
                   for n in nodes if n["parent_id"])
        assert sum(c["proposals"] for c in kids[root["id"]]) > 3
        # Selection went back into the tree: some state below the root was proposed from more than once.
        assert any(sum(c["proposals"] for c in kids[n["id"]]) > 1 for n in nodes if n["parent_id"])


def test_dfsdt_grows_depth_first(trees):
    for nodes in _by_task(trees["dfsdt"]).values():
        _check_counts(nodes)
        kids = _children(nodes)
        by_id = {n["id"]: n for n in nodes}
        order = sorted(nodes, key=lambda n: n["order"])
        # At most K proposals a state; back at the root, the search proposes again until the budget is spent.
        assert all(sum(c["proposals"] for c in kids[n["id"]]) <= 3 for n in nodes if n["parent_id"])
        assert sum(n["calls"] for n in nodes) == 40
        for previous, node in zip(order, order[1:]):
            # A new state hangs below the last one or below one of its ancestors (a backtrack).
            ancestors, cursor = set(), previous
            while cursor is not None:
                ancestors.add(cursor["id"])
                cursor = by_id.get(cursor["parent_id"]) if cursor["parent_id"] else None
            assert node["parent_id"] in ancestors


@pytest.mark.parametrize("strategy", ["beam", "mcts", "dfsdt"])
def test_a_search_that_never_succeeds_spends_its_whole_budget(tmp_path, strategy):
    """Every proposal fails (error rate 1): the K proposals at each state are spent early, and the
    search goes on (a restarted beam, a widened root, a backtrack to the root) until the budget is."""
    one_task = tmp_path / "one.jsonl"
    one_task.write_text(DB_FILE.read_text().splitlines()[0] + "\n")
    with SeededServer(noisy_policy(1.0, [DB_FILE])) as server:
        report = _search(server, tmp_path, one_task, "db", strategy=strategy, max_calls=12)
        assert server.calls == 12
    nodes = _read(tmp_path, "nodes", "db")
    _check_counts(nodes)
    kids = _children(nodes)
    root = next(n for n in nodes if n["parent_id"] is None)
    assert report["search"]["outcomes"] == {"budget_exhausted": 1} and report["records"] == 0
    assert sum(c["proposals"] for c in kids[root["id"]]) > 3   # the root was asked again


def _conversation(nodes: list[dict], node: dict) -> list[dict]:
    by_id = {n["id"]: n for n in nodes}
    chain = [node]
    while chain[-1]["parent_id"]:
        chain.append(by_id[chain[-1]["parent_id"]])
    return [t for n in reversed(chain) for t in json.loads(n["turns"])]


@pytest.mark.parametrize("strategy", ["beam", "dfsdt"])
def test_every_state_equals_a_fresh_replay_of_its_path(trees, strategy):
    """Nodes reached through restored snapshots show what replaying their actions in a fresh env shows."""
    tasks = {t.id: t for t in load_tasks(TEXTCRAFT)}
    checked = 0
    for node in trees[strategy]:
        turns = _conversation(trees[strategy], node)
        with make_env("textcraft") as env:
            assert env.reset(tasks[node["task_id"]]).strip() in turns[1]["content"]
            for k, turn in enumerate(turns):
                if turn["role"] != "assistant":
                    continue
                step = env.step(turn["action"])
                if k + 1 < len(turns):
                    assert step.observation.strip() == turns[k + 1]["content"]
                    checked += 1
                else:
                    assert step.done and node["terminal"] and node["success"] == bool(step.info.get("success"))
    assert checked > 10


def _state(env) -> object:
    """What an environment's state is, to compare: tables, the level's grid and agent, the inventory."""
    if env.name == "db":
        return list(env._conn.iterdump())
    if env.name == "babyai":
        level = env._env.unwrapped
        return (level.grid.encode().tobytes(), tuple(level.agent_pos), level.agent_dir, str(level.carrying))
    return dict(env._inventory)


@pytest.mark.parametrize("env_name,tasks,prefix,detour,follow", [
    ("db", DB_FILE, ["Action: Operation\n```sql\nDELETE FROM `T` WHERE rowid = 1;\n```"],
     ["Action: Operation\n```sql\nDELETE FROM `T` WHERE rowid = 2;\n```"],
     "Action: Operation\n```sql\nSELECT COUNT(*), MIN(rowid) FROM `T`;\n```"),
    ("textcraft", TEXTCRAFT, ["Action:\nget 4 rabbit hide"], ["Action:\nget 2 rabbit hide"], "Action:\ninventory"),
    ("babyai", BABYAI, ["Action:\nturn left", "Action:\nturn left"], ["Action:\nturn right"], "Action:\nturn left"),
])
def test_restored_state_equals_the_state_the_prefix_leads_to(env_name, tasks, prefix, detour, follow):
    task = next(t for t in load_tasks(tasks) if t.env == env_name)
    if env_name == "db":
        table = task.data["tables"][0]["name"]
        prefix, detour, follow = ([p.replace("`T`", f"`{table}`") for p in actions] for actions in
                                  (prefix, detour, [follow]))
        follow = follow[0]
    with make_env(env_name) as fresh, make_env(env_name) as branched:
        fresh.reset(task)
        for action in prefix:
            fresh.step(action)
        branched.reset(task)
        for action in prefix:
            branched.step(action)
        snapshot = branched.snapshot()
        for action in detour:
            branched.step(action)
        assert _state(branched) != _state(fresh)      # the detour changed the state...
        branched.restore(snapshot)
        expected = _state(fresh)
        assert _state(branched) == expected           # ...and restoring went back to the prefix's state
        assert branched.step(follow).observation == fresh.step(follow).observation
        for action in detour:                         # a snapshot restores more than once
            branched.step(action)
        branched.restore(snapshot)
        assert _state(branched) == expected


def _row(task: str, order: int, parent: int | None, action: str | None, *, terminal=False, success=False,
         arrivals=0) -> dict:
    turns = ([{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}] if parent is None else
             [{"role": "assistant", "content": f"Action: {action}", "action": action}]
             + ([] if terminal else [{"role": "user", "content": f"after {action}"}]))
    return {"id": f"{task}#{order}", "task_id": task, "env": "db", "model": "m", "strategy": "mcts",
            "parent_id": None if parent is None else f"{task}#{parent}", "depth": 0, "order": order,
            "turns": json.dumps(turns), "action": action, "terminal": terminal, "success": success,
            "arrivals": arrivals}


def test_step_values_and_pairs_on_a_hand_made_tree():
    # root -> a -> {s: success reached twice, f: failure once}; root -> b -> g: failure once.
    rows = [_row("t", 0, None, None), _row("t", 1, 0, "a"), _row("t", 2, 0, "b"),
            _row("t", 3, 1, "s", terminal=True, success=True, arrivals=2), _row("t", 4, 1, "f", terminal=True, arrivals=1),
            _row("t", 5, 2, "g", terminal=True, arrivals=1), _row("t", 6, 2, "h")]  # h: never rolled out
    values = {v["id"]: (v["value"], v["visits"]) for v in step_values(rows)}
    assert values == {"t#1": (2 / 3, 3), "t#2": (0.0, 1), "t#3": (1.0, 2), "t#4": (0.0, 1), "t#5": (0.0, 1)}
    pairs = {(p["prefix_id"], p["chosen_id"], p["rejected_id"]): p for p in step_pairs(rows)}
    assert set(pairs) == {("t#0", "t#1", "t#2"), ("t#1", "t#3", "t#4")}
    pair = pairs[("t#1", "t#3", "t#4")]
    assert pair["prompt"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"},
                              {"role": "assistant", "content": "Action: a"}, {"role": "user", "content": "after a"}]
    assert (pair["chosen"], pair["rejected"]) == ([{"role": "assistant", "content": "Action: s"}],
                                                   [{"role": "assistant", "content": "Action: f"}])
    assert pair["chosen_value"] == 1.0 and pair["rejected_value"] == 0.0


def test_search_outputs_pairs_values_and_best_records(tmp_path):
    with SeededServer(noisy_policy(0.3, [DB_FILE])) as server:
        report = _search(server, tmp_path, DB_FILE, "db", strategy="mcts", max_calls=12)
    nodes, values, pairs = (_read(tmp_path, name, "db") for name in ("nodes", "step_values", "step_pairs"))
    for name, rows in (("search_nodes", nodes), ("step_values", values), ("step_pairs", pairs)):
        assert rows and all(first_error(name, row) is None for row in rows)
    by_id = {n["id"]: n for n in nodes}
    for value in values:
        node = by_id[value["id"]]
        assert (value["value"], value["visits"]) == (node["value"], node["visits"]) and node["visits"] >= 1
    for pair in pairs:
        prefix, chosen, rejected = by_id[pair["prefix_id"]], by_id[pair["chosen_id"]], by_id[pair["rejected_id"]]
        assert chosen["parent_id"] == rejected["parent_id"] == prefix["id"]
        assert chosen["successes"] > 0 and rejected["visits"] > 0 and rejected["successes"] == 0
        assert len(pair["prompt"]) >= 1 and pair["chosen"] != pair["rejected"]
    records = pq.read_table(tmp_path / "data" / "synthetic" / "db.parquet").to_pylist()
    failures = pq.read_table(tmp_path / "failures.parquet").to_pylist()
    # Every task ends in one record or one failure row.
    assert len(records) + len(failures) == report["tasks"] == len({n["task_id"] for n in nodes})
    for record in records:
        assert validate_record(record) is None
        meta = json.loads(record["meta"])["search"]
        path = meta["path"]
        assert meta["strategy"] == "mcts" and by_id[path[-1]["node"]]["success"]
        assert [p["visits"] for p in path] == sorted((p["visits"] for p in path), reverse=True)
        assert meta["nodes"] == sum(n["task_id"] == by_id[path[0]["node"]]["task_id"] for n in nodes)


def test_a_budget_is_never_exceeded(tmp_path):
    with SeededServer(noisy_policy(0.4, [DB_FILE])) as server:
        report = _search(server, tmp_path, TEXTCRAFT, strategy="dfsdt", max_calls=7)
        calls = server.calls
    nodes = _read(tmp_path, "nodes")
    per_task = Counter()
    for node in nodes:
        per_task[node["task_id"]] += node["calls"]
    assert max(per_task.values()) == 7 and report["search"]["max_calls_per_task"] == 7
    assert calls == report["search"]["calls"] == sum(per_task.values()) <= 7 * report["tasks"]

    # Tokens: each request asks for no more than what is left, and none is sent once all is spent.
    one_task = tmp_path / "one.jsonl"
    one_task.write_text(TEXTCRAFT.read_text().splitlines()[1] + "\n")
    with TokenCountingServer(noisy_policy(0.4)) as server:
        _search(server, tmp_path / "tokens", one_task, strategy="beam", max_calls=None, max_tokens=60)
    asked = [r["max_tokens"] for r in server.requests]
    assert len(asked) >= 3
    for k, limit in enumerate(asked):
        assert limit == 60 - sum(server.answered_tokens[:k]) > 0
    assert sum(server.answered_tokens) >= 60


class TokenCountingServer(SeededServer):
    def completion(self, body: dict, kind: str | None = None) -> dict:
        out = super().completion(body, kind)
        self.__dict__.setdefault("answered_tokens", []).append(out["usage"]["completion_tokens"])
        return out


def test_a_killed_search_resumes_without_repeating_calls(tmp_path):
    def answered(server) -> list[str]:
        return [json.dumps([r["messages"], r.get("seed")], sort_keys=True)
                for k, r in enumerate(server.requests, 1) if k not in server.cut]

    with SeededServer(noisy_policy(0.3, [DB_FILE])) as whole:
        whole.cut = set()
        _search(whole, tmp_path / "whole", TEXTCRAFT, strategy="mcts", max_calls=20)
    # The same search, its connection cut at the 15th request: the searches in flight stop as transient.
    with SeededServer(noisy_policy(0.3, [DB_FILE])) as first:
        first.cut = set()
        first.fault = lambda number, _body: (first.cut.add(number) or "reset") if number >= 15 else None
        report = _search(first, tmp_path / "run", TEXTCRAFT, strategy="mcts", max_calls=20)
        before = answered(first)
    assert report["search"]["outcomes"].get("llm_error:connection") and len(before) == 14
    with SeededServer(noisy_policy(0.3, [DB_FILE])) as second:
        second.cut = set()
        _search(second, tmp_path / "run", TEXTCRAFT, strategy="mcts", max_calls=20)
        after = answered(second)
    assert not set(before) & set(after)               # nothing asked twice
    assert sorted(before + after) == sorted(answered(whole))
    keep = ("id", "parent_id", "action", "visits", "successes", "calls", "terminal", "success")
    assert ([{k: n[k] for k in keep} for n in _read(tmp_path / "run", "nodes")]
            == [{k: n[k] for k in keep} for n in _read(tmp_path / "whole", "nodes")])
    with SeededServer(noisy_policy(0.3, [DB_FILE])) as third:  # finished searches come from the journal
        report = _search(third, tmp_path / "run", TEXTCRAFT, strategy="mcts", max_calls=20)
        assert third.calls == 0 and report["search"]["searches_resumed"] == report["tasks"]


def test_beam_with_the_judge_as_value_model(tmp_path):
    with SeededServer(noisy_policy(0.3)) as server:
        _search(server, tmp_path, TEXTCRAFT, strategy="beam", value_model="judge", max_calls=60)
        judged = sum("rate how likely" in r["messages"][0]["content"] for r in server.requests)
    nodes = _read(tmp_path, "nodes")
    scored = [n for n in nodes if n["estimate"] is not None]
    assert judged == len(scored) > 0
    for node in scored:  # the judge knows a lost state
        lost = any(LOST_THOUGHT in t["content"] for t in _conversation(nodes, node) if t["role"] == "assistant")
        assert node["estimate"] == (0.0 if lost else 0.9)
    kids = _children(nodes)
    for depth in {n["depth"] for n in nodes if kids[n["id"]] and n["depth"]}:
        expanded = [n["estimate"] for n in nodes if n["depth"] == depth and kids[n["id"]]]
        skipped = [n["estimate"] for n in nodes if n["depth"] == depth and not kids[n["id"]] and n["estimate"] is not None]
        assert not skipped or min(expanded) >= max(skipped)


def test_search_flags_reach_the_config(tmp_path):
    tasks = tmp_path / "t.jsonl"  # the CLI checks the task file exists before anything starts
    tasks.write_text(DB_FILE.read_text().splitlines(keepends=True)[0])
    args = parser().parse_args(["synth", "--tasks", str(tasks), "--env", "db", "--model", MODEL, "--out",
                                      str(tmp_path), "--search", "beam", "--branch", "2", "--max-calls", "9",
                                      "--max-task-tokens", "500", "--value-model", "judge"])
    config, _, given = _synth_run(args)
    job = synth_config(merge(config, SYNTH.nested(given)), "options")
    assert job.search == SearchConfig(strategy="beam", branch=2, max_calls=9, max_tokens=500, value_model="judge")
    with pytest.raises(SystemExit):
        parser().parse_args(["synth", "--search", "greedy"])
    with pytest.raises(ValueError, match="until its budget is spent"):  # a tree search with no end
        SearchConfig(strategy="mcts", max_calls=None)


def test_a_build_over_a_search_writes_step_pairs_and_values(tmp_path):
    """A search against the loopback server, then a build with its folder as the synthetic source:
    step_pairs and step_values are configs, schema-valid, each row's task has its trajectory in sft,
    and the rows of tasks whose trajectory the build dropped are counted by the reason."""
    synth = tmp_path / "synth"
    with SeededServer(noisy_policy(0.4, [DB_FILE])) as server:
        _search(server, synth, DB_FILE, "db", strategy="mcts", max_calls=8)
    records_file = synth / "data" / "synthetic" / "db.parquet"
    records = pq.read_table(records_file).to_pylist()
    read = {name: _read(synth, name, "db") for name in ("step_pairs", "step_values")}
    task_of = {r["id"]: json.loads(r["meta"])["task_id"] for r in records}
    assert len(records) >= 3 and read["step_pairs"]
    # One trajectory is an evaluation task (contaminated), one breaks the schema (quarantined).
    contaminated, broken = records[0], records[1]
    (tmp_path / "eval.txt").write_text(contaminated["task"] + "\n")
    records[1] = dict(broken, conversations=[])
    pq.write_table(pa.Table.from_pylist(records, schema=pq.read_schema(records_file)), records_file)

    # The search ran on DBBench dev tasks, which the declared eval split holds out of every build by
    # default; this test plants its own eval task instead, so the declared splits are off here.
    config = BuildConfig(decontaminate=str(tmp_path / "eval.txt"), decontaminate_splits=False)
    units = [process_unit("synthetic", f, tmp_path / "staging", config) for f in get_source("synthetic").files(str(synth))]
    (reason,) = units[0].reasons
    out = tmp_path / "build"
    report = finalize(units, out, config)

    sft_tasks = {json.loads(r["meta"])["task_id"] for r in pq.read_table(out / "data" / "sft").to_pylist()}
    assert task_of[contaminated["id"]] not in sft_tasks and task_of[broken["id"]] not in sft_tasks
    for name, rows in read.items():
        written = pq.read_table(out / "data" / name).to_pylist()
        assert written and all(first_error(name, row) is None for row in written)
        assert {row["task_id"] for row in written} <= sft_tasks
        expected = Counter("contaminated" if row["task_id"] == task_of[contaminated["id"]] else
                           reason if row["task_id"] == task_of[broken["id"]] else
                           None if row["task_id"] in sft_tasks else "no_trajectory" for row in rows)
        counts = report["search_steps"][name]
        assert counts == {"read": len(rows), "written": expected.pop(None), "dropped": dict(sorted(expected.items()))}
        assert counts["written"] == len(written)
        assert report["outputs"][name] == [f"data/{name}/train-00000-of-00001.parquet"]
    assert set(report["search_steps"]["step_values"]["dropped"]) == {"contaminated", reason, "no_trajectory"}

    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert {"step_pairs", "step_values"} <= {c["config_name"] for c in front["configs"]}
    assert "## Step-level data" in card and "Step-level data" in (out / "report.html").read_text()
    for name in ("step_pairs", "step_values"):
        counts = report["search_steps"][name]
        assert f"| {name} | {counts['read']} | {counts['written']} |" in card
