"""`trajforge` command line: each subcommand parses its arguments and runs a flow.

Arguments are checked, and `--help` answered, before Prefect, the stages or TRL load: only light
modules are imported at the top, the rest inside the command that needs them.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

from trajforge.flows.config import (RUNNERS, SYNTH_PARAMETERS, BuildRun, ConfigError, load_build_run, merge, nested,
                                     read_config, stage_config, synth_config)
from trajforge.pipeline.registry import UnknownName
from trajforge.sources import DEFAULT_SOURCES, REGISTRY, SourceError, UnknownSource, get_source


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show."""

    def _get_help_string(self, action):
        if action.default in (None, [], False):
            return action.help
        return super()._get_help_string(action)


def _source_arg(value: str) -> tuple[str, str | None]:
    name, sep, location = value.partition("=")
    return name, (location or None) if sep else None


def _source_names() -> str:
    return ", ".join(f"{name} ({source.hub_repo or 'a `trajforge synth` output folder'})"
                     for name, source in REGISTRY.items())


def _add_build(sub: argparse._SubParsersAction) -> None:
    # Options that --config can set default to SUPPRESS: given, they override the file; the
    # defaults themselves are BuildRun's (flows/config.py) and the stage configs'.
    p = sub.add_parser("build", help="build the dataset from upstream sources (a Prefect flow)",
                       argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE",
                   help="YAML build config (configs/build.yaml shows every key): out, sources, runner, workers "
                        "and the stages' settings under `stages`; the options below override it")
    p.add_argument("--source", action="append", type=_source_arg, metavar="NAME[=PATH_OR_REPO]",
                   help=f"a source to read (repeatable; replaces the config's sources): NAME alone reads its Hub "
                        f"repo; NAME=PATH a local folder or file (a path that exists, whose first folder exists, or "
                        f"that starts with . / ~); NAME=ORG/REPO another Hub repo. Sources: {_source_names()}. "
                        f"Default: {', '.join(DEFAULT_SOURCES)} from the Hub")
    p.add_argument("--out", help="output folder: new, empty, or an earlier build (rebuilt); required here or in "
                                 "the config")
    p.add_argument("--overwrite", action="store_true",
                   help="build into an --out folder that holds other files (they may be replaced)")
    p.add_argument("--rendering", choices=["native", "react"],
                   help="assistant turn text: upstream wording (native) or Think/Act (react); default: the normalize stage's")
    p.add_argument("--runner", choices=RUNNERS,
                   help="where the per-unit steps run (units, band screens, outputs, shards): local processes "
                        f"or threads, or a Dask / Ray cluster (extras dask, ray); default: {BuildRun.runner}")
    p.add_argument("--workers", type=int, metavar="N",
                   help=f"processes or threads, or workers of a local cluster (default: {BuildRun.workers})")
    p.add_argument("--address",
                   help="cluster address for --runner dask (tcp://host:8786) or ray (ray://host:10001); "
                        "default: start a local cluster")
    p.add_argument("--decontaminate", metavar="FILE",
                   help="evaluation tasks (one per line, or JSON/JSONL strings or {task}); trajectories whose "
                        "task shares a word n-gram (stages.decontaminate_ngram words) with one go to the "
                        "quarantine as `contaminated`")
    p.add_argument("--rl-tasks", action="append", metavar="FILE",
                   help="a task file (AgentBench OS/DB, JSONL of {env, description, ...}; repeatable) whose tasks "
                        "join the `grpo_env` config for multi-turn GRPO")
    p.add_argument("--dedup-threshold", type=float, metavar="J",
                   help="shingle Jaccard similarity from which two trajectories are near duplicates "
                        "(stages.dedup.threshold; default: the dedup stage's)")
    p.set_defaults(func=_run_build)


