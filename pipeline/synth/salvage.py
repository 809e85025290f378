"""Salvage of failed runs (EEF, "Exploring Expert Failures Improves LLM Agent Tuning").

A failed trajectory often starts well: a plan, the right query, the key command, and only a later
step goes wrong. EEF replays prefixes of failed expert trajectories in a fresh environment and
lets the agent continue; a prefix after which the continuation succeeds marks its actions as
beneficial, and (prefix + continuation) becomes training data. The failing remainder never does.

Here the failures come from synthesis (`failures.parquet`: task id, env, the partial conversation)
or from records that end without success (`success: false`), matched to a task of the task file by
id or by description. Only envs that can replay an action sequence qualify (their spec says
`replayable`): the OS sandbox and the SQLite database are fresh copies, and AgentGym's envs run
in-process rebuild the same seeded level, recipe set or simulator variation.

Before any model call, the failure's actions are replayed in a fresh environment (no model), which
checks two things. The replay must agree with the record: each replayed observation must equal the
recorded one (whitespace aside), since the record's thoughts were written about the recorded
observations; the prefix ends before the first step that disagrees, and the disagreement is kept in
the row (`replay_mismatch`). And a step is only worth keeping when it did something: a step the
environment refused (an invalid action), one it answered with an error (a failed SQL statement, a
non-zero exit), and one that changed nothing (the same action with the same observation as an
earlier step) are dropped from the prefix (`dropped_steps`, by reason in the report).

For a failure with n actions the prefixes of k = n-1, n-2, ..., 1 actions are tried, longest first
(it keeps the most expert actions), at most `max_prefixes` of them, each without its dropped steps
(two k that keep the same steps are one prefix), and the first that leads to a success is kept,
once the observations of its replay in the episode match the record too. Every LLM call goes
through one budget (`max_calls`, cache hits are free), so a salvage run never spends more than it
was given. Each failure ends in exactly one row of `salvage.parquet` with its outcome:

    salvaged               a prefix of k actions + the continuation succeeded (a record was written)
    no_prefix_succeeded    every prefix tried failed (tried <= max_prefixes)
    budget_exhausted       the call budget ran out before a prefix succeeded
    no_prefix              fewer than two actions: there is no proper prefix to keep
    no_useful_prefix       every step of the proper prefix was refused, an error, or changed nothing
    replay_mismatch        the replay disagrees with the record from its first step (or in every prefix tried)
    env_not_replayable     the env cannot replay a trajectory (its spec is not `replayable`)
    no_task                the task is not in the task file
    not_a_task_failure     the run failed outside the model and task (llm_error, env_error, skipped)
    transient              a continuation hit an LLM or env error; the next run tries again

Outputs: `OUT/data/synthetic/<env>.parquet` (the salvaged records, `source: synthetic`, readable by
the `synthetic` build source), `OUT/salvage.parquet`, `OUT/report.json`; state in `OUT/.salvage/`
(request cache, episode journal) so a rerun makes no call it already made.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from trajforge.pipeline.atomic import write_json, write_parquet
from trajforge.pipeline.envs import specs
from trajforge.pipeline.llm.client import ChatBackend, ChatResult, LLMConfig, LLMError
from trajforge.pipeline.llm.job import ModelJob
from trajforge.pipeline.synth.agent import EMPTY_OBSERVATION, AgentConfig, Episode, run_episode
from trajforge.pipeline.synth.envs.base import StepResult
from trajforge.pipeline.synth.folder import episode_key, with_episode_journal
from trajforge.schemas import arrow_schema

log = logging.getLogger("trajforge.salvage")


def replayable_envs() -> list[str]:
    """The envs whose spec says a fresh instance replays a recorded prefix the same way."""
    return [name for name, env in specs().items() if env.replayable]


# Synthesis failures that say nothing about the task's solvability from a prefix.
NOT_TASK_FAILURES = ("llm_error", "env_error", "skipped")

class CallBudget:
    """A ChatBackend that forwards at most `max_calls` uncached calls, then raises LLMError("budget_exhausted").

    A call reserves its slot before it is sent (so concurrent calls cannot overshoot) and gives it
    back when the answer came from the cache.
    """

    def __init__(self, backend: ChatBackend, max_calls: int | None):
        self.backend = backend
        self.max_calls = max_calls
        self.spent = 0
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        # Everything but the budgeted call is the wrapped backend's (model, params, stats, redact, ...).
        return getattr(self.backend, name)

    async def chat(self, messages: list[dict], sample: int = 0, **overrides: Any) -> ChatResult:
        if self.max_calls is not None and self.spent >= self.max_calls:
            self.refused += 1
            raise LLMError("budget_exhausted", f"the budget of {self.max_calls} calls is spent")
        self.spent += 1  # a call that fails was still sent: it stays spent
        result = await self.backend.chat(messages, sample=sample, **overrides)
        if result.cached:
            self.spent -= 1
        return result


@dataclass
class Failure:
    """One failed trajectory to salvage."""
    id: str
    task_id: str
    env: str
    reason: str
    turns: list[dict]

    @property
    def actions(self) -> list[dict]:
        return [t for t in self.turns if t["role"] == "assistant" and t.get("action")]

    @property
    def observations(self) -> list[str | None]:
        """Per action, the observation recorded right after it (None when the record ends there)."""
        found = []
        for i, turn in enumerate(self.turns):
            if turn["role"] == "assistant" and turn.get("action"):
                after = self.turns[i + 1] if i + 1 < len(self.turns) else None
                found.append(after["content"] if after is not None and after["role"] == "user" else None)
        return found


def _space(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def step_verdict(step: StepResult, action: str, observation: str, earlier: set[tuple[str, str]]) -> str | None:
    """Why a replayed prefix step is dropped, None when it is kept: `refused` (the environment did
    not run it: `info.valid` false), `error` (it ran and failed: `info.error`, the env's error
    reply), `no_change` (the same action and observation as an earlier step of the replay).
    Our environments (os, db) report refusals and errors in `info`; an environment whose refusals
    come back only as observation text needs its own check here (the place for per-env refusal
    replies such as those the ingest grammars know)."""
    info = step.info or {}
    if info.get("valid", True) is False:
        return "refused"
    if info.get("error"):
        return "error"
    if (_space(action), _space(observation)) in earlier:
        return "no_change"
    return None


@dataclass
class ReplayedStep:
    observation: str
    verdict: str | None        # step_verdict; `ended` when the step ended the episode


def replay_actions(make_env: Any, task: Any, actions: list[str], redact: Any) -> list[ReplayedStep]:
    """Each action stepped in a fresh environment, without a model (blocking). Observations are
    cleaned as the agent loop cleans them, so that they compare with a record's."""
    env = make_env()
    try:
        env.reset(task)
        steps: list[ReplayedStep] = []
        earlier: set[tuple[str, str]] = set()
        for action in actions:
            result = env.step(action)
            observation = redact(result.observation.strip()) or EMPTY_OBSERVATION
            if result.done:
                steps.append(ReplayedStep(observation, "ended"))
                break
            steps.append(ReplayedStep(observation, step_verdict(result, action, observation, earlier)))
            earlier.add((_space(action), _space(observation)))
        return steps
    finally:
        env.close()


