"""What an evaluation says per environment: success with a Wilson interval, mean score with a normal
interval, unbiased pass@k, turns and tokens, and why the failures failed.

An episode's outcome is what ended it, in AgentBench's terms where it has them:

| outcome | episode (pipeline/synth/agent.py) |
|---|---|
| `success` | scored at or above the threshold (also when its record would not validate: the env decides) |
| `format_error` | `format_error`, `no_answer`, `empty_response`, `truncated`: no action after the re-prompts |
| `refused_action` | ended (wrong answer or turn cap) right after an action the environment refused (AgentBench's Invalid Action) |
| `turn_cap` | `max_turns` |
| `wrong_answer` | finished, scored below the threshold |
| `env_error` | the environment failed (`env_error`), or could not score (`unscored`) |
| `timeout` | the model did not answer within the request timeout (`llm_error:timeout`) |
| `llm_error` | any other failed request (`llm_error:<reason>`) |
| `not_runnable` | the task cannot run here (`skipped`, e.g. it needs the network); left out of the rates |
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

FORMAT_REASONS = frozenset({"format_error", "no_answer", "empty_response", "truncated"})
OUTCOMES = ("success", "wrong_answer", "format_error", "refused_action", "turn_cap", "env_error", "timeout",
            "llm_error", "not_runnable")
Z95 = 1.959963984540054


def outcome(episode: Any) -> str:
    reason = episode.reason or ""
    if episode.status == "success" or reason.startswith("invalid_record:"):
        return "success"
    if reason == "skipped":
        return "not_runnable"
    if reason in FORMAT_REASONS:
        return "format_error"
    if reason == "llm_error:timeout":
        return "timeout"
    if reason.startswith("llm_error"):
        return "llm_error"
    if reason in ("env_error", "unscored"):
        return "env_error"
    last = episode.steps[-1] if episode.steps else None
    if last is not None and last.issue == "invalid_action":
        return "refused_action"
    if reason == "max_turns":
        return "turn_cap"
    return "wrong_answer"


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """Wilson score interval of a rate: stays inside [0, 1] and is not degenerate at 0 or n successes."""
    if n == 0:
        return None
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float] | None:
    """Normal-approximation interval of a mean of scores in [0, 1], clipped to [0, 1]."""
    n = len(values)
    if n == 0:
        return None
    mean = sum(values) / n
    if n == 1:
        return mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return max(0.0, mean - z * sd / math.sqrt(n)), min(1.0, mean + z * sd / math.sqrt(n))


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased estimator: 1 - C(n-c, k) / C(n, k), for n samples with c correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """1, the powers of two below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _mean(values: list[float] | list[int]) -> float | None:
    return _round(sum(values) / len(values)) if values else None


def _rounded(interval: tuple[float, float] | None) -> list[float | None] | None:
    return [_round(x) for x in interval] if interval else None


def _pass_at_ks(by_task: dict[str, list[bool]], n: int) -> dict[str, float | None]:
    """pass@k for k in `ks_for(n)`, averaged over the tasks (`by_task`: task -> success of each sample)."""
    if not by_task:
        return {}
    return {str(k): _round(sum(pass_at_k(len(v), sum(v), k) for v in by_task.values()) / len(by_task))
            for k in ks_for(n)}


def _effort(episodes: list[Any]) -> dict:
    """Turns and tokens per episode, and the actions the environment refused."""
    turns = [sum(1 for t in e.turns if t["role"] == "assistant") for e in episodes]
    tokens = [e.usage.get("total_tokens", 0) for e in episodes]
    return {"mean_turns": _mean(turns), "mean_tokens": _mean(tokens), "tokens": sum(tokens),
            "refused_actions": sum(1 for e in episodes for s in e.steps if s.issue == "invalid_action")}


def summarize(episodes: Iterable[Any], n: int, threshold: float = 1.0) -> dict:
    """The figures of one (policy, env): episodes are `Episode`s of the same tasks x n samples."""
    episodes = list(episodes)
    outcomes = [outcome(e) for e in episodes]
    runnable = [(e, o) for e, o in zip(episodes, outcomes) if o != "not_runnable"]
    won = [o == "success" for _, o in runnable]
    scores = [float(e.reward or 0.0) for e, _ in runnable]
    by_task: dict[str, list[bool]] = {}
    for (e, _), success in zip(runnable, won):
        by_task.setdefault(e.task_id, []).append(success)
    return {
        "tasks": len({e.task_id for e in episodes}), "runnable_tasks": len(by_task), "samples_per_task": n,
        "episodes": len(runnable), "not_runnable": outcomes.count("not_runnable"), "successes": sum(won),
        "success_rate": _mean(won),
        "success_ci95": _rounded(wilson(sum(won), len(runnable))),
        "mean_score": _mean(scores),
        "score_ci95": _rounded(mean_interval(scores)),
        "pass_at_k": _pass_at_ks(by_task, n),
        **_effort([e for e, _ in runnable]),
        "outcomes": dict(sorted(Counter(outcomes).items(), key=lambda kv: OUTCOMES.index(kv[0]))),
    }
