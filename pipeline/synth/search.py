"""Tree search in synthesis: `trajforge synth --search best_of_n | beam | mcts | dfsdt`.

Best-of-N runs N independent episodes and throws away where they diverged. Here a task's episodes
grow one tree: at a state (the conversation so far, and the environment's state) the model
proposes candidate next steps, each a request with its own sample index (so the request cache
keys differ); identical actions reach the same state and are one child (`proposals` counts them).
A proposal is one turn of the agent loop, `agent.run_episode` with the path so far as its prefix
and one turn to go: the same prompt, reply parsing, re-prompts, redaction, scoring and record as
every synthesized episode. The prefix is replayed as salvage replays it; an environment that can
snapshot its state (`db`, `babyai`, `textcraft`: `snapshot()` / `restore(state)`) answers the
replay from `StateMemo`, so a step is taken once per tree, and a child branches from its
parent's restored state; any other environment replays the prefix for real, in a fresh instance.

Strategies (K = `branch`):

    best_of_n   N rollouts from the root (N = the job's `n`), one proposal per state.
    beam        level by level: K proposals at each state of the beam, the best K new states
                by value estimate (the value model's score, else the share of the K proposals
                that chose the step) form the next beam. When every proposal of a level ended the
                episode, the beam restarts from the best states left out of earlier beams (of the
                deepest level that has any), else from the root.
    mcts        UCT selection over the success fraction of visited children, expansion of one
                proposal at a state with fewer proposals than its width (K, growing as
                sqrt(K * visits): progressive widening), a rollout from it to a leaf, backup. A
                state whose children all ended and that may not widen yet is closed; the root
                always widens when nothing below it is open.
    dfsdt       depth first (ToolBench's DFSDT): descend into each new state, back up and propose
                another step (at most K per state) when every rollout below failed; back at the
                root, propose again.

Beam, MCTS and DFSDT so spend their whole budget (a task's search needs `max_calls` or
`max_tokens`), as best-of-N does with its N rollouts.

Values come from the environment's score at the leaves: every rollout that reaches a terminal
state adds a visit, and a success when it succeeded, to every node on its path, so a node's
`value` is the Monte Carlo estimate of success from it (`tree_counts` recomputes them from the
leaves). Each task's search stops at its first success (`stop_on_success`), after best-of-N's N
rollouts, or when its budget is spent: `max_calls` requests and `max_tokens` completion tokens per task
(`TaskBudget`; each request asks for at most the tokens left).

Outputs, beside the plain job's (DIR/data/synthetic/<env>.parquet: the best trajectory per task, with
`meta.search`; DIR/failures.parquet: one row per task without a success; DIR/report.json):

    DIR/search/nodes/<env>.parquet        every node of every tree (schemas/search_nodes.schema.json)
    DIR/search/step_values/<env>.parquet  per assistant turn: Monte Carlo value and visits (step_values)
    DIR/search/step_pairs/<env>.parquet   at a shared prefix, a step that leads to success vs one whose
                                          rollouts all failed, TRL DPO conversational (step_pairs)

A build given DIR as its `synthetic` source writes the last two as configs (pipeline/quality/search_steps.py).

Resuming: a finished task's tree is journaled (DIR/.synth/searches.sqlite). A search cut short is
run again; the search is deterministic given the replies, and the budget counts answers from the
cache too, so the rerun takes the same path, every call it already made answered by the request
cache, and stops where an uninterrupted run would have.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from trajforge.pipeline.atomic import write_parquet
from trajforge.pipeline.envs import spec
from trajforge.pipeline.llm.client import ChatBackend, ChatResult, LLMError, sampling_params
from trajforge.pipeline.llm.job import ModelJob
from trajforge.pipeline.llm.reasoning import split_reasoning
from trajforge.pipeline.synth.agent import Episode, conversation_for, run_episode
from trajforge.pipeline.synth.config import AgentConfig, SearchConfig, SynthConfig
from trajforge.pipeline.synth.envs import make_env
from trajforge.pipeline.synth.envs.base import ClosingEnvironment, StepResult
from trajforge.pipeline.synth.folder import episode_key, failure_row, job_tasks, open_job, write_outputs
from trajforge.schemas import arrow_schema
from trajforge.sources.synthetic import Synthetic

log = logging.getLogger("trajforge.search")
SYNTHETIC = Synthetic()
OUTPUTS = ("nodes", "step_values", "step_pairs")
SCHEMAS = {"nodes": "search_nodes", "step_values": "step_values", "step_pairs": "step_pairs"}


# --- budget and environment state ---------------------------------------------------------------
class TaskBudget:
    """A ChatBackend that lets one task's search make at most `max_calls` requests and receive at
    most `max_tokens` completion tokens, then raises LLMError("budget_exhausted").

    Unlike salvage's CallBudget, an answer from the cache is spent too: the budget bounds the tree,
    so that a rerun grows the very same tree from the cache and stops where the first run would have.
    """

    def __init__(self, backend: ChatBackend, max_calls: int | None, max_tokens: int | None):
        self.backend = backend
        self.max_calls = max_calls
        self.max_tokens = max_tokens
        self.calls = 0
        self.usage: Counter[str] = Counter()  # of every answer, cached or not

    @property
    def tokens(self) -> int:
        return self.usage["completion_tokens"]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    async def chat(self, messages: list[dict], sample: int = 0, **overrides: Any) -> ChatResult:
        if self.max_calls is not None and self.calls >= self.max_calls:
            raise LLMError("budget_exhausted", f"the task's budget of {self.max_calls} calls is spent")
        if self.max_tokens is not None:
            left = self.max_tokens - self.tokens
            if left <= 0:
                raise LLMError("budget_exhausted", f"the task's budget of {self.max_tokens} tokens is spent")
            overrides["max_tokens"] = min(overrides.get("max_tokens") or left, left)
        self.calls += 1  # a call that fails was still sent: it stays spent
        result = await self.backend.chat(messages, sample=sample, **overrides)
        self.usage.update(result.usage)
        return result


class StateMemo:
    """Every state a task's search reached, by its action path: the step's result and the env's
    snapshot after it. `env()` is an environment for one proposal whose replayed steps come from
    here; a new step restores its parent's snapshot in a live instance and is taken for real."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make
        self.states: dict[tuple[str, ...], tuple[Any, Any]] = {}

    def env(self) -> MemoEnv:
        return MemoEnv(self)


