"""The rejection-sampling fine-tuning loop as one flow: build -> SFT -> serve -> synthesize -> keep -> build.

Each round rebuilds the dataset from the sources plus every success kept so far (the real build
flow, as a subflow), fine-tunes the base model on it (the SFT launcher, any config and overrides),
serves the checkpoint with an OpenAI-compatible server (`transformers serve` on CPU, `vllm serve`
on a GPU), runs the synthesis job on the round tasks against it, keeps the successes, and, with the
same server, evaluates the checkpoint with `trajforge eval` on a split it does not train on
(`eval_tasks`, or the env's declared split without the round tasks). A last build holds the
successes of the final round. `OUT/report.json` lists the rounds and the curve: success on the
round tasks, on the held-out split, and the data each round added.

Layout: OUT/round-N/{build,model,synth,eval}, OUT/kept (the `synthetic` source of kept successes),
OUT/final (the last build), OUT/report.json.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefect import flow, get_run_logger, task

from trajforge.flows.build import build_dataset
from trajforge.flows.config import RFT
from trajforge.flows.limits import model_api_limit
from trajforge.flows.synth import use_api_key_env
from trajforge.pipeline.atomic import write_json
from trajforge.pipeline.envs.tasks import load_tasks
from trajforge.pipeline.evaluation.run import EvalConfig, evaluate
from trajforge.pipeline.evaluation.splits import EVAL_SPLITS
from trajforge.pipeline.rft import keep_successes, round_summary, serve_command, serving
from trajforge.pipeline.synth.config import AgentConfig
from trajforge.pipeline.synth.job import SynthConfig, synthesize


@task(name="rft-train-sft")
def train_sft(base_model: str, dataset: str, output_dir: str, sft_args: list[str]) -> dict:
    from trajforge.training.sft import main as sft_main  # torch and TRL: the `train` extra, imported only here

    return sft_main([*sft_args, "--model_name_or_path", base_model, "--dataset_name", dataset,
                     "--output_dir", output_dir])


@task(name="rft-serve-and-synthesize")
def serve_and_synthesize(model_dir: str, command: list[str], config: SynthConfig,
                         startup_timeout_s: float, api_key_env: str | None,
                         held_out: EvalConfig | None = None) -> tuple[dict, dict | None]:
    """The round's synthesis report and, with `held_out`, its eval on the held-out split (one server for both)."""
    use_api_key_env(config.llm, api_key_env)
    with serving(model_dir, command, startup_timeout_s) as base_url:
        config.llm.base_url = base_url
        synthesized = synthesize(config)
        if held_out is None:
            return synthesized, None
        held_out.llm = replace(config.llm, base_url=base_url)
        return synthesized, evaluate(held_out)


def held_out_eval(env: str, tasks: str, eval_tasks: str | None, out: Path, n: int, agent: AgentConfig) -> EvalConfig | None:
    """The eval of a round: `eval_tasks`, or the env's declared split without the tasks RFT trains on
    (its round tasks); None when the env has neither."""
    if eval_tasks is None and env not in EVAL_SPLITS:
        return None
    exclude = () if eval_tasks else tuple(t.description for t in load_tasks(tasks) if t.env == env)
    return EvalConfig(out=str(out), envs=[env], tasks={env: eval_tasks} if eval_tasks else {}, n=n, calibrate=(),
                      agent=agent, exclude=exclude)


@flow(name="rft")
def rft(tasks: str, env: str, base_model: str, out: str, sources: dict[str, str | None] | None = None,
        rounds: int | None = None, sft_args: list[str] | None = None, serve: str | list[str] | None = None,
        n: int | None = None, max_turns: int | None = None, max_tokens: int | None = None,
        concurrency: int | None = None, startup_timeout_s: float | None = None, sampling: dict | None = None,
        api_key_env: str | None = None, eval_tasks: str | None = None, eval_n: int | None = None,
        api_limit: str | None = None, api_rate_limit: str | None = None, api_limit_strict: bool = False) -> dict:
    """ROUNDS rounds of build -> SFT -> serve -> synthesize on TASKS -> keep successes; see the module docstring.

    A parameter left None keeps `RFTConfig`'s default (flows/config.py: RFT places each).
    `api_limit` / `api_rate_limit` name the Prefect global concurrency / rate limits the model API
    calls share with every other run that names them, as in the synthesis flow (flows/limits.py).
    """
    config = RFT.config_of(dict(
        tasks=tasks, env=env, base_model=base_model, out=out, sources=sources, rounds=rounds, sft_args=sft_args,
        serve=serve, n=n, max_turns=max_turns, max_tokens=max_tokens, concurrency=concurrency,
        startup_timeout_s=startup_timeout_s, sampling=sampling, eval_tasks=eval_tasks, eval_n=eval_n), "rft")
    command = serve_command(config.serve)  # a server name no registry entry has fails here, before any round
    gate = model_api_limit(api_limit, api_rate_limit, strict=api_limit_strict)
    logger = get_run_logger()
    root = Path(out)
    kept = root / "kept"
    report: dict = {"base_model": base_model, "env": env, "tasks": tasks, "serve": command, "rounds": []}

    train_texts = [t.description for t in load_tasks(tasks)]

    def build(folder: Path) -> dict:
        with_kept = dict(config.sources)
        if (kept / "data" / "synthetic").is_dir():
            with_kept["synthetic"] = str(kept)
        # The round tasks are trained on; the rest of their env's eval split stays held out.
        return build_dataset(sources=with_kept, out=str(folder), stages={"decontaminate_except": train_texts})

    for round_no in range(1, config.rounds + 1):
        folder = root / f"round-{round_no}"
        built = build(folder / "build")
        metrics = train_sft(base_model, str(folder / "build"), str(folder / "model"), config.sft_args)
        llm = replace(config.llm, model=str((folder / "model").resolve()), request_gate=gate)
        job = SynthConfig(tasks=tasks, env=env, out=str(folder / "synth"), n=config.n, llm=llm, agent=config.agent)
        held_out = held_out_eval(env, tasks, config.eval_tasks, folder / "eval", config.eval_n, config.agent)
        synthesized, evaluated = serve_and_synthesize(str((folder / "model").resolve()), command, job,
                                                      config.startup_timeout_s, api_key_env, held_out)
        added = keep_successes(folder / "synth", env, kept, round_no)
        summary = round_summary(round_no, built, metrics, synthesized, added, evaluated)
        report["rounds"].append(summary)
        logger.info("round %d: %d/%d round tasks solved (%.1f%%), held-out success %s, %d records kept, train loss %s",
                    round_no, summary["tasks_solved"], summary["tasks"], 100 * (summary["success_rate"] or 0),
                    summary["heldout_success"], added, summary["train_loss"])
    final = build(root / "final")
    report["final_build"] = {"records": final["total"]["written"],
                             "synthetic_records": final["sources"].get("synthetic", {}).get("written", 0)}
    report["records_kept"] = sum(r["records_kept"] for r in report["rounds"])
    # The learning curve: success on the tasks the rounds train on, on the held-out split, and data added.
    report["curve"] = [{k: r[k] for k in ("round", "train_success", "heldout_success", "data_added")}
                       for r in report["rounds"]]
    write_json(root / "report.json", report)
    return report
