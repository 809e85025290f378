"""The synthesis job: every task x N samples through the agent loop, resumable, with a report.

Layout of an output folder:

    DIR/data/synthetic/<env>.parquet   successful trajectories (schema records; the `synthetic` source reads them)
    DIR/failures.parquet               failed episodes with reason codes, partial conversations, token usage and
                                       the rejected replies' text (all envs)
    DIR/unselected.parquet             successes that best-of-N did not keep (keep="best" only)
    DIR/report.json                    counts per reason, calls made, cache hits, token totals, sampling sent
    DIR/.synth/requests.sqlite         the LLM request cache
    DIR/.synth/episodes.sqlite         finished episodes, so a rerun does not even replay them

Resuming has two layers. Finished episodes are journaled and are not run again. An episode that
was cut short (crash, or an LLM/env error) is run again, and its calls that already got an
answer come from the request cache, so a rerun pays only for calls never answered. Episodes
that failed for a transient reason (`llm_error:*`, `env_error`) are reported but not journaled,
so the next run retries them.

When the server cannot be reached (`max_connection_failures` requests in a row), the job stops with
`ServerUnreachable` and writes no outputs: what finished is journaled, and a rerun resumes.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from trajforge.pipeline.atomic import write_json, write_parquet
from trajforge.pipeline.llm.client import JsonStore, sampling_params
from trajforge.pipeline.llm.job import ModelJob
from trajforge.pipeline.synth.agent import AgentConfig, Episode, StepLog, record_id, run_episode
from trajforge.pipeline.synth.config import SynthConfig
from trajforge.schemas import arrow_schema

log = logging.getLogger("trajforge.synth")

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "total_tokens")

FAILURE_SCHEMA = pa.schema([
    ("id", pa.string()), ("task_id", pa.string()), ("sample", pa.int64()), ("env", pa.string()),
    ("reason", pa.string()), ("detail", pa.string()), ("reward", pa.float64()), ("answer", pa.string()),
    ("model", pa.string()), ("conversations", pa.string()), ("steps", pa.string()),
    ("usage", pa.struct([(k, pa.int64()) for k in USAGE_KEYS])),
    ("rejected", pa.string()),  # JSON: the replies re-prompted away, with their text and reasoning
])


class EpisodeJournal:
    """Finished episodes by key, in a job's journal (a crash loses at most the episodes in flight)."""

    def __init__(self, store: JsonStore):
        self._store = store

    def get(self, key: str) -> Episode | None:
        data = self._store.get(key)
        if data is None:
            return None
        data["steps"] = [StepLog(**s) for s in data["steps"]]
        return Episode(**data)

    def put(self, key: str, episode: Episode) -> None:
        self._store.put(key, asdict(episode))

    def close(self) -> None:
        self._store.close()



def episode_key(task: Any, sample: int, model: str, params: dict, agent: AgentConfig) -> str:
    """Same task content, draw, model, sampling and agent settings -> same episode."""
    blob = json.dumps({"task": task.as_dict(), "sample": sample, "model": model, "params": params,
                       "agent": asdict(agent)}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def select(episodes: list[Episode], keep: str) -> tuple[list[Episode], list[Episode]]:
    """Best-of-N for one task: (kept successes, unselected successes). Ties go to the shorter
    trajectory, then to the lower sample index, so the choice is stable across reruns."""
    wins = sorted((e for e in episodes if e.status == "success"),
                  key=lambda e: (-(e.reward or 0.0), len(e.turns), e.sample))
    return (wins, []) if keep == "all" else (wins[:1], wins[1:])


def identical_samples(episodes: list[Episode]) -> bool:
    """True when at least two samples of a task got the very same replies: the server did not sample."""
    replies = {tuple((t["content"], t["reasoning"]) for t in e.turns if t["role"] == "assistant")
               + tuple((r["content"], r["reasoning"]) for r in e.rejected) for e in episodes}
    replies.discard(())
    answered = sum(1 for e in episodes if e.rejected or any(t["role"] == "assistant" for t in e.turns))
    return answered >= 2 and len(replies) == 1


def usage_totals(episodes: list[Episode]) -> dict[str, int]:
    return {k: sum(e.usage.get(k, 0) for e in episodes) for k in USAGE_KEYS}


def _failure_row(episode: Episode, model: str) -> dict:
    return {"id": record_id(episode.task_id, episode.sample), "task_id": episode.task_id, "sample": episode.sample,
            "env": episode.env, "reason": episode.reason or "", "detail": episode.detail, "reward": episode.reward,
            "answer": episode.answer, "model": model,
            "conversations": json.dumps(episode.turns, ensure_ascii=False),
            "steps": json.dumps([asdict(s) for s in episode.steps]),
            "usage": usage_totals([episode]), "rejected": json.dumps(episode.rejected, ensure_ascii=False)}


def _write_failures(rows: list[dict], path: Path) -> None:
    write_parquet(rows, FAILURE_SCHEMA, path)


def job_tasks(config: SynthConfig) -> list[Any]:
    """The tasks of the job's env in its task file."""
    from trajforge.pipeline.envs.tasks import load_tasks

    tasks = [t for t in load_tasks(config.tasks) if t.env == config.env]
    if not tasks:
        raise ValueError(f"{config.tasks}: no task for env {config.env!r}")
    return tasks


def open_job(config: SynthConfig, journal: str, progress: Callable[[int, int], None] | None = None,
             total: int = 0) -> ModelJob:
    """The job's state in `OUT/.synth`: the request cache and the journal named `journal`."""
    return ModelJob.open(Path(config.out) / ".synth", config.backend, config.llm, journal, config.episode_concurrency,
                         progress, total)


def with_episode_journal(job: ModelJob) -> ModelJob:
    """The job with its journal read and written as Episodes."""
    return replace(job, journal=EpisodeJournal(job.journal))


def write_outputs(out: Path, env: str, records: list[dict], failures: list[dict], report: dict) -> None:
    """The env's records, its failures merged into every env's failures.parquet, its report merged into report.json."""
    state = out / ".synth"
    write_parquet(records, arrow_schema("trajectory"), out / "data" / "synthetic" / f"{env}.parquet")
    # failures.parquet holds every env run into this folder: one part per env, merged.
    _write_failures(failures, state / f"failures-{env}.parquet")
    merged = [row for part in sorted(state.glob("failures-*.parquet")) for row in pq.read_table(part).to_pylist()]
    _write_failures(merged, out / "failures.parquet")
    reports = state / "reports"
    write_json(reports / f"{env}.json", report)
    write_json(out / "report.json", {p.stem: json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))})


