"""The salvage flow: replay prefixes of failed runs and keep the continuations that succeed
(pipeline/synth/salvage.py does the work). The API key is read from the environment, never a parameter."""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from trajforge.flows.limits import model_api_limit
from trajforge.flows.synth import use_api_key_env
from trajforge.pipeline.llm.client import LLMConfig
from trajforge.pipeline.synth.agent import AgentConfig
from trajforge.pipeline.synth.salvage import SalvageConfig
from trajforge.pipeline.synth.salvage import salvage as run_salvage


@task(name="salvage-failures")
def salvage_failures(config: SalvageConfig, api_key_env: str | None) -> dict:
    use_api_key_env(config.llm, api_key_env)
    return run_salvage(config)


@flow(name="salvage", log_prints=True)
def salvage(failures: list[str], tasks: str, out: str, model: str, base_url: str | None = None,
            max_prefixes: int = 3, max_calls: int | None = 200, concurrency: int = 64, episode_concurrency: int = 8,
            max_turns: int = 8, max_tokens: int | None = None, sampling: dict[str, Any] | None = None,
            backend: str = "openai", api_key_env: str | None = None, license: str = "other",
            api_limit: str | None = None, api_rate_limit: str | None = None, api_limit_strict: bool = False) -> dict:
    """Salvage the failures of FAILURES (failures.parquet or records with success false) on the tasks of TASKS.

    `api_limit` / `api_rate_limit` name the Prefect global concurrency / rate limits the model API
    calls share with every other run that names them, as in the synthesis flow (flows/limits.py).
    """
    gate = model_api_limit(api_limit, api_rate_limit, strict=api_limit_strict)
    config = SalvageConfig(failures=list(failures), tasks=tasks, out=out, max_prefixes=max_prefixes,
                           max_calls=max_calls, episode_concurrency=episode_concurrency, backend=backend,
                           llm=LLMConfig(model=model, base_url=base_url, sampling=dict(sampling or {}),
                                         concurrency=concurrency, request_gate=gate),
                           agent=AgentConfig(max_turns=max_turns, max_tokens=max_tokens, license=license))
    report = salvage_failures(config, api_key_env)
    get_run_logger().info("%d failures %s; %d records, %d beneficial steps; %d LLM calls of a budget of %s",
                          report["failures"], report["outcomes"], report["records"], report["beneficial_steps"],
                          report["llm"]["calls"], max_calls)
    return report