def _build_run(args: argparse.Namespace) -> BuildRun:
    """The config file (if any) with the given options laid over it."""
    run = load_build_run(args.config) if "config" in args else BuildRun()
    flags = {"out": getattr(args, "out", None), "runner": getattr(args, "runner", None),
             "workers": getattr(args, "workers", None), "address": getattr(args, "address", None)}
    for key, value in flags.items():
        if value is not None:
            setattr(run, key, value)
    run.overwrite = run.overwrite or "overwrite" in args
    if "source" in args:
        run.sources = {}
        for name, location in args.source:
            if name in run.sources:
                raise SourceError(f"--source {name}: given twice; keep one")
            run.sources[name] = location
    if run.out is None:
        raise SourceError("build: no output folder; give --out DIR (or `out:` in the --config file)")
    stages = {"rendering": getattr(args, "rendering", None),
              "dedup": {"threshold": args.dedup_threshold} if "dedup_threshold" in args else {},
              "decontaminate": getattr(args, "decontaminate", None) and os.path.abspath(args.decontaminate),
              "rl_tasks": [os.path.abspath(path) for path in args.rl_tasks] if "rl_tasks" in args else None}
    run.stages = merge(run.stages, {key: value for key, value in stages.items() if value not in (None, {})})
    return run


def _earlier_build(folder: Path) -> bool:
    """A folder that `trajforge build` wrote: its manifest has a build id, or its staging is there
    (a build that has not finished, which a rerun resumes)."""
    from trajforge.pipeline.publish.manifest import MANIFEST

    if (folder / ".staging").is_dir():
        return True
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "build_id" in manifest


def _check_out(out: str, overwrite: bool) -> None:
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise SourceError(f"--out {out}: is a file; give a new or empty folder, or an earlier build")
    if overwrite or not folder.is_dir() or _earlier_build(folder):
        return
    entries = sorted(entry.name for entry in folder.iterdir())
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise SourceError(f"--out {out}: holds files that no trajforge build wrote ({shown}); give a new or "
                          f"empty folder, or add --overwrite to build into it anyway")


def _check_build_args(run: BuildRun) -> None:
    """Every argument is usable (SourceError otherwise): the sources, the output folder, the files."""
    from trajforge.sources.locate import check_source

    for name in run.sources:
        try:
            get_source(name)
        except UnknownSource as exc:
            raise SourceError(f"--source {name}: {exc}") from None
    _check_out(run.out, run.overwrite)
    decontaminate = run.stages.get("decontaminate")
    if decontaminate and not os.path.isfile(decontaminate):
        raise SourceError(f"--decontaminate {decontaminate}: no such file; give a file of evaluation tasks")
    for name, location in (run.sources or dict.fromkeys(DEFAULT_SOURCES)).items():
        check_source(REGISTRY[name], location)


def _run_build(args: argparse.Namespace) -> int:
    run = _build_run(args)
    _check_build_args(run)
    # The stages' settings, checked before Prefect loads (the stages load in a few seconds, Prefect in more).
    stage_config(run.stages, args.config if "config" in args else "options")
    from trajforge.flows.build import build_dataset
    from trajforge.pipeline.build import summary_lines

    report = build_dataset(sources=run.sources or None, out=run.out, runner=run.runner, address=run.address,
                           workers=run.workers, stages=run.stages)
    print("\n".join(summary_lines(report)))
    print(f"dataset: {run.out}/data  quarantine: {run.out}/quarantine  report: {run.out}/report.json")
    return 0