async def synthesize_async(config: SynthConfig, progress: Callable[[int, int], None] | None = None) -> dict:
    """The job; `progress(done, total)` is called as episodes finish (resumed ones included)."""
    if config.search.strategy is not None:
        from trajforge.pipeline.synth.search import search_async

        return await search_async(config, progress)
    tasks = job_tasks(config)
    job = with_episode_journal(open_job(config, "episodes", progress, len(tasks) * config.n))
    # Keyed by the sampling asked for, not the sampling sent: fields a strict server rejects are dropped
    # during the job, and the journal must still find the episodes of a run that started before that.
    requested = sampling_params(job.backend.model, config.llm.sampling)
    try:
        episodes = await asyncio.gather(*(_episode(job, config, requested, t, k)
                                          for t in tasks for k in range(config.n)))
    finally:
        await job.close()
    job.stop_if_unreachable(sum(1 for e in episodes if not e.transient), len(episodes))
    return _write_job(config, job, tasks, episodes)


async def _episode(job: ModelJob, config: SynthConfig, requested: dict, task: Any, sample: int) -> Episode:
    """Draw `sample` of `task`: skipped, from the journal, or run."""
    from trajforge.pipeline.synth.envs import make_env

    if task.skip_reason:
        return job.skipped(Episode(task.id, sample, task.env, "failure", "skipped", task.skip_reason))
    backend = job.backend

    async def run() -> Episode:
        return await run_episode(backend, lambda: make_env(config.env, **config.env_kw), task, sample, config.agent)

    def stopped() -> Episode:  # the job is stopping: start no environment
        return Episode(task.id, sample, task.env, "failure", "llm_error:connection", backend.unreachable)

    key = episode_key(task, sample, backend.model, requested, config.agent)
    return await job.journaled(key, run, keep=lambda episode: not episode.transient, stopped=stopped)


def _best_of_n(episodes: list[Episode], keep: str, model: str) -> tuple[dict[str, list[Episode]], list[dict], list[dict]]:
    """(the episodes by task, the kept records, the unselected successes as failure rows)."""
    by_task: dict[str, list[Episode]] = {}
    for episode in episodes:
        by_task.setdefault(episode.task_id, []).append(episode)
    records, unselected = [], []
    for task_episodes in by_task.values():
        kept, rest = select(task_episodes, keep)
        records += [e.record for e in kept]
        unselected += [_failure_row(e, model) | {"reason": "not_selected"} for e in rest]
    return by_task, records, unselected


def _write_job(config: SynthConfig, job: ModelJob, tasks: list[Any], episodes: list[Episode]) -> dict:
    """The job's outputs and its report (returned)."""
    out, backend = Path(config.out), job.backend
    by_task, records, unselected = _best_of_n(episodes, config.keep, backend.model)
    identical = sum(identical_samples(task_episodes) for task_episodes in by_task.values())
    failures = [_failure_row(e, backend.model) for e in episodes if e.status == "failure"]
    if config.keep == "best":
        _write_failures(unselected, out / "unselected.parquet")
    report = {
        "env": config.env, "tasks": len(tasks), "samples_per_task": config.n, "episodes": len(episodes),
        "records": len(records), "unselected": len(unselected), "failures": len(failures),
        "failure_reasons": dict(sorted(Counter(e.reason for e in episodes if e.status == "failure").items())),
        "tasks_with_record": sum(1 for es in by_task.values() if any(e.status == "success" for e in es)),
        "episodes_run": job.counts["run"], "episodes_resumed": job.counts["resumed"], "skipped": job.counts["skipped"],
        "usage": usage_totals(episodes), "tasks_with_identical_samples": identical,
        "llm": job.llm_report(),
    }
    if identical and config.n > 1 and backend.params.get("temperature", 1.0) > 0:
        log.warning("%s: %d of %d tasks got the very same replies in all their samples: the server seems to "
                    "ignore the sampling parameters %s, so best-of-%d gains nothing (transformers serve samples "
                    "only when the model's generation config sets do_sample)", config.env, identical, len(by_task),
                    backend.params, config.n)
    write_outputs(out, config.env, records, failures, report)
    log.info("synth %s: %d tasks x %d: %d records, %d failures %s; %d calls answered of %d attempts, %d cache hits",
             config.env, len(tasks), config.n, len(records), len(failures), report["failure_reasons"], job.stats.calls,
             job.stats.attempts, job.stats.cache_hits)
    return report


def synthesize(config: SynthConfig, progress: Callable[[int, int], None] | None = None) -> dict:
    """Run the job to the end (blocking); see the module docstring for the outputs."""
    return asyncio.run(synthesize_async(config, progress))
