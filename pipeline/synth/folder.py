"""A synthesis output folder, shared by the episode job (`pipeline/synth/job.py`) and the tree search
(`pipeline/synth/search.py`): the job's state in `OUT/.synth` (request cache, journal), its tasks, and the
writing of its records, failures and report (the layout is in job.py's docstring).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from trajforge.pipeline.atomic import write_json, write_parquet
from trajforge.pipeline.llm.client import JsonStore
from trajforge.pipeline.llm.job import ModelJob
from trajforge.pipeline.synth.agent import AgentConfig, Episode, StepLog, record_id
from trajforge.pipeline.synth.config import SynthConfig
from trajforge.schemas import arrow_schema

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "reasoning_tokens", "total_tokens")


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


def usage_totals(episodes: list[Episode]) -> dict[str, int]:
    return {k: sum(e.usage.get(k, 0) for e in episodes) for k in USAGE_KEYS}


def failure_row(episode: Episode, model: str) -> dict:
    return {"id": record_id(episode.task_id, episode.sample), "task_id": episode.task_id, "sample": episode.sample,
            "env": episode.env, "reason": episode.reason or "", "detail": episode.detail, "reward": episode.reward,
            "answer": episode.answer, "model": model,
            "conversations": json.dumps(episode.turns, ensure_ascii=False),
            "steps": json.dumps([asdict(s) for s in episode.steps]),
            "usage": usage_totals([episode]), "rejected": json.dumps(episode.rejected, ensure_ascii=False)}


def write_failures(rows: list[dict], path: Path) -> None:
    write_parquet(rows, arrow_schema("synth_failures"), path)


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
    write_failures(failures, state / f"failures-{env}.parquet")
    merged = [row for part in sorted(state.glob("failures-*.parquet")) for row in pq.read_table(part).to_pylist()]
    write_failures(merged, out / "failures.parquet")
    reports = state / "reports"
    write_json(reports / f"{env}.json", report)
    write_json(out / "report.json", {p.stem: json.loads(p.read_text()) for p in sorted(reports.glob("*.json"))})