def first_mismatch(recorded: list[str | None], replayed: list[str]) -> tuple[int, str] | None:
    """(index, description) of the first replayed observation that is not the recorded one."""
    for i, (was, now) in enumerate(zip(recorded, replayed)):
        if was is None or _space(was) != _space(now):
            return i, f"step {i}: recorded {(was or '(nothing)')[:200]!r}, the replay gives {now[:200]!r}"
    return None


def episode_prefix_observations(episode: Episode, steps: int) -> list[str]:
    """The observations after the first `steps` assistant turns of an episode (the replayed prefix)."""
    found = []
    for i, turn in enumerate(episode.turns):
        if turn["role"] == "assistant" and len(found) < steps:
            after = episode.turns[i + 1] if i + 1 < len(episode.turns) else None
            found.append(after["content"] if after is not None and after["role"] == "user" else "")
    return found


def read_failures(path: str | Path) -> list[Failure]:
    """Failures from a synthesis `failures.parquet`, or the unsuccessful records of a records Parquet file."""
    table = pq.read_table(path)
    if "reason" in table.column_names:
        return [Failure(row["id"], row["task_id"], row["env"], row["reason"] or "",
                        json.loads(row["conversations"] or "[]")) for row in table.to_pylist()]
    # Records: the task is known by its description; upstream ids carry no task id.
    return [Failure(row["id"], json.loads(row["meta"] or "{}").get("task_id") or row["task"], row["env"],
                    "unsuccessful_record", row["conversations"])
            for row in table.to_pylist() if row.get("success") is False]


