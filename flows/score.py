"""The scoring flow (pipeline/quality/score.py does the work).

As in the synthesis flow, the judge's API key is not a parameter (Prefect stores and shows
parameters): it is read from the environment inside the task.
"""
from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, task

from trajforge.flows.config import SCORE
from trajforge.flows.synth import use_api_key_env
from trajforge.pipeline.quality.score import ScoreConfig, score_records, summary_lines


@task(name="score-records")
def score_task(config: ScoreConfig, api_key_env: str | None) -> dict:
    if config.llm is not None:
        use_api_key_env(config.llm, api_key_env)
    return score_records(config)


@flow(name="score", log_prints=True)
def score(inputs: str, out: str, scorer: str, model: str, min_score: float | None = None,
          config_name: str | None = None, batch_size: int | None = None, max_length: int | None = None,
          base_url: str | None = None, concurrency: int | None = None, sampling: dict[str, Any] | None = None,
          max_calls: int | None = None, max_tokens: int | None = None, backend: str | None = None,
          api_key_env: str | None = None) -> dict:
    """Score every record under INPUTS with a reward model or an LLM judge; writes OUT (module doc of
    pipeline.quality.score), the records below `min_score` in its quarantine as `low_score`.
    A parameter left None keeps `ScoreConfig`'s default (flows/config.py: SCORE places each)."""
    given = dict(inputs=inputs, out=out, scorer=scorer, model=model, min_score=min_score, config_name=config_name,
                 batch_size=batch_size, max_length=max_length, base_url=base_url, concurrency=concurrency,
                 sampling=sampling, max_calls=max_calls, max_tokens=max_tokens, backend=backend)
    # The judge calls a model endpoint (its defaults, the key from the environment); the reward models do not.
    config = SCORE.config_of(given, "score", {"llm": {}} if scorer == "judge" else {})
    report = score_task(config, api_key_env)
    logger = get_run_logger()
    for line in summary_lines(report):
        logger.info(line)
    return report
