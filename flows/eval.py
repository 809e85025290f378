"""The evaluation flow: a model (behind any OpenAI-compatible server, or a checkpoint served for the
run) on the held-out split of each env, with the oracle and random policies as calibration
(pipeline/evaluation does the work). Files eval.json, report.html and a results-table row per
(model, env); the run's artifacts show the table and link the report.

The API key is not a flow parameter (Prefect stores those): it is read from `api_key_env` or
TRAJFORGE_API_KEY / OPENAI_API_KEY inside the task, as in the synthesis flow.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from trajforge.flows.config import EVAL
from trajforge.flows.limits import model_api_limit
from trajforge.flows.synth import use_api_key_env
from trajforge.pipeline.evaluation.run import EvalConfig
from trajforge.pipeline.evaluation.run import evaluate as run_evaluation
from trajforge.pipeline.evaluation.splits import EVAL_SPLITS
from trajforge.pipeline.synth.config import SERVE_STARTUP_TIMEOUT_S


@task(name="evaluate-episodes")
def evaluate_episodes(config: EvalConfig, api_key_env: str | None, serve: list[str] | None,
                      startup_timeout_s: float) -> dict:
    if config.llm is not None:
        use_api_key_env(config.llm, api_key_env)
    if serve is None:
        return run_evaluation(config)
    from trajforge.pipeline.rft import serving

    with serving(config.llm.model, serve, startup_timeout_s, log_path=Path(config.out) / "serve.log") as base_url:
        config.llm.base_url = base_url
        return run_evaluation(config)


def summary_rows(report: dict) -> list[dict]:
    rows = []
    for env, e in report["envs"].items():
        for who, s in [("model", e.get("model")), *e["policies"].items()]:
            if s is not None:
                rows.append({"env": env, "split": e["split"], "policy": report["label"] if who == "model" else who,
                             "episodes": s["episodes"], "success_rate": s["success_rate"],
                             "success_ci95": str(s["success_ci95"]), "mean_score": s["mean_score"],
                             "pass_at_k": str(s["pass_at_k"]), "outcomes": str(s["outcomes"]),
                             "broken_env": bool(e.get("broken"))})
    return rows


def eval_artifacts(report: dict, out: str) -> None:
    rows = summary_rows(report)
    create_table_artifact(rows or [{"env": "-"}], key="eval-results",
                          description=f"Success per env: {report['label']}, oracle and random")
    lines = [f"# Eval `{report['label']}`", ""]
    lines += [f"- **{r['env']}** ({r['split']}) {r['policy']}: success {r['success_rate']} {r['success_ci95']}"
              for r in rows]
    lines += [f"- **{env}** not run: {why}" for env, why in report["not_run"].items()]
    lines += [f"- WARNING: {w}" for w in report.get("warnings", [])]
    create_markdown_artifact("\n".join(lines), key="eval-summary", description="Eval summary")
    html = Path(out, "report.html").resolve()
    if html.exists():
        create_link_artifact(html.as_uri(), link_text="report.html", key="eval-report",
                             description="The eval report (plots) on the worker's disk")


@flow(name="evaluate", log_prints=True)
def evaluate(out: str, envs: list[str] | None = None, model: str | None = None, base_url: str | None = None,
             label: str | None = None, tasks: dict[str, str] | None = None, n: int | None = None,
             calibrate: list[str] | None = None, max_turns: int | None = None, max_tokens: int | None = None,
             seed: int | None = None, sampling: dict[str, Any] | None = None, concurrency: int | None = None,
             episode_concurrency: int | None = None, timeout_s: float | None = None, max_retries: int | None = None,
             env_kw: dict[str, dict] | None = None, results: str | None = None, train_data: str | None = None,
             allow_overlap: bool | None = None, serve: list[str] | None = None,
             startup_timeout_s: float = SERVE_STARTUP_TIMEOUT_S, backend: str | None = None,
             api_key_env: str | None = None, api_limit: str | None = None, api_rate_limit: str | None = None,
             exclude: list[str] | None = None) -> dict:
    """Evaluate MODEL (or, with `serve`, the checkpoint folder MODEL served for the run) on ENVS'
    held-out splits (default: every declared split); see pipeline/evaluation/run.py for the outputs.
    A parameter left None keeps `EvalConfig`'s default (flows/config.py: EVAL places each); without
    a model only the calibration policies run."""
    logger = get_run_logger()
    config = EVAL.config_of(dict(
        out=out, envs=list(envs or EVAL_SPLITS), model=model, base_url=base_url, label=label, tasks=tasks, n=n,
        calibrate=calibrate, max_turns=max_turns, max_tokens=max_tokens, seed=seed, sampling=sampling,
        concurrency=concurrency, episode_concurrency=episode_concurrency, timeout_s=timeout_s,
        max_retries=max_retries, env_kw=env_kw, results=results, train_data=train_data, allow_overlap=allow_overlap,
        backend=backend, exclude=exclude), "evaluate")
    if model is None:
        config.llm = None
    else:
        config.llm.request_gate = model_api_limit(api_limit, api_rate_limit)
    report = evaluate_episodes(config, api_key_env, serve, startup_timeout_s)
    for row in summary_rows(report):
        logger.info("%s %s: success %s %s, outcomes %s", row["env"], row["policy"], row["success_rate"],
                    row["success_ci95"], row["outcomes"])
    eval_artifacts(report, out)
    return report