@dataclass
class SalvageConfig:
    failures: list[str]                # failures.parquet files, or record files (rows with success false)
    tasks: str                         # the task file the failures were run on
    out: str
    llm: LLMConfig
    max_prefixes: int = 3              # prefixes tried per failure, longest first
    max_calls: int | None = 200        # uncached LLM calls for the whole run
    episode_concurrency: int = 8
    backend: str = "openai"
    agent: AgentConfig = field(default_factory=AgentConfig)
    env_kw: dict[str, dict] = field(default_factory=dict)   # per env name

    def __post_init__(self):
        if self.max_prefixes < 1:
            raise ValueError("max_prefixes must be at least 1")


def salvaged_record(episode: Episode, failure: Failure, prefix_steps: int, kept: list[int],
                    dropped: dict[int, str]) -> dict:
    """The successful episode as a salvage record: its own id, and where its first actions came from
    (`prefix_from`: the indexes of the failure's actions it starts with; `dropped_steps`: the
    failure's steps within the prefix that were left out, with why)."""
    record = dict(episode.record)
    meta = json.loads(record["meta"])
    meta.update(salvaged_from=failure.id, failure_reason=failure.reason, prefix_steps=prefix_steps,
                beneficial_steps=list(range(len(kept))), prefix_from=kept,
                dropped_steps={str(i): reason for i, reason in sorted(dropped.items())},
                failed_steps=len(failure.actions))
    record.update(id=f"{failure.id}~p{prefix_steps}" if failure.id.startswith("synthetic/")
                  else f"synthetic/{failure.id.replace('/', '_')}~p{prefix_steps}",
                  source_id=f"{failure.id}~p{prefix_steps}", meta=json.dumps(meta, sort_keys=True, ensure_ascii=False))
    return record


async def salvage_async(config: SalvageConfig) -> dict:
    from trajforge.pipeline.envs.tasks import load_tasks

    tasks = load_tasks(config.tasks)
    failures = [f for path in config.failures for f in read_failures(path)]
    job = with_episode_journal(ModelJob.open(Path(config.out) / ".salvage", config.backend, config.llm, "episodes",
                                             config.episode_concurrency))
    salvager = _Salvager(config, job, tasks)
    try:
        results = await asyncio.gather(*(salvager.salvage(f) for f in failures))
    finally:
        await job.close()
    return _write_salvage(config, job, salvager.budget, results)


def _unsalvageable(failure: Failure, task: Any, tasks_path: str) -> tuple[str, str] | None:
    """(outcome, detail) of a failure that cannot be salvaged whatever its replay gives; None when it may be."""
    if failure.env not in replayable_envs():
        return "env_not_replayable", f"env {failure.env}"
    if failure.reason.startswith(NOT_TASK_FAILURES):
        return "not_a_task_failure", failure.reason
    if task is None:
        return "no_task", f"{failure.task_id[:200]} is not in {tasks_path}"
    if len(failure.actions) < 2:
        return "no_prefix", f"{len(failure.actions)} action(s)"
    return None


def distinct_prefixes(verdicts: list[str | None]) -> list[tuple[int, list[int]]]:
    """(k, the indexes kept among the first k steps) for k = n..1, longest first, without the dropped steps
    (a step with a verdict); two k that keep the same steps are one prefix, and a prefix keeps at least one."""
    prefixes: list[tuple[int, list[int]]] = []
    for k in range(len(verdicts), 0, -1):
        kept = [i for i in range(k) if verdicts[i] is None]
        if kept and (not prefixes or prefixes[-1][1] != kept):
            prefixes.append((k, kept))
    return prefixes


