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
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trajforge.pipeline.llm.client import sampling_params
from trajforge.pipeline.llm.job import ModelJob
from trajforge.pipeline.synth.agent import Episode, run_episode
from trajforge.pipeline.synth.config import SynthConfig
from trajforge.pipeline.synth.folder import (
    episode_key,
    failure_row,
    job_tasks,
    open_job,
    usage_totals,
    with_episode_journal,
    write_failures,
    write_outputs,
)
from trajforge.pipeline.synth.search import search_async

log = logging.getLogger("trajforge.synth")


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


async def synthesize_async(config: SynthConfig, progress: Callable[[int, int], None] | None = None) -> dict:
    """The job; `progress(done, total)` is called as episodes finish (resumed ones included)."""
    if config.search.strategy is not None:
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
        unselected += [failure_row(e, model) | {"reason": "not_selected"} for e in rest]
    return by_task, records, unselected


def _write_job(config: SynthConfig, job: ModelJob, tasks: list[Any], episodes: list[Episode]) -> dict:
    """The job's outputs and its report (returned)."""
    out, backend = Path(config.out), job.backend
    by_task, records, unselected = _best_of_n(episodes, config.keep, backend.model)
    identical = sum(identical_samples(task_episodes) for task_episodes in by_task.values())
    failures = [failure_row(e, backend.model) for e in episodes if e.status == "failure"]
    if config.keep == "best":
        write_failures(unselected, out / "unselected.parquet")
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