class MemoEnv(ClosingEnvironment):
    def __init__(self, memo: StateMemo):
        self.memo = memo
        self.inner: Any = None
        self.path: tuple[str, ...] = ()
        self.live: tuple[str, ...] | None = None  # the path the inner env is at

    def reset(self, task: Any) -> str:
        self.path = ()
        if () not in self.memo.states:
            self.inner = self.memo.make()
            observation = self.inner.reset(task)
            self.memo.states[()] = (observation, self.inner.snapshot())
            self.live = ()
        return self.memo.states[()][0]

    def step(self, action: str) -> StepResult:
        key = self.path + (action,)
        if key not in self.memo.states:
            if self.live != self.path:
                if self.inner is None:
                    self.inner = self.memo.make()
                self.inner.restore(self.memo.states[self.path][1])
            result = self.inner.step(action)
            self.memo.states[key] = (result, None if result.done else self.inner.snapshot())
            self.live = key
        self.path = key
        return self.memo.states[key][0]

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
            self.inner = None


# --- the value model --------------------------------------------------------------------------
class ValueModel(Protocol):
    async def score(self, backend: ChatBackend, turns: list[dict], sample: int) -> float | None:
        """The chance of success from the state `turns` end in (0-1), or None when it has no answer."""


JUDGE_PROMPT = (
    "You judge an agent's unfinished attempt at a task. Read the task and the steps so far, then rate how likely "
    "the agent is to complete the task correctly from here, from 0 (certainly not) to 10 (certainly). Reply with "
    "the number only.")
_RATING = re.compile(r"\b(10|[0-9])\b")