class _Salvager:
    """Salvage of one failure after another: its replay without a model, then its prefixes continued by the model."""

    def __init__(self, config: SalvageConfig, job: ModelJob, tasks: list[Any]):
        self.config = config
        self.job = job
        self.budget = CallBudget(job.backend, config.max_calls)
        self.by_id = {t.id: t for t in tasks}
        self.by_description = {_space(t.description): t for t in tasks}

    def env_maker(self, task: Any) -> Callable[[], Any]:
        from trajforge.pipeline.synth.envs import make_env

        return lambda: make_env(task.env, **self.config.env_kw.get(task.env, {}))

    async def replay(self, task: Any, actions: list[str]) -> list[ReplayedStep]:
        async with self.job.gate:
            return await asyncio.to_thread(replay_actions, self.env_maker(task), task, actions, self.budget.redact)

    async def attempt(self, task: Any, prefix: list[dict]) -> Episode:
        """The model's continuation of `prefix` (from the journal when an earlier run finished it)."""
        # The prefix is part of the key: the same continuation of a different prefix is another episode.
        key = episode_key(task, 0, self.budget.model, {**self.budget.params, "salvage_prefix": prefix},
                          self.config.agent)

        async def run() -> Episode:
            return await run_episode(self.budget, self.env_maker(task), task, 0, self.config.agent, prefix=prefix)

        return await self.job.journaled(key, run, keep=lambda episode: not episode.transient)

    async def salvage(self, failure: Failure) -> tuple[dict, dict | None]:
        """The failure's outcome row, and its salvaged record (None when there is none)."""
        row = {"id": failure.id, "task_id": failure.task_id, "env": failure.env, "failure_reason": failure.reason,
               "outcome": "", "detail": "", "steps": len(failure.actions), "prefixes_tried": 0,
               "prefix_steps": None, "record_id": None, "dropped_steps": None, "replay_mismatch": None}
        task = self.by_id.get(failure.task_id) or self.by_description.get(_space(failure.task_id))
        refused = _unsalvageable(failure, task, self.config.tasks)
        if refused is not None:
            return {**row, "outcome": refused[0], "detail": refused[1]}, None
        try:
            replayed = await self.replay(task, [a["action"] for a in failure.actions[:-1]])
        except Exception as exc:  # the env's failure, not the record's: the next run tries again
            detail = self.budget.redact(f"replay: {type(exc).__name__}: {exc}")[:1000]
            return {**row, "outcome": "transient", "detail": detail}, None
        mismatch = first_mismatch(failure.observations, [step.observation for step in replayed])
        agreeing = mismatch[0] if mismatch else len(replayed)
        row["replay_mismatch"] = mismatch[1] if mismatch else None
        if agreeing == 0:
            return {**row, "outcome": "replay_mismatch", "detail": mismatch[1]}, None
        verdicts = [step.verdict for step in replayed[:agreeing]]
        prefixes = distinct_prefixes(verdicts)
        if not prefixes:
            dropped = ", ".join(f"{i}: {v}" for i, v in enumerate(verdicts))
            return {**row, "outcome": "no_useful_prefix", "detail": f"steps {dropped}"}, None
        return await self.try_prefixes(failure, task, row, verdicts, prefixes[:self.config.max_prefixes])

    async def try_prefixes(self, failure: Failure, task: Any, row: dict, verdicts: list[str | None],
                           prefixes: list[tuple[int, list[int]]]) -> tuple[dict, dict | None]:
        """Each prefix continued by the model in turn, until one succeeds with a replay that matches the record."""
        actions, recorded = failure.actions, failure.observations
        last_failure, mismatched = "", 0
        for k, kept in prefixes:
            episode = await self.attempt(task, [actions[i] for i in kept])
            row["prefixes_tried"] += 1
            dropped = {i: verdicts[i] for i in range(k) if verdicts[i] is not None}
            if episode.status == "success":
                again = first_mismatch([recorded[i] for i in kept], episode_prefix_observations(episode, len(kept)))
                if again is not None:
                    # A dropped step had an effect after all, or the env is not deterministic here.
                    row["replay_mismatch"] = f"prefix of {k} actions, kept {kept}: {again[1]}"
                    last_failure, mismatched = f"k={k}: replay_mismatch", mismatched + 1
                    continue
                record = salvaged_record(episode, failure, k, kept, dropped)
                return {**row, "outcome": "salvaged", "prefix_steps": k, "dropped_steps": len(dropped),
                        "record_id": record["id"]}, record
            if episode.reason == "llm_error:budget_exhausted":
                return {**row, "outcome": "budget_exhausted", "detail": f"at the prefix of {k} actions"}, None
            if episode.transient:
                return {**row, "outcome": "transient", "detail": f"{episode.reason}: {episode.detail}"[:1000]}, None
            last_failure = f"k={k}: {episode.reason}"
        if mismatched == row["prefixes_tried"]:
            return {**row, "outcome": "replay_mismatch", "detail": row["replay_mismatch"]}, None
        return {**row, "outcome": "no_prefix_succeeded", "detail": last_failure}, None


