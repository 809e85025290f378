"""The evaluation job: a model and the calibration policies on each env's held-out tasks.

For every env asked for, the tasks of its declared split (`splits.EVAL_SPLITS`, or a task file
given for it) run through the synthesis agent loop (`pipeline.synth.agent.run_episode`) against
the real environment: the model N times per task, the oracle and random policies once each (see
`policies`). Episodes are journaled and the model's requests cached (the synthesis job's stores),
so a rerun into the same folder resumes and pays for nothing twice.

Outputs in OUT: `eval.json` (per env and policy: `metrics.summarize`, the split and its
fingerprint, broken-env flags), `episodes.parquet` (one row per episode: outcome, reason, score,
turns, tokens), `report.html` with plots (`report.py`), and one row per (model, env) appended to
the results table (`results.parquet` and `results.csv` in the results folder), which any number
of runs share, so that checkpoints compare side by side.
"""
from __future__ import annotations

import asyncio
import datetime as dt
import fcntl
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import atomic_path, write_json, write_parquet
from trajforge.pipeline.envs import specs
from trajforge.pipeline.envs.tasks import Task, load_tasks
from trajforge.pipeline.evaluation.metrics import outcome, summarize
from trajforge.pipeline.evaluation.policies import POLICIES, can_play
from trajforge.pipeline.evaluation.splits import EVAL_SPLITS, fingerprint_of, training_overlap
from trajforge.pipeline.llm.client import LLMConfig, ServerUnreachable, sampling_params
from trajforge.pipeline.llm.job import ModelJob
from trajforge.pipeline.synth.agent import Episode, run_episode
from trajforge.pipeline.synth.config import AgentConfig
from trajforge.pipeline.synth.folder import EpisodeJournal, episode_key
from trajforge.schemas import arrow_schema

log = logging.getLogger("trajforge.eval")

ORACLE_OK = 0.95      # an oracle below this success rate marks the env as broken



class EvalRefused(ValueError):
    """The evaluation would not mean anything (the model trained on the held-out tasks)."""


@dataclass
class EvalConfig:
    out: str
    envs: list[str]                                   # envs to evaluate (their declared splits)
    llm: LLMConfig | None = None                      # the model; None: the calibration policies only
    label: str | None = None                          # the name of this checkpoint in the results table
    tasks: dict[str, str] = field(default_factory=dict)   # env -> task file instead of the declared split
    n: int = 1                                        # samples per task for the model (pass@k up to n)
    calibrate: tuple[str, ...] = ("oracle", "random")
    agent: AgentConfig = field(default_factory=AgentConfig)
    env_kw: dict[str, dict] = field(default_factory=dict)  # env -> settings (os timeouts, agentgym base_url)
    episode_concurrency: int = 8
    backend: str = "openai"
    results: str | None = None                        # folder of the shared results table
    train_data: str | None = None                     # the model's training build: checked for overlap
    allow_overlap: bool = False                       # warn instead of refusing when it overlaps
    exclude: tuple[str, ...] = ()                     # task texts to leave out (a caller's training tasks)

    def __post_init__(self):
        if self.n < 1:
            raise ValueError("n must be at least 1")
        for policy in self.calibrate:
            POLICIES[policy]


def env_unavailable(env: str, env_kw: dict) -> str | None:
    """Why `env` cannot run on this machine (its spec says), or None."""
    found = specs().get(env)
    return found.unavailable(env_kw) if found is not None and found.unavailable else None


def split_of(env: str, config: EvalConfig) -> tuple[str, str, list[Task]]:
    """(split name, fingerprint, tasks of `env`) for the run."""
    if env in config.tasks:
        path = Path(config.tasks[env])
        tasks = [t for t in load_tasks(path) if t.env == env]
        fingerprint = fingerprint_of([path])
        name = f"file:{path.name}"
    else:
        split = EVAL_SPLITS[env]
        tasks, fingerprint, name = split.tasks(), split.fingerprint(), split.name
    if config.exclude:
        from trajforge.pipeline.quality.dedup import Contamination

        index = Contamination(config.exclude)
        tasks = [t for t, hit in zip(tasks, index.matches([t.description for t in tasks])) if hit is None]
    if not tasks:
        raise ValueError(f"eval {env}: no task left in {name}")
    return name, fingerprint, tasks