def _add_release(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("release", help="push a build folder to a Hub dataset repo in one commit (a Prefect flow)")
    p.add_argument("dir", help="output folder of `trajforge build`")
    p.add_argument("--repo", required=True, metavar="ORG/NAME", help="dataset repo id")
    p.add_argument("--revision", default="main", metavar="BRANCH", help="branch to commit to (created if missing)")
    p.add_argument("--tag", default=None, metavar="vX", help="tag the release commit")
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--dry-run", action="store_true", help="list added/changed/deleted files; push nothing")
    p.set_defaults(func=_run_release)


def _check_release_args(args: argparse.Namespace) -> None:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from trajforge.pipeline.publish.manifest import MANIFEST

    if not (Path(args.dir) / MANIFEST).is_file():
        raise SourceError(f"release {args.dir}: no {MANIFEST} there; give the --out folder of a finished "
                          f"`trajforge build`")
    try:
        validate_repo_id(args.repo)
    except HFValidationError as exc:
        raise SourceError(f"--repo {args.repo}: not a Hub repo id ({exc}); give ORG/NAME") from None


def _run_release(args: argparse.Namespace) -> int:
    _check_release_args(args)
    # Imported only now: Prefect takes seconds to load.
    from trajforge.flows.release import release_dataset
    from trajforge.pipeline.publish.release import ReleaseError

    try:
        outcome = release_dataset(folder=args.dir, repo=args.repo, revision=args.revision, tag=args.tag,
                                  private=args.private, dry_run=args.dry_run)
    except (ReleaseError, FileNotFoundError) as exc:
        print(f"trajforge: release failed: {exc}", file=sys.stderr)
        return 1
    for kind, mark in (("added", "+"), ("changed", "~"), ("deleted", "-")):
        print("\n".join(f"{mark} {path}" for path in outcome[kind]) or f"({kind}: none)")
    print("dry run: nothing pushed" if outcome["dry_run"] else
          f"pushed {args.repo}@{args.revision} commit {outcome['commit']}"
          + (f" tag {outcome['tag']}" if outcome["tag"] else "") + f"; {outcome['verified']} files verified")
    return 0


def _sampling_arg(value: str) -> tuple[str, object]:
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def _add_synth(sub: argparse._SubParsersAction) -> None:
    from trajforge.pipeline.synth.config import AgentConfig, SynthConfig
    from trajforge.pipeline.synth.llm import LLMConfig

    # Options default to SUPPRESS: given, they override the --config file; the defaults shown are
    # the dataclasses' (pipeline/synth/config.py), which hold them.
    p = sub.add_parser("synth", help="synthesize trajectories with a model against an environment (a Prefect flow)",
                       argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE",
                   help="YAML synth config in the shape of SynthConfig (configs/synth.yaml shows every key: "
                        "llm: and agent: sections, and api_key_env); the options below override it")
    p.add_argument("--tasks", help="task file: AgentBench OS JSON, DBBench JSONL, or plain JSONL (required here or "
                                   "in the config)")
    p.add_argument("--env", help="environment name: os, db, agentgym (required here or in the config)")
    p.add_argument("--model", help="model name as the server knows it (family defaults follow it; required here or "
                                   "in the config)")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 "
                                      "(default: TRAJFORGE_BASE_URL or the OpenAI API)")
    p.add_argument("--n", type=int, help=f"samples per task (best-of-N) (default: {SynthConfig.n})")
    p.add_argument("--out", help="output folder (rerunning into it resumes; required here or in the config)")
    p.add_argument("--keep", choices=["best", "all"],
                   help=f"records per task: the best success or all (default: {SynthConfig.keep})")
    p.add_argument("--concurrency", type=int, help=f"LLM requests in flight (default: {LLMConfig.concurrency})")
    p.add_argument("--episodes", type=int, dest="episode_concurrency",
                   help=f"environments alive at once (default: {SynthConfig.episode_concurrency})")
    p.add_argument("--max-turns", type=int, help=f"model turns per episode before it ends as max_turns "
                                                 f"(default: {AgentConfig.max_turns})")
    p.add_argument("--max-tokens", type=int, help="completion tokens per request (default: the model family's)")
    p.add_argument("--seed", type=int, help="sample k uses seed+k")
    p.add_argument("--sampling", action="append", type=_sampling_arg, metavar="KEY=VALUE",
                   help="override a sampling default (temperature=0.7, top_k=null removes it); repeatable")
    p.add_argument("--backend", choices=["openai", "vllm"],
                   help=f"openai: any OpenAI-compatible server at --base-url; vllm: in-process vLLM (GPU) "
                        f"(default: {SynthConfig.backend})")
    p.add_argument("--api-key-env", metavar="VAR",
                   help="environment variable holding the API key (default: TRAJFORGE_API_KEY, OPENAI_API_KEY); "
                        "the key itself is never an argument")
    p.add_argument("--license", help=f"license of the task source, stamped on the records "
                                     f"(default: {AgentConfig.license})")
    p.add_argument("--timeout", type=float, dest="timeout_s", metavar="SECONDS",
                   help=f"per request (default: {LLMConfig.timeout_s:g})")
    p.add_argument("--max-retries", type=int, metavar="N",
                   help=f"retries of a request that failed for a transient reason (default: {LLMConfig.max_retries})")
    p.add_argument("--max-connection-failures", type=int, metavar="N",
                   help=f"stop the job after N requests in a row could not connect (0: never) "
                        f"(default: {LLMConfig.max_connection_failures})")
    p.set_defaults(func=_run_synth)