def _write_salvage(config: SalvageConfig, job: ModelJob, budget: CallBudget,
                   results: list[tuple[dict, dict | None]]) -> dict:
    """The salvaged records per env, the outcome rows and the report (returned)."""
    out = Path(config.out)
    rows = [row for row, _ in results]
    records_by_env = _write_records(out, [record for _, record in results if record is not None])
    write_parquet(rows, arrow_schema("salvage_outcomes"), out / "salvage.parquet")
    report = {**_outcome_counts(rows, records_by_env),
              "episodes_run": job.counts["run"], "episodes_resumed": job.counts["resumed"],
              "budget": {"max_calls": config.max_calls, "spent": budget.spent, "refused": budget.refused,
                         "max_prefixes": config.max_prefixes},
              "llm": job.llm_report()}
    write_json(out / "report.json", report)
    log.info("salvage: %d failures %s; %d records; %d calls (budget %s), %d cache hits", len(rows),
             report["outcomes"], report["records"], job.stats.calls, config.max_calls, job.stats.cache_hits)
    return report


def _write_records(out: Path, records: list[dict]) -> dict[str, list[dict]]:
    """The salvaged records, one file per env (an env's earlier file is rewritten, emptied when none is left)."""
    records_by_env: dict[str, list[dict]] = {}
    for record in records:
        records_by_env.setdefault(record["env"], []).append(record)
    for env in replayable_envs():
        path = out / "data" / "synthetic" / f"{env}.parquet"
        if env in records_by_env or path.exists():
            write_parquet(records_by_env.get(env, []), arrow_schema("trajectory"), path)
    return records_by_env


def _outcome_counts(rows: list[dict], records_by_env: dict[str, list[dict]]) -> dict:
    """The report's counts of outcomes, records and steps."""
    salvaged = [r for r in rows if r["outcome"] == "salvaged"]
    salvaged_meta = [json.loads(r["meta"]) for v in records_by_env.values() for r in v]
    return {
        "failures": len(rows), "outcomes": dict(sorted(Counter(r["outcome"] for r in rows).items())),
        "records": sum(len(v) for v in records_by_env.values()),
        "records_per_env": {env: len(v) for env, v in sorted(records_by_env.items())},
        "beneficial_steps": sum(len(m["prefix_from"]) for m in salvaged_meta),
        "steps_in_salvaged_failures": sum(r["steps"] for r in salvaged),
        "dropped_steps": dict(sorted(Counter(v for m in salvaged_meta for v in m["dropped_steps"].values()).items())),
        "replay_mismatches": sum(r["replay_mismatch"] is not None for r in rows),
        "prefixes_tried": sum(r["prefixes_tried"] for r in rows),
    }


def salvage(config: SalvageConfig) -> dict:
    """Salvage every failure (blocking); see the module docstring for the outputs."""
    return asyncio.run(salvage_async(config))