async def _episodes(make_backend_for: Callable[[Task, int], Any], model: str, params: dict, tasks: list[Task],
                    n: int, env: str, config: EvalConfig, journal: EpisodeJournal) -> list[Episode]:
    from trajforge.pipeline.synth.envs import make_env

    gate = asyncio.Semaphore(config.episode_concurrency)

    async def one(task: Task, sample: int) -> Episode:
        if task.skip_reason:
            return Episode(task.id, sample, task.env, "failure", "skipped", task.skip_reason)
        key = episode_key(task, sample, model, params, config.agent)
        done = journal.get(key)
        if done is not None:
            return done
        async with gate:
            episode = await run_episode(make_backend_for(task, sample), lambda: make_env(env, **config.env_kw.get(env, {})),
                                        task, sample, config.agent)
        if not episode.transient:
            journal.put(key, episode)
        return episode

    return await asyncio.gather(*(one(t, k) for t in tasks for k in range(n)))


def _rows(policy: str, env: str, episodes: list[Episode]) -> list[dict]:
    return [{"policy": policy, "env": env, "task_id": e.task_id, "sample": e.sample, "outcome": outcome(e),
             "reason": e.reason, "detail": e.detail[:500], "score": e.reward,
             "turns": sum(1 for t in e.turns if t["role"] == "assistant"),
             "refused_actions": sum(1 for s in e.steps if s.issue == "invalid_action"),
             "total_tokens": e.usage.get("total_tokens", 0)} for e in episodes]


def _runnable_splits(config: EvalConfig, not_run: dict[str, str]) -> dict[str, tuple[str, str, list[Task]]]:
    """env -> `split_of` for each env that can run here; each other env's reason goes into `not_run`."""
    splits = {}
    for env in config.envs:
        why = env_unavailable(env, config.env_kw.get(env, {}))
        if why:
            not_run[env] = why
            log.warning("eval: %s not run: %s", env, why)
            continue
        splits[env] = split_of(env, config)
    return splits


def _overlap_warnings(config: EvalConfig, overlap: dict[str, int]) -> list[str]:
    """Refuses (EvalRefused) when the training data holds eval tasks, unless allowed: then the warning."""
    if not any(overlap.values()):
        return []
    message = (f"the training data {config.train_data} holds tasks of the eval splits "
               f"({', '.join(f'{k}: {v} records' for k, v in overlap.items() if v)}): the scores would "
               f"measure memory, not skill")
    if not config.allow_overlap:
        raise EvalRefused(message + "; rebuild it with the default decontamination, or pass --allow-overlap")
    log.warning("EVALUATING ON TRAINING TASKS: %s", message)
    return [message]


async def _calibrate(entry: dict[str, Any], env: str, tasks: list[Task], config: EvalConfig,
                     journal: EpisodeJournal, rows: list[dict]) -> None:
    """The calibration policies' figures into `entry`, and `broken` when the oracle fails."""
    for policy in config.calibrate:
        playable = [t for t in tasks if can_play(policy, t) is None]
        episodes = await _episodes(lambda t, k, p=policy: POLICIES[p](t, k), f"policy/{policy}", {},
                                   playable, 1, env, config, journal)
        entry["policies"][policy] = {**summarize(episodes, 1), "unplayable": len(tasks) - len(playable)}
        rows.extend(_rows(policy, env, episodes))
    if "oracle" in entry["policies"]:
        oracle = entry["policies"]["oracle"]["success_rate"]
        entry["broken"] = oracle is None or oracle < ORACLE_OK
        if entry["broken"]:
            log.warning("eval: the %s oracle scores %s on %s: the env, its scorer or its task file is broken",
                        env, oracle, entry["split"])


