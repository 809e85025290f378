"""`trajforge` command line: each subcommand parses its arguments and runs a flow."""
from __future__ import annotations

import argparse
import json
import os
import sys

from sources import REGISTRY, SourceError


def _source_arg(value: str) -> tuple[str, str | None]:
    name, sep, location = value.partition("=")
    if name not in REGISTRY:
        raise argparse.ArgumentTypeError(f"unknown source {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return name, (location or None) if sep else None


def _add_build(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build", help="build the dataset from upstream sources (a Prefect flow)")
    p.add_argument("--source", action="append", type=_source_arg, default=[], metavar="NAME[=PATH_OR_REPO]",
                   help="a source to read, from a local folder/file or a Hub repo id (repeatable); "
                        "default: the three upstream datasets from the Hub")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--rendering", choices=["native", "react"], default="native",
                   help="assistant turn text: upstream wording (native) or Think/Act (react)")
    p.add_argument("--runner", choices=["threads", "dask", "ray"], default="threads",
                   help="where the per-file units run: local threads, or a Dask / Ray cluster (extras dask, ray)")
    p.add_argument("--address", default=None,
                   help="cluster address for --runner dask (tcp://host:8786) or ray (ray://host:10001); "
                        "default: start a local cluster")
    p.add_argument("--decontaminate", metavar="FILE", default=None,
                   help="evaluation tasks (one per line, or JSON/JSONL strings or {task}); trajectories whose "
                        "task shares an 8-word n-gram with one go to the quarantine as `contaminated`")
    p.add_argument("--dedup-threshold", type=float, default=None, metavar="J",
                   help="shingle Jaccard similarity from which two trajectories are near duplicates (default 0.85)")
    p.set_defaults(func=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    from flows.build import build_dataset
    from pipeline.build import summary_lines

    sources: dict[str, str | None] = {}
    for name, location in args.source:
        if name in sources:
            raise SourceError(f"source {name} given twice")
        if location is not None and not os.path.exists(location) and location.count("/") != 1:
            raise SourceError(f"source {name}: path {location} does not exist")
        sources[name] = location
    if args.decontaminate and not os.path.isfile(args.decontaminate):
        raise SourceError(f"--decontaminate: no file {args.decontaminate}")
    report = build_dataset(sources=sources or None, out=args.out, rendering=args.rendering, runner=args.runner,
                           address=args.address, decontaminate=args.decontaminate and os.path.abspath(args.decontaminate),
                           dedup_threshold=args.dedup_threshold)
    print("\n".join(summary_lines(report)))
    print(f"dataset: {args.out}/data  quarantine: {args.out}/quarantine  report: {args.out}/report.json")
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


def _run_release(args: argparse.Namespace) -> int:
    from flows.release import release_dataset
    from pipeline.release import ReleaseError

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
    p = sub.add_parser("synth", help="synthesize trajectories with a model against an environment (a Prefect flow)")
    p.add_argument("--tasks", required=True, help="task file: AgentBench OS JSON, DBBench JSONL, or plain JSONL")
    p.add_argument("--env", required=True, help="environment name: os, db, agentgym")
    p.add_argument("--model", required=True, help="model name as the server knows it (family defaults follow it)")
    p.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 "
                                                    "(default: TRAJFORGE_BASE_URL or the OpenAI API)")
    p.add_argument("--n", type=int, default=4, help="samples per task (best-of-N)")
    p.add_argument("--out", required=True, help="output folder (rerunning into it resumes)")
    p.add_argument("--keep", choices=["best", "all"], default="best", help="records per task: the best success or all")
    p.add_argument("--concurrency", type=int, default=64, help="LLM requests in flight")
    p.add_argument("--episodes", type=int, default=16, help="environments alive at once")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="sample k uses seed+k")
    p.add_argument("--sampling", action="append", type=_sampling_arg, default=[], metavar="KEY=VALUE",
                   help="override a sampling default (temperature=0.7, top_k=null removes it); repeatable")
    p.add_argument("--backend", choices=["openai", "vllm"], default="openai")
    p.add_argument("--api-key-env", default=None, metavar="VAR",
                   help="environment variable holding the API key (default: TRAJFORGE_API_KEY, OPENAI_API_KEY); "
                        "the key itself is never an argument")
    p.add_argument("--license", default="other", help="license of the task source, stamped on the records")
    p.set_defaults(func=_run_synth)


def _run_synth(args: argparse.Namespace) -> int:
    from flows.synth import synthesize

    report = synthesize(tasks=args.tasks, env=args.env, model=args.model, out=args.out, base_url=args.base_url,
                        n=args.n, keep=args.keep, concurrency=args.concurrency, episode_concurrency=args.episodes,
                        max_turns=args.max_turns, max_tokens=args.max_tokens, seed=args.seed,
                        sampling=dict(args.sampling), backend=args.backend, api_key_env=args.api_key_env,
                        license=args.license)
    reasons = ", ".join(f"{k}={v}" for k, v in report["failure_reasons"].items()) or "-"
    print(f"{args.env}: {report['tasks_with_record']}/{report['tasks']} tasks with a record, {report['records']} "
          f"records, {report['failures']} failures ({reasons}); {report['llm']['calls']} LLM calls, "
          f"{report['llm']['cache_hits']} cache hits")
    print(f"records: {args.out}/data/synthetic/{args.env}.parquet  failures: {args.out}/failures.parquet")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train on the dataset with TRL: sft, grpo or dpo (extra `train`)",
                       add_help=False)
    p.add_argument("trainer", choices=["sft", "grpo", "dpo"])
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="--config training/configs/<name>.yaml and any config field as --field value")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    # Imported here: torch and TRL are an optional extra and slow to import.
    from training.cli import main as train_main

    return train_main([args.trainer, *args.args])


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
    from flows.select_steps import select_steps
    from pipeline.critical_steps import summary_lines

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
    from flows.salvage import salvage

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
    p.add_argument("--serve", default="transformers",
                   help="server for the checkpoint: transformers (CPU), vllm (GPU), or a command with {model} "
                        "and {port} placeholders")
    p.add_argument("--n", type=int, default=4, help="samples per held-out task")
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None)
    p.set_defaults(func=_run_rft)


def _run_rft(args: argparse.Namespace) -> int:
    import shlex

    from flows.rft import rft
    from pipeline.rft import SERVE_COMMANDS

    for path in (args.tasks, args.sft_config):
        if not os.path.isfile(path):
            raise SourceError(f"rft: no file {path}")
    serve = args.serve if args.serve in SERVE_COMMANDS else shlex.split(args.serve)
    report = rft(sources=dict(args.source) or {"agentinstruct": None}, tasks=args.tasks, env=args.env,
                 base_model=args.base_model, out=args.out, rounds=args.rounds, sft_args=["--config", args.sft_config],
                 serve=serve, n=args.n, max_turns=args.max_turns, max_tokens=args.max_tokens)
    for r in report["rounds"]:
        print(f"round {r['round']}: {r['tasks_solved']}/{r['tasks']} held-out tasks solved ({r['success_rate']}), "
              f"{r['records_kept']} records kept, train loss {r['train_loss']}")
    print(f"final build: {args.out}/final ({report['final_build']['records']} records, "
          f"{report['final_build']['synthetic_records']} from the rounds); report: {args.out}/report.json")
    return 0


# Each entry adds one subcommand; other capabilities register theirs here.
COMMANDS = [_add_build, _add_release, _add_synth, _add_train, _add_select_steps, _add_salvage, _add_rft]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajforge", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except SourceError as exc:
        print(f"trajforge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