class JudgeValueModel:
    """The model itself as judge (LLM-as-judge): a rating 0-10 of the transcript, scaled to 0-1."""

    async def score(self, backend: ChatBackend, turns: list[dict], sample: int) -> float | None:
        transcript = "\n\n".join(f"{'Agent' if t['role'] == 'assistant' else 'Environment'}: {t['content']}"
                                 for t in turns if t["role"] != "system")
        result = await backend.chat([{"role": "system", "content": JUDGE_PROMPT},
                                     {"role": "user", "content": transcript}], sample=sample)
        choice = result.choices[0]
        split = split_reasoning(choice.content, choice.reasoning_content)
        # A reasoning model may leave the number at the end of its reasoning, with no answer after it.
        ratings = _RATING.findall(split.content.strip() or split.reasoning or "")
        return int(ratings[-1]) / 10 if ratings else None


VALUE_MODELS: dict[str, Callable[[], ValueModel]] = {"judge": JudgeValueModel}


# --- the tree ---------------------------------------------------------------------------------
@dataclass(eq=False)
class Node:
    order: int
    parent: int | None
    depth: int
    sample: int | None
    turns: list[dict]                  # the turns this node adds to its parent's conversation
    terminal: bool = False
    success: bool = False
    reward: float | None = None
    reason: str | None = None
    proposals: int = 1
    arrivals: int = 0
    visits: int = 0
    successes: int = 0
    estimate: float | None = None
    calls: int = 0
    completion_tokens: int = 0
    children: list[int] = field(default_factory=list)
    expansions: int = 0                # proposals made at this node
    exhausted: bool = False            # nothing left to try below (mcts, dfsdt)

    @property
    def action(self) -> str | None:
        return self.turns[0].get("action") if self.turns and self.turns[0]["role"] == "assistant" else None


class Stop(Exception):
    """The task's search ends early: `reason` budget_exhausted, or a transient episode failure."""

    def __init__(self, reason: str, detail: str = "", transient: bool = False):
        super().__init__(reason)
        self.reason, self.detail, self.transient = reason, detail, transient