async def evaluate_async(config: EvalConfig) -> dict:
    out = Path(config.out)
    job = ModelJob.open(out / ".eval", config.backend, config.llm, "episodes", config.episode_concurrency)
    backend, journal = job.backend, EpisodeJournal(job.journal)
    model = backend.model if backend else None
    report: dict[str, Any] = {"model": model, "label": config.label or model, "n": config.n,
                              "agent": asdict(config.agent), "envs": {}, "not_run": {}}
    rows: list[dict] = []
    try:
        splits = _runnable_splits(config, report["not_run"])
        overlap = training_overlap(config.train_data, {name: (env, tasks) for env, (name, _, tasks) in splits.items()}) \
            if config.train_data else {}
        if warnings := _overlap_warnings(config, overlap):
            report["warnings"] = warnings
        for env, (name, fingerprint, tasks) in splits.items():
            entry: dict[str, Any] = {"split": name, "fingerprint": fingerprint, "tasks": len(tasks),
                                     "training_overlap": overlap.get(name), "policies": {}}
            await _calibrate(entry, env, tasks, config, journal, rows)
            if backend is not None:
                params = sampling_params(backend.model, config.llm.sampling)
                episodes = await _episodes(lambda t, k: backend, backend.model, params, tasks, config.n, env, config,
                                           journal)
                if backend.unreachable:
                    raise ServerUnreachable(f"{backend.unreachable}. Stopped; rerun the same command to resume.")
                entry["model"] = summarize(episodes, config.n, config.agent.success_threshold)
                rows += _rows("model", env, episodes)
            report["envs"][env] = entry
    finally:
        await job.close()
        if backend is not None:
            report["llm"] = job.llm_report()
    report["finished"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    write_parquet(rows, arrow_schema("eval_episodes"), out / "episodes.parquet")
    from trajforge.pipeline.evaluation.report import write_html

    report["report_html"] = str(write_html(out, report, rows)[0])
    if config.results:
        report["results"] = str(append_results(Path(config.results), result_rows(report, out)))
    write_json(out / "eval.json", report)
    return report


def result_rows(report: dict, out: Path) -> list[dict]:
    """One row per (model, env), and one per calibration policy, for the shared results table."""
    run = f"{report['finished']}:{out.resolve()}"
    rows = []
    for env, entry in report["envs"].items():
        figures = {**{f"policy/{p}": s for p, s in entry["policies"].items()}}
        if "model" in entry:
            figures[report["model"]] = entry["model"]
        oracle = entry["policies"].get("oracle", {}).get("success_rate")
        floor = entry["policies"].get("random", {}).get("success_rate")
        for model, s in figures.items():
            ci, sci, pak = s["success_ci95"] or [None, None], s["score_ci95"] or [None, None], s["pass_at_k"]
            rows.append({
                "run": run, "finished": report["finished"], "model": model,
                "label": report["label"] if model == report["model"] else model,
                "policy": "model" if model == report["model"] else model.split("/", 1)[1], "env": env,
                "split": entry["split"], "split_fingerprint": entry["fingerprint"], "tasks": s["runnable_tasks"],
                "episodes": s["episodes"], "samples_per_task": s["samples_per_task"],
                "success_rate": s["success_rate"], "success_ci_low": ci[0], "success_ci_high": ci[1],
                "mean_score": s["mean_score"], "score_ci_low": sci[0], "score_ci_high": sci[1],
                "pass_at_1": pak.get("1"), "pass_at_n": pak.get(str(s["samples_per_task"])),
                "mean_turns": s["mean_turns"], "mean_tokens": s["mean_tokens"], "outcomes": json.dumps(s["outcomes"]),
                "oracle_success": oracle, "random_success": floor, "training_overlap": entry["training_overlap"],
                "eval_dir": str(out.resolve())})
    return rows


def append_results(folder: Path, rows: list[dict]) -> Path:
    """Append `rows` to `folder/results.parquet` (and its CSV twin) under a file lock: runs that
    finish at once both land."""
    import polars as pl

    folder.mkdir(parents=True, exist_ok=True)
    table = folder / "results.parquet"
    with open(folder / ".results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        earlier = pq.read_table(table).to_pylist() if table.exists() else []
        all_rows = earlier + rows
        schema = arrow_schema("eval_results")
        write_parquet(all_rows, schema, table)
        with atomic_path(folder / "results.csv") as tmp:
            pl.from_arrow(pa.Table.from_pylist(all_rows, schema=schema)).write_csv(tmp)
    return table


def evaluate(config: EvalConfig) -> dict:
    return asyncio.run(evaluate_async(config))
