"""The critical-step selection flow (pipeline/quality/critical_steps.py does the work).

As in the synthesis flow, the API key is not a parameter (Prefect stores and shows parameters):
it is read from the environment inside the task.
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from trajforge.flows.config import SELECT_STEPS
from trajforge.flows.limits import model_api_limit
from trajforge.flows.synth import use_api_key_env
from trajforge.pipeline.quality.critical_steps import SelectConfig, summary_lines
from trajforge.pipeline.quality.critical_steps import select_steps as run_selection


@task(name="select-critical-steps")
def select_critical_steps(config: SelectConfig, api_key_env: str | None) -> dict:
    use_api_key_env(config.llm, api_key_env)
    return run_selection(config)


@flow(name="select-steps", log_prints=True)
def select_steps(inputs: str, out: str, model: str, base_url: str | None = None, config_name: str | None = None,
                 concurrency: int | None = None, batch_size: int | None = None, max_tokens: int | None = None,
                 sampling: dict[str, Any] | None = None, backend: str | None = None, api_key_env: str | None = None,
                 envs: list[str] | None = None, api_limit: str | None = None, api_rate_limit: str | None = None,
                 api_limit_strict: bool = False) -> dict:
    """Flag the critical steps of every record under INPUTS (ATLaS); writes OUT with the same layout.

    A parameter left None keeps `SelectConfig`'s default (flows/config.py: SELECT_STEPS places each).
    `api_limit` / `api_rate_limit` name the Prefect global concurrency / rate limits the model API
    calls share with every other run that names them, as in the synthesis flow (flows/limits.py).
    """
    gate = model_api_limit(api_limit, api_rate_limit, strict=api_limit_strict)
    config = SELECT_STEPS.config_of(dict(
        inputs=inputs, out=out, model=model, base_url=base_url, config_name=config_name, concurrency=concurrency,
        batch_size=batch_size, max_tokens=max_tokens, sampling=sampling, backend=backend, envs=envs), "select-steps")
    config.llm.request_gate = gate
    report = select_critical_steps(config, api_key_env)
    logger = get_run_logger()
    for line in summary_lines(report):
        logger.info(line)
    return report
