"""The synthesis flow: tasks x N samples through the agent loop (pipeline/synth.py does the work).

The API key is deliberately not a flow parameter: Prefect stores parameters in its database and
shows them in the UI. The job reads it from the environment (`api_key_env`, or
TRAJFORGE_API_KEY / OPENAI_API_KEY) inside the task.
"""
from __future__ import annotations

import os
from typing import Any

from prefect import flow, get_run_logger, task

from pipeline.agent import AgentConfig
from pipeline.llm import LLMConfig
from pipeline.synth import SynthConfig
from pipeline.synth import synthesize as run_synthesis


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
    return run_synthesis(config)


@flow(name="synthesize", log_prints=True)
def synthesize(tasks: str, env: str, model: str, out: str, base_url: str | None = None, n: int = 4,
               keep: str = "best", concurrency: int = 64, episode_concurrency: int = 16, max_turns: int = 8,
               max_tokens: int | None = None, seed: int | None = None, sampling: dict[str, Any] | None = None,
               backend: str = "openai", api_key_env: str | None = None, license: str = "other",
               env_kw: dict[str, Any] | None = None) -> dict:
    """Synthesize trajectories for the tasks of one env; writes OUT/data/synthetic/<env>.parquet and OUT/failures.parquet."""
    logger = get_run_logger()
    config = SynthConfig(
        tasks=tasks, env=env, out=out, n=n, keep=keep, episode_concurrency=episode_concurrency, backend=backend,
        llm=LLMConfig(model=model, base_url=base_url, sampling=dict(sampling or {}), concurrency=concurrency),
        agent=AgentConfig(max_turns=max_turns, max_tokens=max_tokens, seed=seed, license=license),
        env_kw=dict(env_kw or {}))
    report = synthesize_episodes(config, api_key_env)
    logger.info("%s: %d/%d tasks with a record, %d records, %d failures %s; %d LLM calls, %d cache hits",
                env, report["tasks_with_record"], report["tasks"], report["records"], report["failures"],
                report["failure_reasons"], report["llm"]["calls"], report["llm"]["cache_hits"])
    return report