def _synth_run(args: argparse.Namespace) -> tuple[dict, str | None, dict]:
    """(the config file's mapping, the API key variable, the given options), checked as one config."""
    where = args.config if "config" in args else "options"
    config = read_config(args.config) if "config" in args else {}
    api_key_env = config.pop("api_key_env", None)
    if api_key_env is not None and not isinstance(api_key_env, str):
        raise ConfigError(f"{where}: api_key_env must be the name of an environment variable")
    api_key_env = getattr(args, "api_key_env", api_key_env)
    given = {key: getattr(args, key) for key in SYNTH_PARAMETERS if key in args}
    if "sampling" in given:
        given["sampling"] = dict(given["sampling"])
    synth_config(merge(config, nested(given)), where)
    return config, api_key_env, given


def _run_synth(args: argparse.Namespace) -> int:
    config, api_key_env, given = _synth_run(args)
    from trajforge.flows.synth import synthesize
    from trajforge.pipeline.synth.llm import ServerUnreachable

    try:
        report = synthesize(config=config, api_key_env=api_key_env, **given)
    except ServerUnreachable as exc:
        print(f"trajforge: synth stopped: {exc.detail}", file=sys.stderr)
        return 1
    env, out = given.get("env", config.get("env")), given.get("out", config.get("out"))
    reasons = ", ".join(f"{k}={v}" for k, v in report["failure_reasons"].items()) or "-"
    print(f"{env}: {report['tasks_with_record']}/{report['tasks']} tasks with a record, {report['records']} "
          f"records, {report['failures']} failures ({reasons}); {report['llm']['calls']} LLM calls answered of "
          f"{report['llm']['attempts']} attempts, {report['llm']['cache_hits']} cache hits")
    print(f"records: {out}/data/synthetic/{env}.parquet  failures: {out}/failures.parquet")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    # The trainer's own parser (training.cli, then TRL's) reads everything after `train`, --help too.
    p = sub.add_parser("train", help="train on the dataset with TRL: sft, grpo, rloo, dpo, or a reward model: rm, prm "
                                     "(extra `train`)",
                       add_help=False)
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="sft|grpo|rloo|dpo|rm|prm --config training/configs/<name>.yaml and any config field as "
                        "--field value")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    # training.cli imports torch and TRL (an optional extra, slow to import) only for a chosen trainer.
    from trajforge.training.cli import main as train_main

    return train_main(args.args)


def _add_select_steps(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("select-steps", help="flag the critical steps of trajectories with a model, ATLaS (a Prefect flow)")
    p.add_argument("inputs", help="records to judge: a build folder (data/sft), a synth folder, or a Parquet file")
    p.add_argument("--out", required=True, help="output folder, same layout as the input (rerunning into it resumes)")
    p.add_argument("--model", required=True, help="selector model name as the server knows it")
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint (default: TRAJFORGE_BASE_URL)")
    p.add_argument("--config", default="sft", help="release config to judge in a build folder")
    p.add_argument("--env", action="append", default=[], help="judge only records of this env (repeatable)")
    p.add_argument("--concurrency", type=int, default=64, help="LLM requests in flight")
    p.add_argument("--batch-size", type=int, default=256, help="records in flight")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--sampling", action="append", type=_sampling_arg, default=[], metavar="KEY=VALUE",
                   help="override a sampling default; repeatable")
    p.add_argument("--backend", choices=["openai", "vllm"], default="openai")
    p.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key")
    p.set_defaults(func=_run_select_steps)