class TaskSearch:
    """One task's search tree and the strategies that grow it."""

    def __init__(self, task: Any, backend: TaskBudget, make: Callable[[], Any], agent: AgentConfig,
                 search: SearchConfig, n: int, value_model: ValueModel | None = None):
        self.task, self.backend, self.make, self.agent, self.search, self.n = task, backend, make, agent, search, n
        self.value_model = value_model
        self.nodes: list[Node] = []
        self.records: dict[int, dict] = {}   # success node -> its record
        self.next_sample = 0

    # the tree
    def path(self, node: Node) -> list[Node]:
        out = [node]
        while out[-1].parent is not None:
            out.append(self.nodes[out[-1].parent])
        return out[::-1]

    def conversation(self, node: Node) -> list[dict]:
        return [t for n in self.path(node) for t in n.turns]

    def _add(self, node: Node) -> Node:
        self.nodes.append(node)
        if node.parent is not None:
            self.nodes[node.parent].children.append(node.order)
        return node

    def arrive(self, leaf: Node) -> None:
        """A rollout ended at `leaf`: a visit (and a success) for every node on its path."""
        leaf.arrivals += 1
        for node in self.path(leaf):
            node.visits += 1
            node.successes += leaf.success

    # one proposal
    async def root(self) -> Node:
        episode = await self._episode(None)
        return self._add(Node(0, None, 0, None, episode.turns[:2]))

    async def _episode(self, node: Node | None) -> Episode:
        """Run the agent loop from `node`'s state for one turn (from nothing: reset only)."""
        prefix = [t for t in self.conversation(node) if t["role"] == "assistant"] if node else []
        sample = self.next_sample
        self.next_sample += 1
        agent = replace(self.agent, max_turns=len(prefix) + (node is not None))
        episode = await run_episode(self.backend, self.make, self.task, sample, agent, prefix=prefix)
        episode.sample = sample
        if episode.reason == "llm_error:budget_exhausted":
            raise Stop("budget_exhausted", episode.detail)
        if episode.transient or episode.reason == "prefix_ended":
            raise Stop(episode.reason or "", episode.detail, transient=True)
        return episode

    async def propose(self, node: Node) -> Node:
        """One proposal of a next step at `node`: its child (an existing one for an action proposed before)."""
        calls, tokens = self.backend.calls, self.backend.tokens
        episode = await self._episode(node)
        node.expansions += 1
        added = episode.turns[len(self.conversation(node)):]
        action = added[0].get("action") if added else None
        same = next((self.nodes[c] for c in node.children if action and self.nodes[c].action == action), None)
        if same is not None:
            same.proposals += 1
            same.calls += self.backend.calls - calls
            same.completion_tokens += self.backend.tokens - tokens
            return same
        ended = episode.reason != "max_turns" or node.depth + 1 >= self.agent.max_turns
        child = self._add(Node(len(self.nodes), node.order, node.depth + 1, episode.sample, added, terminal=ended,
                               success=episode.status == "success", reward=episode.reward,
                               reason=episode.reason if ended else None, calls=self.backend.calls - calls,
                               completion_tokens=self.backend.tokens - tokens))
        if episode.record is not None:
            self.records[child.order] = episode.record
        return child

    async def rollout(self, node: Node) -> Node:
        while not node.terminal:
            node = await self.propose(node)
        self.arrive(node)
        return node

    async def estimate(self, node: Node) -> float:
        """The value model's score of `node`, else the share of its parent's proposals that chose it."""
        if self.value_model is not None and node.estimate is None:
            sample = self.next_sample
            self.next_sample += 1
            try:
                node.estimate = await self.value_model.score(self.backend, self.conversation(node), sample)
            except LLMError as exc:
                raise Stop(exc.reason if exc.reason == "budget_exhausted" else f"llm_error:{exc.reason}",
                           self.backend.redact(exc.detail), transient=exc.reason != "budget_exhausted") from None
        if node.estimate is not None:
            return node.estimate
        return node.proposals / max(1, self.nodes[node.parent].expansions)

    # the strategies
    async def best_of_n(self, root: Node) -> None:
        for _ in range(self.n):
            leaf = await self.rollout(root)
            if leaf.success and self.search.stop_on_success:
                return

    async def beam(self, root: Node) -> None:
        beam = [root]
        while True:
            children: list[Node] = []
            for node in beam:
                for _ in range(self.search.branch):
                    child = await self.propose(node)
                    if child.terminal:
                        self.arrive(child)
                        if child.success and self.search.stop_on_success:
                            return
                    elif child not in children:
                        children.append(child)
            if not children:  # the beam died: every proposal ended the episode
                beam = await self._survivors() or [root]
                continue
            beam = await self._best(children)

    async def _best(self, nodes: list[Node]) -> list[Node]:
        """The top K of `nodes` by value estimate (ties: the first made)."""
        scores = [await self.estimate(n) for n in nodes]
        ranked = sorted(range(len(nodes)), key=lambda i: (-scores[i], nodes[i].order))
        return [nodes[i] for i in ranked[:self.search.branch]]

    async def _survivors(self) -> list[Node]:
        """Where a dead beam restarts: the best open states left out of earlier beams, of the deepest
        level that has any (the longest prefixes not yet tried); none when every state was tried."""
        left = [n for n in self.nodes if not n.terminal and not n.expansions]
        deepest = max((n.depth for n in left), default=None)
        return await self._best([n for n in left if n.depth == deepest])

    async def mcts(self, root: Node) -> None:
        while True:
            node = root
            while True:
                open_ = [self.nodes[c] for c in node.children if not (self.nodes[c].terminal or self.nodes[c].exhausted)]
                if node.expansions < self._width(node) or (node is root and not open_):
                    leaf = await self.rollout(await self.propose(node))
                    break
                if not open_:  # every child ended or is closed, and the node may not widen yet
                    node.exhausted = True
                    node = root
                    continue
                node = max(open_, key=lambda c: (self._uct(node, c), -c.order))
            if leaf.success and self.search.stop_on_success:
                return

    def _width(self, node: Node) -> int:
        """Progressive widening: the proposals a node may have, K at first, growing as sqrt(K * visits)."""
        return max(self.search.branch, math.ceil(math.sqrt(self.search.branch * node.visits)))

    def _uct(self, parent: Node, child: Node) -> float:
        if not child.visits:
            return math.inf
        return child.successes / child.visits + self.search.uct_c * math.sqrt(math.log(parent.visits) / child.visits)

    async def dfsdt(self, node: Node) -> bool:
        """Depth first from `node`; True once a success was found (and the search should stop). A
        state gets K proposals, then the search backtracks; the root keeps proposing while budget lasts."""
        while node.parent is None or node.expansions < self.search.branch:
            child = await self.propose(node)
            if child.terminal:
                self.arrive(child)
                if child.success and self.search.stop_on_success:
                    return True
            elif not child.exhausted and await self.dfsdt(child):
                return True
        node.exhausted = True
        return False

    async def run(self) -> dict:
        """Grow the tree; the result (JSON) says how the search ended."""
        outcome, detail, transient = "done", "", False
        try:
            root = await self.root()
            await getattr(self, self.search.strategy)(root)
        except Stop as stop:
            outcome, detail, transient = stop.reason, stop.detail, stop.transient
        if not transient and any(n.success for n in self.nodes):
            outcome = "solved"
        # A search cut short by a transient error is run again (not journaled), even with a success in it.
        return {"task_id": self.task.id, "outcome": outcome, "detail": detail,
                "transient": transient, "calls": self.backend.calls, "tokens": self.backend.tokens,
                "usage": dict(self.backend.usage),
                "nodes": [asdict(n) for n in self.nodes], "records": {str(k): v for k, v in self.records.items()}}


