"""Tree search vs best-of-N at equal call budgets, with a scripted agent whose per-step error rate is set.

The agent (`tests/support/search_policy.NoisyPolicy`) follows each task's reference solution and, at every
step, errs with probability p, after which it is lost; so the truth is known: one rollout of an
L-step task succeeds with probability (1 - p)^L. Every strategy gets the same budget of calls per
task and stops at its first success. Tasks: the DBBench fixture tasks the reference solves (L = 2),
and the TextCraft fixture tasks (L = 2 and 4, turn limit 6), each tried under several policy seeds.

The policy answers in-process (it stands for the model; the tests run the same search through the
loopback HTTP server): the search, the agent loop, the environments and their snapshots are real.

    python bench/bench_search.py [--error-rate 0.3 --error-rate 0.5] [--budget 12] [--seeds 4] [--json OUT]

Columns: solved (tasks solved / trials), calls per solved task (all calls spent, solved or not,
over the tasks solved), and the truth: the chance that one rollout succeeds, (1 - p)^L averaged over
the tasks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.paths import FIXTURES  # noqa: E402
from tests.support.search_policy import noisy_policy, textcraft_plan  # noqa: E402
from trajforge.pipeline.envs.tasks import load_tasks  # noqa: E402
from trajforge.pipeline.llm.client import CallStats, ChatResult, Choice  # noqa: E402
from trajforge.pipeline.redact import redact  # noqa: E402
from trajforge.pipeline.synth.config import AgentConfig, SearchConfig  # noqa: E402
from trajforge.pipeline.synth.envs import make_env  # noqa: E402
from trajforge.pipeline.synth.search import JudgeValueModel, StateMemo, TaskBudget, TaskSearch  # noqa: E402

DB_FILE = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"
TEXTCRAFT = FIXTURES / "tasks" / "agentgym" / "textcraft.jsonl"
# beam+judge: beam ranked by the value model (the scripted judge knows when the agent is lost: an
# oracle, so the row shows what a good value model buys, its calls counted in the budget).
STRATEGIES = ("best_of_n", "beam", "beam+judge", "mcts", "dfsdt")
MODEL = "scripted-policy"


@dataclass
class PolicyBackend:
    """The ChatBackend interface around an in-process policy (`policy.seed` is the request's seed)."""
    policy: Any
    model: str = MODEL
    params: dict = field(default_factory=dict)
    stats: CallStats = field(default_factory=CallStats)
    unreachable: str | None = None
    dropped: list = field(default_factory=list)

    def redact(self, text: str | None) -> str | None:
        return redact(text, [])

    async def chat(self, messages: list[dict], sample: int = 0, **overrides: Any) -> ChatResult:
        self.policy.seed = overrides.get("seed")
        reply = self.policy(messages)
        self.stats.calls += 1
        tokens = len(f"{reply.reasoning} {reply.content}".split())
        return ChatResult([Choice(reply.content, reply.reasoning, "stop")], {"completion_tokens": tokens}, self.model, False)

    async def aclose(self) -> None:
        pass


async def search_one(task: Any, env: str, strategy: str, error_rate: float, salt: int, budget: int,
                     branch: int, max_turns: int) -> tuple[bool, int]:
    backend = TaskBudget(PolicyBackend(noisy_policy(error_rate, [DB_FILE], salt)), budget, None)
    memo = StateMemo(lambda: make_env(env))
    steps = 2 if env == "db" else len(textcraft_plan(task.description))
    name, _, judge = strategy.partition("+")
    search = SearchConfig(strategy=name, branch=branch, max_calls=budget, value_model=judge or None)
    result = await TaskSearch(task, backend, memo.env, AgentConfig(seed=0, max_turns=max_turns), search,
                              n=budget // steps, value_model=JudgeValueModel() if judge else None).run()
    return result["outcome"] == "solved", result["calls"]


async def bench(error_rates: list[float], budget: int, seeds: int, branch: int) -> list[dict]:
    db_tasks = [t for t in load_tasks(DB_FILE) if t.env == "db"]
    # The tasks whose reference solution succeeds (a few upstream references are broken).
    solvable = [t for t in db_tasks if (await search_one(t, "db", "best_of_n", 0.0, 0, 2, 1, 4))[0]]
    suites = {"db": (solvable, 4), "textcraft": ([t for t in load_tasks(TEXTCRAFT)], 6)}
    rows = []
    for env, (tasks, max_turns) in suites.items():
        lengths = [2 if env == "db" else len(textcraft_plan(t.description)) for t in tasks]
        for p in error_rates:
            one = sum((1 - p) ** n for n in lengths) / len(lengths)
            for strategy in STRATEGIES:
                start = time.perf_counter()
                results = await asyncio.gather(*(search_one(t, env, strategy, p, salt, budget, branch, max_turns)
                                                 for t in tasks for salt in range(seeds * (len(db_tasks) // len(tasks) if env == "textcraft" else 1))))
                solved = sum(ok for ok, _ in results)
                calls = sum(c for _, c in results)
                rows.append({"env": env, "error_rate": p, "strategy": strategy, "trials": len(results),
                             "solved": solved, "success_rate": solved / len(results),
                             "calls_per_solved": calls / solved if solved else None,
                             "truth_one_rollout": one,
                             "seconds": time.perf_counter() - start})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--error-rate", type=float, action="append", help="per-step error rate (repeatable)")
    parser.add_argument("--budget", type=int, default=12, help="LLM calls per task, every strategy")
    parser.add_argument("--branch", type=int, default=3, help="K proposals per state")
    parser.add_argument("--seeds", type=int, default=4, help="policy seeds per task (DB); TextCraft's two tasks get as many trials as DB's tasks")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = asyncio.run(bench(args.error_rate or [0.3, 0.5], args.budget, args.seeds, args.branch))
    print(f"budget {args.budget} calls per task, K = {args.branch}\n")
    print("| env | p | strategy | solved | success | calls / solved | truth: 1 rollout |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        per = f"{r['calls_per_solved']:.1f}" if r["calls_per_solved"] else "-"
        print(f"| {r['env']} | {r['error_rate']} | {r['strategy']} | {r['solved']}/{r['trials']} | "
              f"{r['success_rate']:.2f} | {per} | {r['truth_one_rollout']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
