"""The synthesis flow: tasks x N samples through the agent loop (pipeline/synth/job.py does the work).

The API key is deliberately not a flow parameter: Prefect stores parameters in its database and
shows them in the UI. The job reads it from the environment (`api_key_env`, or
TRAJFORGE_API_KEY / OPENAI_API_KEY) inside the task.
"""
from __future__ import annotations

import os
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.states import Failed, State

from trajforge.flows.artifacts import Progress, synth_artifacts
from trajforge.flows.config import SYNTH, merge, synth_config
from trajforge.flows.limits import model_api_limit
from trajforge.flows.names import synth_run_name
from trajforge.pipeline.llm.client import LLMConfig, ServerUnreachable
from trajforge.pipeline.synth.config import SynthConfig
from trajforge.pipeline.synth.job import synthesize as run_synthesis


def use_api_key_env(llm: LLMConfig, api_key_env: str | None) -> None:
    """Set the key from `api_key_env` (inside a task, so that it never becomes a flow parameter)."""
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"environment variable {api_key_env} is not set")
        llm.api_key = key


@task(name="synthesize-episodes")
def synthesize_episodes(config: SynthConfig, api_key_env: str | None) -> dict:
    use_api_key_env(config.llm, api_key_env)
    try:
        return run_synthesis(config, Progress("synth-progress", f"Episodes finished ({config.env})"))
    except ServerUnreachable as exc:
        # An outcome the user acts on (start the server, rerun), not a bug: a failed run with the
        # message, without a traceback.
        return Failed(message=exc.detail, data=exc)


@flow(name="synthesize", log_prints=True, flow_run_name=synth_run_name)
def synthesize(tasks: str | None = None, env: str | None = None, model: str | None = None, out: str | None = None,
               base_url: str | None = None, n: int | None = None, keep: str | None = None,
               concurrency: int | None = None, episode_concurrency: int | None = None, max_turns: int | None = None,
               max_tokens: int | None = None, seed: int | None = None, sampling: dict[str, Any] | None = None,
               backend: str | None = None, api_key_env: str | None = None, license: str | None = None,
               env_kw: dict[str, Any] | None = None, timeout_s: float | None = None, max_retries: int | None = None,
               max_connection_failures: int | None = None, api_limit: str | None = None,
               api_rate_limit: str | None = None, api_limit_strict: bool = False, search: str | None = None,
               branch: int | None = None, max_calls: int | None = None, max_task_tokens: int | None = None,
               value_model: str | None = None, config: dict[str, Any] | None = None) -> dict | State:
    """Synthesize trajectories for the tasks of one env; writes OUT/data/synthetic/<env>.parquet and OUT/failures.parquet.

    `config` is a synth config (the shape of `pipeline.synth.config.SynthConfig`, as in
    configs/synth.yaml); the other parameters override it where given, and what neither sets keeps
    the dataclasses' default. tasks, env, model and out are required in one or the other.

    `search` grows a tree per task instead of N independent episodes (pipeline/synth/search.py), with
    `branch` proposals per state and `max_calls` / `max_task_tokens` per task.

    `api_limit` / `api_rate_limit` name Prefect global concurrency / rate limits held around every
    request to the model API, shared with every other run that names them (flows/limits.py);
    `api_limit_strict` fails the run when one does not exist instead of running without it.
    """
    logger = get_run_logger()
    given = SYNTH.nested(dict(tasks=tasks, env=env, model=model, out=out, base_url=base_url, n=n, keep=keep,
                        concurrency=concurrency, episode_concurrency=episode_concurrency, max_turns=max_turns,
                        max_tokens=max_tokens, seed=seed, sampling=sampling, backend=backend, license=license,
                        env_kw=env_kw, timeout_s=timeout_s, max_retries=max_retries,
                        max_connection_failures=max_connection_failures, search=search, branch=branch,
                        max_calls=max_calls, max_task_tokens=max_task_tokens, value_model=value_model))
    job = synth_config(merge(config or {}, given), "synth config")
    job.llm.request_gate = model_api_limit(api_limit, api_rate_limit, strict=api_limit_strict)
    env, out = job.env, job.out
    state = synthesize_episodes(job, api_key_env, return_state=True)
    if state.is_failed():
        return state
    report = state.result()
    logger.info("%s: %d/%d tasks with a record, %d records, %d failures %s; %d LLM calls answered of %d attempts, "
                "%d cache hits", env, report["tasks_with_record"], report["tasks"], report["records"],
                report["failures"], report["failure_reasons"], report["llm"]["calls"], report["llm"]["attempts"],
                report["llm"]["cache_hits"])
    synth_artifacts(report, out)
    return report
