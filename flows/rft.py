"""The rejection-sampling fine-tuning loop as one flow: build -> SFT -> serve -> synthesize -> keep -> build.

Each round rebuilds the dataset from the sources plus every success kept so far (the real build
flow, as a subflow), fine-tunes the base model on it (the SFT launcher, any config and overrides),
serves the checkpoint with an OpenAI-compatible server (`transformers serve` on CPU, `vllm serve`
on a GPU), runs the synthesis job on the held-out tasks against it, and keeps the successes. A
last build holds the successes of the final round. `OUT/report.json` lists the rounds with their
success rates.

Layout: OUT/round-N/{build,model,synth}, OUT/kept (the `synthetic` source of kept successes),
OUT/final (the last build), OUT/report.json.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task

from trajforge.flows.build import build_dataset
from trajforge.flows.limits import model_api_limit
from trajforge.flows.synth import use_api_key_env
from trajforge.pipeline.atomic import write_json
from trajforge.pipeline.synth.agent import AgentConfig
from trajforge.pipeline.synth.llm import LLMConfig
from trajforge.pipeline.rft import keep_successes, round_summary, serve_command, serving
from trajforge.pipeline.synth.job import SynthConfig, synthesize


@task(name="rft-train-sft")
def train_sft(base_model: str, dataset: str, output_dir: str, sft_args: list[str]) -> dict:
    from trajforge.training.sft import main as sft_main  # torch and TRL: the `train` extra, imported only here

    return sft_main([*sft_args, "--model_name_or_path", base_model, "--dataset_name", dataset,
                     "--output_dir", output_dir])


@task(name="rft-serve-and-synthesize")
def serve_and_synthesize(model_dir: str, command: list[str], config: SynthConfig,
                         startup_timeout_s: float, api_key_env: str | None) -> dict:
    use_api_key_env(config.llm, api_key_env)
    with serving(model_dir, command, startup_timeout_s) as base_url:
        config.llm.base_url = base_url
        return synthesize(config)


@flow(name="rft")
def rft(sources: dict[str, str | None], tasks: str, env: str, base_model: str, out: str, rounds: int = 2,
        sft_args: list[str] | None = None, serve: str | list[str] = "transformers", n: int = 4,
        max_turns: int = 8, max_tokens: int | None = None, concurrency: int = 16, startup_timeout_s: float = 600.0,
        sampling: dict | None = None, api_key_env: str | None = None, api_limit: str | None = None,
        api_rate_limit: str | None = None, api_limit_strict: bool = False) -> dict:
    """ROUNDS rounds of build -> SFT -> serve -> synthesize on TASKS -> keep successes; see the module docstring.

    `api_limit` / `api_rate_limit` name the Prefect global concurrency / rate limits the model API
    calls share with every other run that names them, as in the synthesis flow (flows/limits.py).
    """
    command = serve_command(serve)  # a server name no registry entry has fails here, before any round
    gate = model_api_limit(api_limit, api_rate_limit, strict=api_limit_strict)
    logger = get_run_logger()
    root = Path(out)
    kept = root / "kept"
    report: dict = {"base_model": base_model, "env": env, "tasks": tasks, "serve": command, "rounds": []}

    def build(folder: Path) -> dict:
        with_kept = dict(sources)
        if (kept / "data" / "synthetic").is_dir():
            with_kept["synthetic"] = str(kept)
        return build_dataset(sources=with_kept, out=str(folder))

    for round_no in range(1, rounds + 1):
        folder = root / f"round-{round_no}"
        built = build(folder / "build")
        metrics = train_sft(base_model, str(folder / "build"), str(folder / "model"), list(sft_args or []))
        llm = LLMConfig(model=str((folder / "model").resolve()), sampling=dict(sampling or {}), concurrency=concurrency,
                        request_gate=gate)
        config = SynthConfig(tasks=tasks, env=env, out=str(folder / "synth"), n=n, llm=llm,
                             agent=AgentConfig(max_turns=max_turns, max_tokens=max_tokens))
        synthesized = serve_and_synthesize(str((folder / "model").resolve()), command, config, startup_timeout_s,
                                           api_key_env)
        added = keep_successes(folder / "synth", env, kept, round_no)
        summary = round_summary(round_no, built, metrics, synthesized, added)
        report["rounds"].append(summary)
        logger.info("round %d: %d/%d held-out tasks solved (%.1f%%), %d records kept, train loss %s", round_no,
                    summary["tasks_solved"], summary["tasks"], 100 * (summary["success_rate"] or 0), added,
                    summary["train_loss"])
    final = build(root / "final")
    report["final_build"] = {"records": final["total"]["written"],
                             "synthetic_records": final["sources"].get("synthetic", {}).get("written", 0)}
    report["records_kept"] = sum(r["records_kept"] for r in report["rounds"])
    write_json(root / "report.json", report)
    return report
