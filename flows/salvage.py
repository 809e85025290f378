"""The salvage flow: replay prefixes of failed runs and keep the continuations that succeed
(pipeline/synth/salvage.py does the work). The API key is read from the environment, never a parameter."""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from trajforge.flows.config import SALVAGE
from trajforge.flows.limits import model_api_limit
from trajforge.flows.synth import use_api_key_env
from trajforge.pipeline.synth.salvage import SalvageConfig
from trajforge.pipeline.synth.salvage import salvage as run_salvage


@task(name="salvage-failures")
def salvage_failures(config: SalvageConfig, api_key_env: str | None) -> dict:
    use_api_key_env(config.llm, api_key_env)
    return run_salvage(config)


@flow(name="salvage", log_prints=True)
def salvage(failures: list[str], tasks: str, out: str, model: str, base_url: str | None = None,
            max_prefixes: int | None = None, max_calls: int | None = None, concurrency: int | None = None,
            episode_concurrency: int | None = None, max_turns: int | None = None, max_tokens: int | None = None,
            sampling: dict[str, Any] | None = None, backend: str | None = None, api_key_env: str | None = None,
            license: str | None = None, api_limit: str | None = None, api_rate_limit: str | None = None,
            api_limit_strict: bool = False) -> dict:
    """Salvage the failures of FAILURES (failures.parquet or records with success false) on the tasks of TASKS.

    A parameter left None keeps `SalvageConfig`'s default (flows/config.py: SALVAGE places each).
    `api_limit` / `api_rate_limit` name the Prefect global concurrency / rate limits the model API
    calls share with every other run that names them, as in the synthesis flow (flows/limits.py).
    """
    gate = model_api_limit(api_limit, api_rate_limit, strict=api_limit_strict)
    config = SALVAGE.config_of(dict(
        failures=list(failures), tasks=tasks, out=out, model=model, base_url=base_url, max_prefixes=max_prefixes,
        max_calls=max_calls, concurrency=concurrency, episode_concurrency=episode_concurrency, max_turns=max_turns,
        max_tokens=max_tokens, sampling=sampling, backend=backend, license=license), "salvage")
    config.llm.request_gate = gate
    report = salvage_failures(config, api_key_env)
    get_run_logger().info("%d failures %s; %d records, %d beneficial steps; %d LLM calls of a budget of %s",
                          report["failures"], report["outcomes"], report["records"], report["beneficial_steps"],
                          report["llm"]["calls"], config.max_calls)
    return report