# --- rows -------------------------------------------------------------------------------------
def node_rows(result: dict, env: str, model: str, strategy: str) -> list[dict]:
    """The search_nodes rows of one task's tree."""
    task_id = result["task_id"]
    rows = []
    for n in result["nodes"]:
        action = n["turns"][0].get("action") if n["turns"] and n["turns"][0]["role"] == "assistant" else None
        rows.append({"id": f"{task_id}#{n['order']}", "task_id": task_id, "env": env, "model": model,
                     "strategy": strategy, "parent_id": None if n["parent"] is None else f"{task_id}#{n['parent']}",
                     "depth": n["depth"], "order": n["order"], "sample": n["sample"],
                     "turns": json.dumps(n["turns"], ensure_ascii=False), "action": action, "terminal": n["terminal"],
                     "success": n["success"], "reward": n["reward"], "reason": n["reason"], "proposals": n["proposals"],
                     "arrivals": n["arrivals"], "visits": n["visits"], "successes": n["successes"],
                     "value": n["successes"] / n["visits"] if n["visits"] else None, "estimate": n["estimate"],
                     "calls": n["calls"], "completion_tokens": n["completion_tokens"]})
    return rows


def tree_counts(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """(visits, successes) of every node, recomputed from the leaves' arrivals along the parent ids."""
    by_id = {r["id"]: r for r in rows}
    counts = {r["id"]: [0, 0] for r in rows}
    for row in rows:
        if not row["arrivals"]:
            continue
        node: dict | None = row
        while node is not None:
            counts[node["id"]][0] += row["arrivals"]
            counts[node["id"]][1] += row["arrivals"] * row["success"]
            node = by_id.get(node["parent_id"]) if node["parent_id"] else None
    return {k: (v, s) for k, (v, s) in counts.items()}


def _messages(model: str, turns: list[dict]) -> list[dict]:
    """Turns as TRL messages, as the model saw them (R1: the system turn folded into the first user turn)."""
    return [{"role": t["role"], "content": t["content"]} for t in conversation_for(model, turns)]


def _paths(rows: list[dict]) -> tuple[dict[str, dict], Callable[[dict], list[dict]]]:
    by_id = {r["id"]: r for r in rows}

    def conversation(row: dict) -> list[dict]:
        chain = [row]
        while chain[-1]["parent_id"]:
            chain.append(by_id[chain[-1]["parent_id"]])
        return [t for r in reversed(chain) for t in json.loads(r["turns"])]
    return by_id, conversation


def step_values(rows: list[dict]) -> list[dict]:
    """A process-reward row for every assistant turn of the tree that a rollout went through."""
    counts = tree_counts(rows)
    by_id, conversation = _paths(rows)
    out = []
    for row in rows:
        visits, successes = counts[row["id"]]
        if row["action"] is None or not visits:
            continue
        turns = conversation(by_id[row["parent_id"]])
        messages = _messages(row["model"], turns + [json.loads(row["turns"])[0]])
        out.append({"id": row["id"], "task_id": row["task_id"], "env": row["env"], "source": SYNTHETIC.name,
                    "domain": SYNTHETIC.domain_of(row["env"]), "depth": row["depth"], "prompt": messages[:-1],
                    "completion": messages[-1:], "value": successes / visits, "visits": visits,
                    "successes": successes})
    return out


def step_pairs(rows: list[dict]) -> list[dict]:
    """At every node with a child some rollout succeeded from and a child all rollouts failed from,
    one pair per such (success, failure) couple of children, the node's conversation as the prompt."""
    counts = tree_counts(rows)
    by_id, conversation = _paths(rows)
    children: dict[str, list[dict]] = {}
    for row in rows:
        if row["parent_id"] and row["action"] is not None and counts[row["id"]][0]:
            children.setdefault(row["parent_id"], []).append(row)
    out = []
    for prefix_id, kids in children.items():
        good = [k for k in kids if counts[k["id"]][1]]
        bad = [k for k in kids if not counts[k["id"]][1]]
        if not (good and bad):
            continue
        prompt = _messages(kids[0]["model"], conversation(by_id[prefix_id]))
        for chosen in good:
            for rejected in bad:
                out.append({"id": f"{chosen['id']}>{rejected['id']}", "task_id": chosen["task_id"],
                            "env": chosen["env"], "source": SYNTHETIC.name, "domain": SYNTHETIC.domain_of(chosen["env"]),
                            "prefix_id": prefix_id, "chosen_id": chosen["id"], "rejected_id": rejected["id"],
                            "chosen_value": counts[chosen["id"]][1] / counts[chosen["id"]][0], "rejected_value": 0.0,
                            "prompt": prompt, "chosen": [_assistant(chosen)], "rejected": [_assistant(rejected)]})
    return out


def _assistant(row: dict) -> dict:
    return {"role": "assistant", "content": json.loads(row["turns"])[0]["content"]}


def best_record(result: dict, rows: list[dict], strategy: str) -> dict | None:
    """The task's best success (highest reward, then fewest turns, then first found), with `meta.search`."""
    if not result["records"]:
        return None
    by_order = {r["order"]: r for r in rows}
    order = min(result["records"], key=lambda k: (-(by_order[int(k)]["reward"] or 0.0), by_order[int(k)]["depth"], int(k)))
    record = dict(result["records"][order])
    by_id = {r["id"]: r for r in rows}
    path, node = [], by_order[int(order)]
    while node is not None:
        path.append({"node": node["id"], "value": node["value"], "visits": node["visits"]})
        node = by_id.get(node["parent_id"]) if node["parent_id"] else None
    meta = json.loads(record["meta"])
    meta["search"] = {"strategy": strategy, "nodes": len(rows), "leaves": sum(r["terminal"] for r in rows),
                      "rollouts": sum(r["arrivals"] for r in rows), "calls": result["calls"],
                      "completion_tokens": result["tokens"], "path": path[::-1]}
    record["meta"] = json.dumps(meta, sort_keys=True, ensure_ascii=False)
    return record


def _unsolved_row(result: dict, rows: list[dict], task: Any, model: str) -> dict:
    """The failures.parquet row of a task without a success: the conversation of its most visited leaf."""
    leaves = [r for r in rows if r["terminal"]] or rows
    leaf = max(leaves, key=lambda r: (r["arrivals"], r["depth"], -r["order"])) if leaves else None
    _, conversation = _paths(rows)
    reason = result["outcome"] if result["outcome"] != "done" else "search_no_success"
    episode = Episode(task.id, 0, task.env, "failure", reason, result["detail"] or (leaf or {}).get("reason") or "",
                      turns=conversation(leaf) if leaf else [])
    return failure_row(episode, model) | {"id": f"synthetic/{task.id}#search"}


# --- the job ----------------------------------------------------------------------------------
async def search_async(config: SynthConfig, progress: Callable[[int, int], None] | None = None) -> dict:
    """The synthesis job with a tree search per task; see the module docstring for the outputs."""
    search = config.search
    tasks = job_tasks(config)
    job = open_job(config, "searches", progress, len(tasks))
    backend = job.backend
    value_model = VALUE_MODELS[search.value_model]() if search.value_model else None
    requested = sampling_params(backend.model, config.llm.sampling)
    snapshots = spec(config.env).can_snapshot()

    async def run(task: Any) -> dict:
        make = lambda: make_env(config.env, **config.env_kw)  # noqa: E731
        if snapshots:
            make = StateMemo(make).env
        budget = TaskBudget(backend, search.max_calls, search.max_tokens)
        return await TaskSearch(task, budget, make, config.agent, search, config.n, value_model).run()

    async def one(task: Any) -> dict:
        if task.skip_reason:
            return job.skipped({"task_id": task.id, "outcome": "skipped", "detail": task.skip_reason,
                                 "transient": False, "calls": 0, "tokens": 0, "usage": {}, "nodes": [], "records": {}})
        key = episode_key(task, 0, backend.model, {**requested, "search": asdict(search), "n": config.n}, config.agent)
        return await job.journaled(key, lambda: run(task), keep=lambda result: not result["transient"])

    try:
        results = await asyncio.gather(*(one(t) for t in tasks))
    finally:
        await job.close()
    job.stop_if_unreachable(sum(not r["transient"] for r in results), len(tasks))
    return _write_searches(config, job, tasks, results)


def _write_searches(config: SynthConfig, job: ModelJob, tasks: list[Any], results: list[dict]) -> dict:
    """The search trees, their derived step data, the best record of every solved task, and the report (returned)."""
    out, search, model = Path(config.out), config.search, job.backend.model
    nodes, records, failures = [], [], []
    for task, result in zip(tasks, results):
        rows = node_rows(result, config.env, model, search.strategy)
        nodes += rows
        record = best_record(result, rows, search.strategy)
        if record is not None:
            records.append(record)
        else:
            failures.append(_unsolved_row(result, rows, task, model))
    derived = {"nodes": nodes, "step_values": step_values(nodes), "step_pairs": step_pairs(nodes)}
    for name, rows in derived.items():
        write_parquet(rows, arrow_schema(SCHEMAS[name]), out / "search" / name / f"{config.env}.parquet")
    outcomes = Counter(r["outcome"] for r in results)
    successes = sum(r["arrivals"] for r in nodes if r["success"])
    report = {
        "env": config.env, "tasks": len(tasks), "samples_per_task": config.n if search.strategy == "best_of_n" else search.branch,
        "episodes": sum(r["arrivals"] for r in nodes), "records": len(records),
        "unselected": max(0, successes - len(records)), "failures": len(failures),
        "failure_reasons": dict(sorted(Counter(f["reason"] for f in failures).items())),
        "tasks_with_record": len(records), "skipped": job.counts["skipped"],
        "search": {**asdict(search), "outcomes": dict(sorted(outcomes.items())), "searches_run": job.counts["run"],
                   "searches_resumed": job.counts["resumed"], "nodes": len(nodes),
                   "step_values": len(derived["step_values"]), "step_pairs": len(derived["step_pairs"]),
                   "calls": sum(r["calls"] for r in results), "completion_tokens": sum(r["tokens"] for r in results),
                   "max_calls_per_task": max((r["calls"] for r in results), default=0)},
        "usage": dict(sum((Counter(r["usage"]) for r in results), Counter())),
        "llm": job.llm_report(),
    }
    write_outputs(out, config.env, records, failures, report)
    log.info("search %s (%s): %d/%d tasks solved, %d nodes, %d step values, %d step pairs; %d calls answered, %d "
             "cache hits", config.env, search.strategy, len(records), len(tasks), len(nodes),
             len(derived["step_values"]), len(derived["step_pairs"]), job.stats.calls, job.stats.cache_hits)
    return report