def _run_select_steps(args: argparse.Namespace) -> int:
    from trajforge.flows.select_steps import select_steps
    from trajforge.pipeline.quality.critical_steps import summary_lines

    if not os.path.exists(args.inputs):
        raise SourceError(f"select-steps: {args.inputs} does not exist")
    report = select_steps(inputs=args.inputs, out=args.out, model=args.model, base_url=args.base_url,
                          config_name=args.config, concurrency=args.concurrency, batch_size=args.batch_size,
                          max_tokens=args.max_tokens, sampling=dict(args.sampling), backend=args.backend,
                          api_key_env=args.api_key_env, envs=args.env)
    print("\n".join(summary_lines(report)))
    print(f"records: {args.out}  failures: {args.out}/select_failures.parquet  report: {args.out}/report.json")
    return 0


def _add_salvage(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("salvage", help="replay prefixes of failed runs and keep successful continuations, EEF "
                                       "(a Prefect flow)")
    p.add_argument("failures", nargs="+", help="failures.parquet of `trajforge synth`, or records with success false")
    p.add_argument("--tasks", required=True, help="the task file the failures were run on")
    p.add_argument("--out", required=True, help="output folder (rerunning into it resumes)")
    p.add_argument("--model", required=True)
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint (default: TRAJFORGE_BASE_URL)")
    p.add_argument("--max-prefixes", type=int, default=3, help="prefixes tried per failure, longest first")
    p.add_argument("--max-calls", type=int, default=200, help="LLM call budget for the run (cache hits are free)")
    p.add_argument("--concurrency", type=int, default=64, help="LLM requests in flight")
    p.add_argument("--episodes", type=int, default=8, help="environments alive at once")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--sampling", action="append", type=_sampling_arg, default=[], metavar="KEY=VALUE")
    p.add_argument("--backend", choices=["openai", "vllm"], default="openai")
    p.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key")
    p.set_defaults(func=_run_salvage)


def _run_salvage(args: argparse.Namespace) -> int:
    from trajforge.flows.salvage import salvage

    for path in [*args.failures, args.tasks]:
        if not os.path.isfile(path):
            raise SourceError(f"salvage: no file {path}")
    report = salvage(failures=args.failures, tasks=args.tasks, out=args.out, model=args.model, base_url=args.base_url,
                     max_prefixes=args.max_prefixes, max_calls=args.max_calls, concurrency=args.concurrency,
                     episode_concurrency=args.episodes, max_turns=args.max_turns, max_tokens=args.max_tokens,
                     sampling=dict(args.sampling), backend=args.backend, api_key_env=args.api_key_env)
    outcomes = ", ".join(f"{k}={v}" for k, v in report["outcomes"].items()) or "-"
    print(f"{report['failures']} failures ({outcomes}); {report['records']} records with {report['beneficial_steps']} "
          f"beneficial steps; {report['llm']['calls']} LLM calls (budget {args.max_calls}), "
          f"{report['llm']['cache_hits']} cache hits")
    print(f"records: {args.out}/data/synthetic  outcomes: {args.out}/salvage.parquet")
    return 0


def _serve_arg(value: str) -> list[str]:
    from trajforge.pipeline.rft import serve_command

    try:
        return serve_command(value)
    except UnknownName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_rft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("rft", help="rejection-sampling fine-tuning rounds: build, SFT, serve, synthesize, keep "
                                   "successes (a Prefect flow; extra `train`)")
    p.add_argument("--source", action="append", type=_source_arg, default=[], metavar="NAME[=PATH_OR_REPO]",
                   help="a source of the build (repeatable), as for `trajforge build`")
    p.add_argument("--tasks", required=True, help="held-out task file the served checkpoint is sampled on")
    p.add_argument("--env", required=True, help="environment of the tasks: os, db, agentgym")
    p.add_argument("--base-model", required=True, help="model every round fine-tunes (folder or Hub id)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sft-config", required=True, help="SFT YAML config (training/configs/sft_*.yaml)")
    p.add_argument("--serve", default="transformers", type=_serve_arg,
                   help="server for the checkpoint: transformers (CPU), vllm (GPU), or a command with {model} "
                        "and {port} placeholders")
    p.add_argument("--n", type=int, default=4, help="samples per held-out task")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None)
    p.set_defaults(func=_run_rft)


