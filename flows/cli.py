"""`trajforge` command line: each subcommand parses its arguments and runs a flow.

Arguments are checked, and `--help` answered, before Prefect, the stages or TRL load: only light
modules are imported at the top, the rest inside the command that needs them.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import sys
from pathlib import Path

from trajforge.flows.config import (
    AUTO,
    RUNNERS,
    SMALL_INPUT_BYTES,
    SYNTH_PARAMETERS,
    BuildRun,
    ConfigError,
    load_build_run,
    merge,
    nested,
    read_config,
    stage_config,
    synth_config,
)
from trajforge.flows.stopping import stop_on_signals
from trajforge.pipeline.registry import UnknownName
from trajforge.sources import DEFAULT_SOURCES, REGISTRY, SourceError, UnknownSource, check_layout, get_source


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
    p.add_argument("--source-as", action="append", metavar="NAME",
                   help="read source NAME's files as NAME even where they look like another source's (file names, "
                        "ids); without it such a build is refused, since it would publish one dataset under "
                        "another's name and license (repeatable; replaces the config's source_as)")
    p.add_argument("--out", help="output folder: new, empty, or an earlier build (rebuilt); required here or in "
                                 "the config")
    p.add_argument("--overwrite", action="store_true",
                   help="build into an --out folder that holds other files (they may be replaced)")
    p.add_argument("--rendering", choices=["native", "react"],
                   help="assistant turn text: upstream wording (native) or Think/Act (react); default: the normalize stage's")
    p.add_argument("--runner", choices=(AUTO, *RUNNERS),
                   help="where the per-unit steps run (units, band screens, outputs, shards): local processes "
                        "or threads, or a Dask / Ray cluster (extras dask, ray); auto: an input of local files up "
                        f"to {SMALL_INPUT_BYTES // 2**20} MiB builds in this process (without Prefect when no Prefect "
                        f"server is set), a larger one on processes; default: {BuildRun.runner}")
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
    p.add_argument("--invalid-steps", metavar="mask|drop|keep",
                   help="a step the env refused inside an episode: kept as context with loss false (mask), its "
                        "record quarantined (drop), or trained on (keep); default: the validate stage's")
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
    if "source_as" in args:
        run.source_as = args.source_as
    if run.out is None:
        raise SourceError("build: no output folder; give --out DIR (or `out:` in the --config file)")
    stages = {"rendering": getattr(args, "rendering", None), "invalid_steps": getattr(args, "invalid_steps", None),
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


def _known_sources(names) -> None:
    for name in names:
        try:
            get_source(name)
        except UnknownSource as exc:
            raise SourceError(f"--source {name}: {exc}") from None


def _readable_sources(sources: dict[str, str | None], source_as=()) -> None:
    """Every source can be read from where it says (a local path, or a Hub repo looked up once), and
    its local files are in its own layout unless `source_as` names it."""
    from trajforge.sources.locate import check_source

    for name, location in sources.items():
        local_files = check_source(REGISTRY[name], location)
        if local_files and name not in source_as:
            check_layout(name, local_files)  # a Hub source's files are checked in the flow, once downloaded


def _check_build_args(run: BuildRun) -> None:
    """Every argument is usable (SourceError otherwise): the sources, the output folder, the files."""
    _known_sources(run.sources)
    _check_out(run.out, run.overwrite)
    decontaminate = run.stages.get("decontaminate")
    if decontaminate and not os.path.isfile(decontaminate):
        raise SourceError(f"--decontaminate {decontaminate}: no such file; give a file of evaluation tasks")
    sources = run.sources or dict.fromkeys(DEFAULT_SOURCES)
    for name in run.source_as:
        if name not in sources:
            raise SourceError(f"--source-as {name}: not a source of this build ({', '.join(sources)})")
    _readable_sources(sources, run.source_as)


# Checks of the other commands' arguments, each a SourceError with one line, before Prefect loads.

def _need_file(option: str, path: str, what: str) -> None:
    if not os.path.isfile(os.path.expanduser(path)):
        raise SourceError(f"{option} {path}: no such file; give {what}")


def _need_at_least(option: str, value: int | None, least: int = 1) -> None:
    if value is not None and value < least:
        raise SourceError(f"{option} {value}: must be at least {least}")


def _need_env(name: str) -> None:
    from trajforge.pipeline.envs import runtimes

    try:
        runtimes()[name]
    except UnknownName as exc:
        raise SourceError(f"--env {name}: {exc}") from None


def _need_out_folder(out: str) -> None:
    if os.path.isfile(os.path.expanduser(out)):
        raise SourceError(f"--out {out}: is a file; give a folder (new, or the one of an earlier run to resume)")


def _prefect_server_set() -> bool:
    """Whether a Prefect API is configured (environment or profile): runs are tracked there, and
    no temporary server has to start."""
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


def _builds_in_process(run: BuildRun) -> bool:
    """`--runner auto` on local files small enough that the build takes seconds: it runs in this
    process, without Prefect unless a Prefect server is set (starting a temporary one and worker
    processes would take longer than the build)."""
    from trajforge.sources.locate import is_local_path

    sources = run.sources or dict.fromkeys(DEFAULT_SOURCES)
    if run.runner != AUTO or not all(location and is_local_path(location) for location in sources.values()):
        return False
    size = sum(f.path.stat().st_size for name, location in sources.items() for f in get_source(name).files(location))
    return size <= SMALL_INPUT_BYTES and not _prefect_server_set()


def _run_build(args: argparse.Namespace) -> int:
    run = _build_run(args)
    _check_build_args(run)
    # The stages' settings, checked before Prefect loads (the stages load in a few seconds, Prefect in more).
    config = stage_config(run.stages, args.config if "config" in args else "options")
    if _builds_in_process(run):
        from trajforge.pipeline.build import build_in_process, summary_lines

        if args.verbose:  # Prefect, when loaded, has its console handler; here nothing else shows the logs
            logging.basicConfig(format="%(asctime)s | %(levelname)-7s | %(name)s - %(message)s")
        report = build_in_process(run.sources, Path(run.out), config)
    else:
        from trajforge.flows.build import build_dataset
        from trajforge.pipeline.build import summary_lines

        report = build_dataset(sources=run.sources or None, out=run.out, runner=run.runner, address=run.address,
                               workers=run.workers, stages=run.stages, source_as=run.source_as)
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
    from trajforge.pipeline.llm.client import LLMConfig
    from trajforge.pipeline.synth.config import SEARCH_STRATEGIES, VALUE_MODELS, AgentConfig, SearchConfig, SynthConfig

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
                   help=f"stop the job after N requests in a row could not connect, or at the first refused "
                        f"connection of a server that has not answered yet (0: never) "
                        f"(default: {LLMConfig.max_connection_failures})")
    p.add_argument("--search", choices=SEARCH_STRATEGIES,
                   help="grow a search tree per task instead of --n independent episodes; also writes the tree, step "
                        "values and step pairs under OUT/search/ (default: no search)")
    p.add_argument("--branch", type=int, metavar="K",
                   help=f"candidate next steps proposed at a state (beam: its width) (default: {SearchConfig.branch})")
    p.add_argument("--max-calls", type=int, metavar="N",
                   help=f"LLM calls per task in a search (default: {SearchConfig.max_calls})")
    p.add_argument("--max-task-tokens", type=int, metavar="N",
                   help="completion tokens per task in a search (default: no limit)")
    p.add_argument("--value-model", choices=VALUE_MODELS,
                   help="score non-terminal states: judge asks the model itself (default: none)")
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
    job = synth_config(merge(config, nested(given)), where)
    _need_file("--tasks", job.tasks, "a task file (AgentBench OS JSON, DBBench JSONL, or JSONL)")
    _need_env(job.env)
    _need_out_folder(job.out)
    _need_at_least("--concurrency", job.llm.concurrency)
    _need_at_least("--episodes", job.episode_concurrency)
    _need_at_least("--max-turns", job.agent.max_turns)
    return config, api_key_env, given


def _run_synth(args: argparse.Namespace) -> int:
    config, api_key_env, given = _synth_run(args)
    from trajforge.flows.synth import synthesize
    from trajforge.pipeline.llm.client import ServerUnreachable

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


def _check_select_steps_args(args: argparse.Namespace) -> None:
    if not os.path.exists(args.inputs):
        raise SourceError(f"select-steps {args.inputs}: no such file or folder; give a build folder, a synth folder "
                          f"or a Parquet file of records")
    _need_out_folder(args.out)
    _need_at_least("--concurrency", args.concurrency)
    _need_at_least("--batch-size", args.batch_size)


def _run_select_steps(args: argparse.Namespace) -> int:
    _check_select_steps_args(args)
    from trajforge.flows.select_steps import select_steps
    from trajforge.pipeline.quality.critical_steps import summary_lines

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


def _check_salvage_args(args: argparse.Namespace) -> None:
    for path in args.failures:
        _need_file("salvage", path, "the failures.parquet of `trajforge synth`, or records with success false")
    _need_file("--tasks", args.tasks, "the task file the failures were run on")
    _need_out_folder(args.out)
    for option in ("max_prefixes", "concurrency", "episodes", "max_turns"):
        _need_at_least("--" + option.replace("_", "-"), getattr(args, option))
    _need_at_least("--max-calls", args.max_calls, 0)


def _run_salvage(args: argparse.Namespace) -> int:
    _check_salvage_args(args)
    from trajforge.flows.salvage import salvage

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
    p.add_argument("--tasks", required=True, help="task file the served checkpoint is sampled on each round (its "
                                                  "successes are trained on)")
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
    p.add_argument("--eval-tasks", default=None, metavar="FILE",
                   help="held-out tasks each round is evaluated on (default: the env's declared eval split without "
                        "the --tasks)")
    p.add_argument("--eval-n", type=int, default=1, help="samples per held-out task")
    p.set_defaults(func=_run_rft)


def _check_rft_args(args: argparse.Namespace) -> dict[str, str | None]:
    """The checked sources of the builds (default: AgentInstruct from the Hub)."""
    from trajforge.sources.locate import is_local_path

    sources = {}
    for name, location in args.source:
        if name in sources:
            raise SourceError(f"--source {name}: given twice; keep one")
        sources[name] = location
    sources = sources or {"agentinstruct": None}
    _known_sources(sources)
    _need_file("--tasks", args.tasks, "the held-out task file (AgentBench OS JSON, DBBench JSONL, or JSONL)")
    _need_env(args.env)
    _need_file("--sft-config", args.sft_config, "an SFT config (training/configs/sft_*.yaml)")
    if args.eval_tasks is not None:
        _need_file("--eval-tasks", args.eval_tasks, "a held-out task file of the same env")
    if is_local_path(args.base_model):
        if not os.path.isdir(os.path.expanduser(args.base_model)):
            raise SourceError(f"--base-model {args.base_model}: no such model folder; give a model folder or a Hub "
                              f"model id (ORG/NAME)")
    else:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(args.base_model)
        except HFValidationError:
            raise SourceError(f"--base-model {args.base_model}: neither a model folder nor a Hub model id "
                              f"(ORG/NAME)") from None
    _need_out_folder(args.out)
    for option in ("rounds", "n", "max_turns", "eval_n"):
        _need_at_least("--" + option.replace("_", "-"), getattr(args, option))
    _readable_sources(sources)
    return sources


def _run_rft(args: argparse.Namespace) -> int:
    sources = _check_rft_args(args)
    from trajforge.flows.rft import rft

    report = rft(sources=sources, tasks=args.tasks, env=args.env,
                 base_model=args.base_model, out=args.out, rounds=args.rounds, sft_args=["--config", args.sft_config],
                 serve=args.serve, n=args.n, max_turns=args.max_turns, max_tokens=args.max_tokens,
                 eval_tasks=args.eval_tasks and os.path.abspath(args.eval_tasks), eval_n=args.eval_n)
    for r in report["rounds"]:
        print(f"round {r['round']}: {r['tasks_solved']}/{r['tasks']} round tasks solved ({r['success_rate']}), "
              f"held-out success {r['heldout_success']} {r['heldout_ci95']}, {r['records_kept']} records kept, "
              f"train loss {r['train_loss']}")
    print(f"final build: {args.out}/final ({report['final_build']['records']} records, "
          f"{report['final_build']['synthetic_records']} from the rounds); report: {args.out}/report.json")
    return 0


def _env_file_arg(value: str) -> tuple[str, str]:
    env, sep, path = value.partition("=")
    if not sep or not env or not path:
        raise argparse.ArgumentTypeError(f"expected ENV=FILE, got {value!r}")
    return env, path


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from trajforge.pipeline.llm.client import LLMConfig
    from trajforge.pipeline.synth.config import AgentConfig

    p = sub.add_parser("eval", help="evaluate a model on held-out benchmark tasks, with oracle and random "
                                    "calibration (a Prefect flow)")
    p.add_argument("--out", required=True, help="output folder: eval.json, report.html, episodes.parquet "
                                                "(rerunning into it resumes)")
    p.add_argument("--model", help="model name as the server knows it, or with --serve the checkpoint folder; "
                                   "without it only the oracle and random policies run")
    p.add_argument("--base-url", help="OpenAI-compatible endpoint (default: TRAJFORGE_BASE_URL)")
    p.add_argument("--serve", type=_serve_arg, metavar="SERVER",
                   help="serve the --model checkpoint for the run: transformers (CPU), vllm (GPU), or a command "
                        "with {model} and {port}")
    p.add_argument("--label", help="name of this checkpoint in the results table (default: the model)")
    p.add_argument("--env", action="append", default=[], help="an env to evaluate (repeatable; default: every env "
                                                              "with a declared held-out split: os, db, babyai)")
    p.add_argument("--tasks", action="append", type=_env_file_arg, default=[], metavar="ENV=FILE",
                   help="evaluate ENV on the tasks of FILE instead of its declared split (repeatable)")
    p.add_argument("--n", type=int, default=1, help="samples per task (pass@k for k up to n)")
    p.add_argument("--results", default="results", metavar="DIR",
                   help="folder of the results table (results.parquet, results.csv) that runs append to")
    p.add_argument("--train-data", metavar="BUILD", help="the model's training build: refuse when it holds eval "
                                                         "tasks")
    p.add_argument("--allow-overlap", action="store_true", help="evaluate anyway when --train-data holds eval "
                                                                "tasks (warned in the log, eval.json and report)")
    p.add_argument("--no-calibration", action="store_true", help="skip the oracle and random policies")
    p.add_argument("--agentgym-url", help="AgentGym server for `agentgym` tasks (--tasks agentgym=FILE)")
    p.add_argument("--max-turns", type=int, default=AgentConfig.max_turns)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="sample k uses seed+k")
    p.add_argument("--sampling", action="append", type=_sampling_arg, default=[], metavar="KEY=VALUE",
                   help="override a sampling default; repeatable")
    p.add_argument("--concurrency", type=int, default=LLMConfig.concurrency, help="LLM requests in flight")
    p.add_argument("--episodes", type=int, default=8, help="environments alive at once")
    p.add_argument("--timeout", type=float, default=LLMConfig.timeout_s, metavar="SECONDS", help="per request")
    p.add_argument("--max-retries", type=int, default=LLMConfig.max_retries)
    p.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key")
    p.set_defaults(func=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    from trajforge.pipeline.evaluation.splits import EVAL_SPLITS

    tasks = dict(args.tasks)
    for env in [*args.env, *tasks]:
        _need_env(env)
    for env in args.env:
        if env not in EVAL_SPLITS and env not in tasks:
            raise SourceError(f"--env {env}: no declared held-out split (declared: {', '.join(EVAL_SPLITS)}); "
                              f"give its tasks with --tasks {env}=FILE")
    for path in [*tasks.values(), *([args.train_data] if args.train_data else [])]:
        if not os.path.exists(path):
            raise SourceError(f"eval: {path} does not exist")
    if args.serve and not (args.model and os.path.isdir(args.model)):
        raise SourceError("--serve needs --model CHECKPOINT_FOLDER")
    from trajforge.flows.eval import evaluate
    from trajforge.pipeline.envs import host
    from trajforge.pipeline.evaluation.run import EvalRefused
    from trajforge.pipeline.llm.client import ServerUnreachable

    env_kw = {host().name: {"base_url": args.agentgym_url}} if args.agentgym_url else {}
    try:
        report = evaluate(out=args.out, envs=list(dict.fromkeys([*args.env, *tasks])) or None,
                          model=os.path.abspath(args.model) if args.serve else args.model, base_url=args.base_url,
                          label=args.label, tasks={k: os.path.abspath(v) for k, v in tasks.items()}, n=args.n,
                          calibrate=[] if args.no_calibration else None, max_turns=args.max_turns,
                          max_tokens=args.max_tokens, seed=args.seed, sampling=dict(args.sampling),
                          concurrency=args.concurrency, episode_concurrency=args.episodes, timeout_s=args.timeout,
                          max_retries=args.max_retries, env_kw=env_kw, results=args.results,
                          train_data=args.train_data, allow_overlap=args.allow_overlap, serve=args.serve,
                          api_key_env=args.api_key_env)
    except EvalRefused as exc:
        print(f"trajforge: eval refused: {exc}", file=sys.stderr)
        return 2
    except ServerUnreachable as exc:
        print(f"trajforge: eval stopped: {exc.detail}", file=sys.stderr)
        return 1
    for env, e in report["envs"].items():
        for who, s in [("model", e.get("model")), *e["policies"].items()]:
            if s is not None:
                outcomes = ", ".join(f"{k}={v}" for k, v in s["outcomes"].items())
                print(f"{env} {report['label'] if who == 'model' else who}: success {s['success_rate']} "
                      f"{s['success_ci95']} over {s['episodes']} episodes; {outcomes}")
        if e.get("broken"):
            print(f"{env}: BROKEN: the oracle does not solve the split ({e['split']})")
    for env, why in report["not_run"].items():
        print(f"{env}: not run: {why}")
    print(f"report: {args.out}/report.html  eval.json: {args.out}/eval.json"
          + (f"  results: {report['results']}" if report.get("results") else ""))
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
COMMANDS = [_add_build, _add_release, _add_synth, _add_train, _add_select_steps, _add_salvage, _add_rft, _add_eval,
            _add_score]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trajforge", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=_HelpFormatter))
    for add in COMMANDS:
        add(sub)
    for name, command in sub.choices.items():
        if name != "train":  # the trainer's own parser reads every option of `train`
            command.add_argument("-v", "--verbose", action="store_true", default=False,
                                 help="log what every step does (Prefect's task logs, the stages' counts)")
    return p


# Prefect's console log handler; its API handler (the run's logs in the UI) keeps INFO either way.
CONSOLE_LEVEL = "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"


@contextlib.contextmanager
def _console_logs(verbose: bool):
    """Warnings and errors on the console; with --verbose also the INFO logs: Prefect's (task
    states, progress lines) and the stages' (per-unit counts). Set before Prefect loads, it reaches
    the worker processes too."""
    before = os.environ.get(CONSOLE_LEVEL)
    stages = logging.getLogger("trajforge")
    level = stages.level
    os.environ[CONSOLE_LEVEL] = "NOTSET" if verbose else (before or "WARNING")
    if verbose:
        stages.setLevel(logging.INFO)
    try:
        yield
    finally:
        stages.setLevel(level)
        if before is None:
            os.environ.pop(CONSOLE_LEVEL, None)
        else:
            os.environ[CONSOLE_LEVEL] = before


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
        with _console_logs(getattr(args, "verbose", False)), stop_on_signals():
            return args.func(args)
    except SourceError as exc:
        print(f"trajforge: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