def _run_rft(args: argparse.Namespace) -> int:
    from trajforge.flows.rft import rft

    for path in (args.tasks, args.sft_config):
        if not os.path.isfile(path):
            raise SourceError(f"rft: no file {path}")
    report = rft(sources=dict(args.source) or {"agentinstruct": None}, tasks=args.tasks, env=args.env,
                 base_model=args.base_model, out=args.out, rounds=args.rounds, sft_args=["--config", args.sft_config],
                 serve=args.serve, n=args.n, max_turns=args.max_turns, max_tokens=args.max_tokens)
    for r in report["rounds"]:
        print(f"round {r['round']}: {r['tasks_solved']}/{r['tasks']} held-out tasks solved ({r['success_rate']}), "
              f"{r['records_kept']} records kept, train loss {r['train_loss']}")
    print(f"final build: {args.out}/final ({report['final_build']['records']} records, "
          f"{report['final_build']['synthetic_records']} from the rounds); report: {args.out}/report.json")
    return 0


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="score trajectories with a reward model or an LLM judge; --min-score moves "
                                     "the low ones to the quarantine (a Prefect flow)")
    p.add_argument("inputs", help="records to score: a build folder (data/sft), a synth folder, or a Parquet file")
    p.add_argument("--out", required=True, help="output folder, same layout as the input, plus quarantine and report")
    p.add_argument("--scorer", required=True, choices=["rm", "prm", "judge"],
                   help="rm: outcome reward model (`trajforge train rm`), prm: process reward model (`trajforge "
                        "train prm`), judge: an LLM with a 0-5 rubric at --base-url")
    p.add_argument("--model", required=True, help="the trained model's folder (rm, prm) or the judge model's name")
    p.add_argument("--min-score", type=float, default=None,
                   help="records scored below this go to the quarantine as low_score (on the scorer's scale)")
    p.add_argument("--config", default="sft", help="release config to score in a build folder")
    p.add_argument("--batch-size", type=int, default=64, help="records in flight")
    p.add_argument("--max-length", type=int, default=None, help="rm / prm: tokens per trajectory")
    p.add_argument("--base-url", default=None, help="judge: OpenAI-compatible endpoint (default: TRAJFORGE_BASE_URL)")
    p.add_argument("--concurrency", type=int, default=64, help="judge: LLM requests in flight")
    p.add_argument("--sampling", action="append", type=_sampling_arg, default=[], metavar="KEY=VALUE",
                   help="judge: override a sampling default; repeatable")
    p.add_argument("--max-calls", type=int, default=None, help="judge: LLM call budget (cache hits are free)")
    p.add_argument("--max-tokens", type=int, default=None, help="judge: completion tokens per rating")
    p.add_argument("--backend", choices=["openai", "vllm"], default="openai")
    p.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key")
    p.set_defaults(func=_run_score)


def _run_score(args: argparse.Namespace) -> int:
    from trajforge.flows.score import score
    from trajforge.pipeline.quality.score import summary_lines

    if not os.path.exists(args.inputs):
        raise SourceError(f"score: {args.inputs} does not exist")
    if args.scorer != "judge" and not os.path.isdir(args.model):
        raise SourceError(f"score: --model {args.model} is not a folder with a trained reward model")
    report = score(inputs=args.inputs, out=args.out, scorer=args.scorer, model=args.model, min_score=args.min_score,
                   config_name=args.config, batch_size=args.batch_size, max_length=args.max_length,
                   base_url=args.base_url, concurrency=args.concurrency, sampling=dict(args.sampling),
                   max_calls=args.max_calls, max_tokens=args.max_tokens, backend=args.backend,
                   api_key_env=args.api_key_env)
    print("\n".join(summary_lines(report)))
    print(f"records: {args.out}  quarantine: {args.out}/quarantine/quarantine.parquet  report: {args.out}/report.json")
    return 0


# Each entry adds one subcommand; other capabilities register theirs here.
COMMANDS = [_add_build, _add_release, _add_synth, _add_train, _add_select_steps, _add_salvage, _add_rft,
            _add_score]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajforge", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_HelpFormatter))
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    p = parser()
    args, unknown = p.parse_known_args(argv)
    if args.command == "train":
        args.args = [*unknown, *args.args]  # `train --help`: options before the trainer name are its parser's
    elif unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except SourceError as exc:
        print(f"trajforge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
