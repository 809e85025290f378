"""`trajforge` command line: each subcommand parses its arguments and runs a flow.

Arguments are checked, and `--help` answered, before Prefect, the stages or TRL load: only light
modules are imported at the top, the rest inside the command that needs them.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import functools
import gc
import json
import logging
import os
import sys
from pathlib import Path

from trajforge.flows.config import (
    AUTO,
    BUILD,
    EVAL,
    RFT,
    RUNNERS,
    SALVAGE,
    SCORE,
    SELECT_STEPS,
    SMALL_INPUT_BYTES,
    SYNTH,
    BuildRun,
    ConfigError,
    Parameters,
    build_run,
    merge,
    read_config,
    stage_config,
    synth_config,
)
from trajforge.flows.stopping import stop_on_signals
from trajforge.pipeline.registry import UnknownName
from trajforge.sources import DEFAULT_SOURCES, REGISTRY, SourceError, UnknownSource, check_layout, get_source


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show; an option of a command's
    `Parameters` shows its config's default (`_option`)."""

    def _get_help_string(self, action):
        default = action.config_default() if hasattr(action, "config_default") else action.default
        if default in (None, [], {}, (), False, argparse.SUPPRESS) or "(default:" in (action.help or ""):
            return action.help
        if isinstance(default, dict):  # sources: NAME or NAME=LOCATION, as the option takes them
            default = ", ".join(key if value is None else f"{key}={value}" for key, value in default.items())
        return f"{action.help} (default: {str(default).replace('%', '%%')})"


def _option(p: argparse.ArgumentParser, table: Parameters, *flags: str, show_default: bool = True, **kwargs):
    """An option that sets parameter `dest` of `table`, left unset unless given: its default is the
    config's (stated once, in the dataclass), which --help shows (unless `show_default` is off:
    the build's stage configs take seconds to import)."""
    action = p.add_argument(*flags, default=argparse.SUPPRESS, **kwargs)
    table.paths[action.dest]  # a parameter the table does not know fails here, at parser construction
    if show_default:
        action.config_default = functools.partial(table.default, action.dest)
    return action


def _given(args: argparse.Namespace, table: Parameters) -> dict:
    """The parameters of `table` that were given on the command line."""
    return {key: getattr(args, key) for key in table.paths if key in args}


class _Mapping(argparse.Action):
    """A repeatable KEY=VALUE option (its `type` gives the pair) gathered into one mapping."""

    def __call__(self, parser, namespace, values, option_string=None):
        key, value = values
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest, None) or {}), key: value})


def _absolute(path: str) -> str:
    return os.path.abspath(path)


def _source_arg(value: str) -> tuple[str, str | None]:
    name, sep, location = value.partition("=")
    return name, (location or None) if sep else None


def _source_map(pairs: list[tuple[str, str | None]]) -> dict[str, str | None]:
    """--source NAME[=LOCATION] options as a mapping; a source named twice is refused."""
    sources: dict[str, str | None] = {}
    for name, location in pairs:
        if name in sources:
            raise SourceError(f"--source {name}: given twice; keep one")
        sources[name] = location
    return sources


def _source_names() -> str:
    return ", ".join(f"{name} ({source.hub_repo or 'a `trajforge synth` output folder'})"
                     for name, source in REGISTRY.items())


def _add_build(sub: argparse._SubParsersAction) -> None:
    # Given options override the --config file; the defaults themselves are BuildRun's
    # (flows/config.py) and the stage configs'.
    p = sub.add_parser("build", help="build the dataset from upstream sources (a Prefect flow)")
    option = functools.partial(_option, p, BUILD)
    stage_option = functools.partial(option, show_default=False)
    p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="YAML build config (configs/build.yaml shows every key): out, sources, runner, workers "
                        "and the stages' settings under `stages`; the options below override it")
    option("--source", dest="sources", action="append", type=_source_arg, metavar="NAME[=PATH_OR_REPO]",
           help=f"a source to read (repeatable; replaces the config's sources): NAME alone reads its Hub "
                f"repo; NAME=PATH a local folder or file (a path that exists, whose first folder exists, or "
                f"that starts with . / ~); NAME=ORG/REPO another Hub repo. Sources: {_source_names()}. "
                f"Default: {', '.join(DEFAULT_SOURCES)} from the Hub")
    option("--source-as", action="append", metavar="NAME",
           help="read source NAME's files as NAME even where they look like another source's (file names, "
                "ids); without it such a build is refused, since it would publish one dataset under "
                "another's name and license (repeatable; replaces the config's source_as)")
    option("--out", help="output folder: new, empty, or an earlier build (rebuilt); required here or in the config")
    option("--overwrite", action="store_true",
           help="build into an --out folder that holds other files (they may be replaced)")
    stage_option("--rendering", choices=["native", "react"],
                 help="assistant turn text: upstream wording (native) or Think/Act (react); default: the "
                      "normalize stage's")
    option("--runner", choices=(AUTO, *RUNNERS),
           help="where the per-unit steps run (units, band screens, outputs, shards): local processes "
                "or threads, or a Dask / Ray cluster (extras dask, ray); auto: an input of local files up "
                f"to {SMALL_INPUT_BYTES // 2**20} MiB builds in this process (without Prefect when no Prefect "
                f"server is set), a larger one on processes")
    option("--workers", type=int, metavar="N", help="processes or threads, or workers of a local cluster")
    option("--address", help="cluster address for --runner dask (tcp://host:8786) or ray (ray://host:10001); "
                             "default: start a local cluster")
    stage_option("--decontaminate", metavar="FILE", type=_absolute,
                 help="evaluation tasks (one per line, or JSON/JSONL strings or {task}); trajectories whose "
                      "task shares a word n-gram (stages.decontaminate_ngram words) with one go to the "
                      "quarantine as `contaminated`")
    stage_option("--rl-tasks", action="append", metavar="FILE", type=_absolute,
                 help="a task file (AgentBench OS/DB, JSONL of {env, description, ...}; repeatable) whose tasks "
                      "join the `grpo_env` config for multi-turn GRPO")
    stage_option("--invalid-steps", metavar="mask|drop|keep",
                 help="a step the env refused inside an episode: kept as context with loss false (mask), its "
                      "record quarantined (drop), or trained on (keep); default: the validate stage's")
    stage_option("--dedup-threshold", type=float, metavar="J",
                 help="shingle Jaccard similarity from which two trajectories are near duplicates "
                      "(stages.dedup.threshold; default: the dedup stage's)")
    p.set_defaults(func=_run_build)


def _config_file(args: argparse.Namespace) -> tuple[dict, str]:
    """(the --config file's mapping, the name its errors give): no file is an empty mapping."""
    if "config" in args:
        return read_config(args.config), args.config
    return {}, "options"


def _build_run(args: argparse.Namespace) -> BuildRun:
    """The config file (if any) with the given options laid over it."""
    data, where = _config_file(args)
    given = _given(args, BUILD)
    if "sources" in given:
        given["sources"] = _source_map(given["sources"])
    return build_run(given, where, data)


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


@contextlib.contextmanager
def _flow_api(small: bool):
    """Yields `api()`: the context a build's flow runs in, or None where the build runs in this
    process (a `small` local input and no Prefect server set: a temporary server and worker processes
    would take longer than the build). A temporary server (flows/temporary_server.py), the slowest
    part to be ready (~4 s), starts on entering unless the input is small or PREFECT_API_URL names a
    server: Prefect's own imports (~1 s, in `api()`) then run while it starts. Where Prefect's
    settings name an API after all, it is stopped unused; otherwise after the body."""
    from trajforge.flows.temporary_server import TemporaryServer

    server = None if small or os.environ.get("PREFECT_API_URL") else TemporaryServer().start()

    def api():
        if _prefect_server_set():
            if server is not None:
                server.stop()
            return contextlib.nullcontext
        return None if small else server.api

    try:
        yield api
    finally:
        if server is not None:
            server.stop()


def _small_local_input(run: BuildRun) -> bool:
    """`--runner auto` on local files small enough that the build takes seconds."""
    from trajforge.sources.locate import is_local_path

    sources = run.sources or dict.fromkeys(DEFAULT_SOURCES)
    if run.runner != AUTO or not all(location and is_local_path(location) for location in sources.values()):
        return False
    return sum(f.path.stat().st_size for name, location in sources.items()
               for f in get_source(name).files(location)) <= SMALL_INPUT_BYTES


def _run_build(args: argparse.Namespace) -> int:
    run = _build_run(args)
    _check_build_args(run)
    small = _small_local_input(run)
    with _flow_api(small) as api:
        # The stages' settings, checked before this process loads Prefect, while the temporary server
        # starts (loading the stages takes ~0.8 s: the server used to start that much later). A bad
        # setting stops the server unused.
        config = stage_config(run.stages, args.config if "config" in args else "options")
        fork_server = not small and run.runner in (AUTO, "processes")
        if fork_server:
            from trajforge.flows.workers import start_fork_server

            # The workers' imports, on another core while this process loads Prefect and the temporary
            # server starts (flows/workers.py).
            start_fork_server()
        on_api = api()
        if on_api is None:
            from trajforge.pipeline.build import build_in_process, summary_lines

            if args.verbose:  # Prefect, when loaded, has its console handler; here nothing else shows the logs
                logging.basicConfig(format="%(asctime)s | %(levelname)-7s | %(name)s - %(message)s")
            report = build_in_process(run.sources, Path(run.out), config)
        else:
            from trajforge.flows.build import build_dataset
            from trajforge.pipeline.build import summary_lines

            try:
                with on_api():
                    report = build_dataset(config=dataclasses.asdict(run))
            finally:
                if fork_server:
                    from trajforge.flows.workers import stop_fork_server

                    stop_fork_server()
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


def _add_model_options(option, episodes: bool = True) -> None:
    """The model endpoint's options (LLMConfig: llm.*) a model-calling command shares, and with
    `episodes` the episode's (AgentConfig: agent.*) and the environments alive at once."""
    option("--base-url", help="OpenAI-compatible endpoint, e.g. http://localhost:8000/v1 "
                              "(default: TRAJFORGE_BASE_URL or the OpenAI API)")
    option("--concurrency", type=int, help="LLM requests in flight")
    option("--sampling", action=_Mapping, type=_sampling_arg, metavar="KEY=VALUE",
           help="override a sampling default (temperature=0.7, top_k=null removes it); repeatable")
    if episodes:
        option("--episodes", type=int, dest="episode_concurrency", metavar="N", help="environments alive at once")
        option("--max-turns", type=int, help="the episode's turn budget: model turns before it ends as max_turns")
        option("--max-tokens", type=int, help="completion tokens per request (default: the model family's)")


_BACKEND_HELP = "openai: any OpenAI-compatible server at --base-url; vllm: in-process vLLM (GPU)"


def _add_synth(sub: argparse._SubParsersAction) -> None:
    from trajforge.pipeline.synth.config import KEEP, SEARCH_STRATEGIES, VALUE_MODELS

    # Given options override the --config file; the defaults shown are the dataclasses'
    # (pipeline/synth/config.py), which hold them.
    p = sub.add_parser("synth", help="synthesize trajectories with a model against an environment (a Prefect flow)")
    option = functools.partial(_option, p, SYNTH)
    p.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                   help="YAML synth config in the shape of SynthConfig (configs/synth.yaml shows every key: "
                        "llm: and agent: sections, and api_key_env); the options below override it")
    option("--tasks", help="task file: AgentBench OS JSON, DBBench JSONL, or plain JSONL (required here or in the "
                           "config)")
    option("--env", help="an environment that runs, e.g. os, db, babyai, textcraft, sciworld, agentgym (an "
                           "unknown name is refused with the list; required here or in the config)")
    option("--model", help="model name as the server knows it (family defaults follow it; required here or in the "
                           "config)")
    option("--n", type=int, help="samples per task (best-of-N)")
    option("--out", help="output folder (rerunning into it resumes; required here or in the config)")
    option("--keep", choices=KEEP, help="records per task: the best success or all")
    _add_model_options(option)
    option("--seed", type=int, help="sample k uses seed+k")
    option("--backend", choices=["openai", "vllm"], help=_BACKEND_HELP)
    p.add_argument("--api-key-env", metavar="VAR", default=argparse.SUPPRESS,
                   help="environment variable holding the API key (default: TRAJFORGE_API_KEY, OPENAI_API_KEY); "
                        "the key itself is never an argument")
    option("--license", help="license of the task source, stamped on the records")
    option("--timeout", type=float, dest="timeout_s", metavar="SECONDS", help="per request")
    option("--max-retries", type=int, metavar="N", help="retries of a request that failed for a transient reason")
    option("--max-connection-failures", type=int, metavar="N",
           help="stop the job after N requests in a row could not connect, or at the first refused connection "
                "of a server that has not answered yet (0: never)")
    option("--search", choices=SEARCH_STRATEGIES,
           help="grow a search tree per task instead of --n independent episodes; also writes the tree, step "
                "values and step pairs under OUT/search/ (default: no search)")
    option("--branch", type=int, metavar="K", help="candidate next steps proposed at a state (beam: its width)")
    option("--max-calls", type=int, metavar="N", help="LLM calls per task in a search")
    option("--max-task-tokens", type=int, metavar="N", help="completion tokens per task in a search (default: no "
                                                            "limit)")
    option("--value-model", choices=VALUE_MODELS,
           help="score non-terminal states: judge asks the model itself (default: none)")
    p.set_defaults(func=_run_synth)


def _synth_run(args: argparse.Namespace) -> tuple[dict, str | None, dict]:
    """(the config file's mapping, the API key variable, the given options), checked as one config."""
    config, where = _config_file(args)
    api_key_env = config.pop("api_key_env", None)
    if api_key_env is not None and not isinstance(api_key_env, str):
        raise ConfigError(f"{where}: api_key_env must be the name of an environment variable")
    api_key_env = getattr(args, "api_key_env", api_key_env)
    given = _given(args, SYNTH)
    job = synth_config(merge(config, SYNTH.nested(given)), where)
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


def _add_api_key_env(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-env", metavar="VAR",
                   help="environment variable holding the API key (default: TRAJFORGE_API_KEY, OPENAI_API_KEY)")


def _add_select_steps(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("select-steps", help="flag the critical steps of trajectories with a model, ATLaS (a Prefect flow)")
    option = functools.partial(_option, p, SELECT_STEPS)
    p.add_argument("inputs", help="records to judge: a build folder (data/sft), a synth folder, or a Parquet file")
    p.add_argument("--out", required=True, help="output folder, same layout as the input (rerunning into it resumes)")
    p.add_argument("--model", required=True, help="selector model name as the server knows it")
    option("--config", dest="config_name", metavar="NAME", help="release config to judge in a build folder")
    option("--env", dest="envs", action="append", metavar="ENV", help="judge only records of this env (repeatable)")
    _add_model_options(option, episodes=False)
    option("--batch-size", type=int, help="records in flight")
    option("--max-tokens", type=int, help="completion tokens per judgement (default: the model family's)")
    option("--backend", choices=["openai", "vllm"], help=_BACKEND_HELP)
    _add_api_key_env(p)
    p.set_defaults(func=_run_select_steps)


def _check_select_steps_args(given: dict) -> None:
    if not os.path.exists(given["inputs"]):
        raise SourceError(f"select-steps {given['inputs']}: no such file or folder; give a build folder, a synth "
                          f"folder or a Parquet file of records")
    _need_out_folder(given["out"])
    _need_at_least("--concurrency", given.get("concurrency"))
    _need_at_least("--batch-size", given.get("batch_size"))


def _run_select_steps(args: argparse.Namespace) -> int:
    given = _given(args, SELECT_STEPS)
    _check_select_steps_args(given)
    from trajforge.flows.select_steps import select_steps
    from trajforge.pipeline.quality.critical_steps import summary_lines

    report = select_steps(api_key_env=args.api_key_env, **given)
    print("\n".join(summary_lines(report)))
    print(f"records: {args.out}  failures: {args.out}/select_failures.parquet  report: {args.out}/report.json")
    return 0


def _add_salvage(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("salvage", help="replay prefixes of failed runs and keep successful continuations, EEF "
                                       "(a Prefect flow)")
    option = functools.partial(_option, p, SALVAGE)
    p.add_argument("failures", nargs="+", help="failures.parquet of `trajforge synth`, or records with success false")
    p.add_argument("--tasks", required=True, help="the task file the failures were run on")
    p.add_argument("--out", required=True, help="output folder (rerunning into it resumes)")
    p.add_argument("--model", required=True, help="model name as the server knows it")
    option("--max-prefixes", type=int, help="prefixes tried per failure, longest first")
    option("--max-calls", type=int, help="LLM call budget for the run (cache hits are free)")
    _add_model_options(option)
    option("--backend", choices=["openai", "vllm"], help=_BACKEND_HELP)
    _add_api_key_env(p)
    p.set_defaults(func=_run_salvage)


def _check_salvage_args(given: dict):
    """The checked `SalvageConfig` of the given options."""
    for path in given["failures"]:
        _need_file("salvage", path, "the failures.parquet of `trajforge synth`, or records with success false")
    _need_file("--tasks", given["tasks"], "the task file the failures were run on")
    _need_out_folder(given["out"])
    for key, flag in (("max_prefixes", "--max-prefixes"), ("concurrency", "--concurrency"),
                      ("episode_concurrency", "--episodes"), ("max_turns", "--max-turns")):
        _need_at_least(flag, given.get(key))
    _need_at_least("--max-calls", given.get("max_calls"), 0)
    return SALVAGE.config_of(given, "options")


def _run_salvage(args: argparse.Namespace) -> int:
    given = _given(args, SALVAGE)
    config = _check_salvage_args(given)
    from trajforge.flows.salvage import salvage

    report = salvage(api_key_env=args.api_key_env, **given)
    outcomes = ", ".join(f"{k}={v}" for k, v in report["outcomes"].items()) or "-"
    print(f"{report['failures']} failures ({outcomes}); {report['records']} records with {report['beneficial_steps']} "
          f"beneficial steps; {report['llm']['calls']} LLM calls (budget {config.max_calls}), "
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
    option = functools.partial(_option, p, RFT)
    option("--source", dest="sources", action="append", type=_source_arg, metavar="NAME[=PATH_OR_REPO]",
           help="a source of the build (repeatable), as for `trajforge build`")
    p.add_argument("--tasks", required=True, help="task file the served checkpoint is sampled on each round (its "
                                                  "successes are trained on)")
    p.add_argument("--env", required=True, help="environment of the tasks, one that runs (an unknown name is "
                                                "refused with the list)")
    p.add_argument("--base-model", required=True, help="model every round fine-tunes (folder or Hub id)")
    p.add_argument("--out", required=True, help="output folder")
    option("--rounds", type=int, help="build, SFT, serve, synthesize rounds")
    p.add_argument("--sft-config", required=True, help="SFT YAML config (training/configs/sft_*.yaml)")
    option("--serve", type=_serve_arg,
           help="server for the checkpoint: transformers (CPU), vllm (GPU), or a command with {model} "
                "and {port} placeholders")
    option("--n", type=int, help="samples per round task")
    option("--max-turns", type=int, help="the episode's turn budget: model turns before it ends as max_turns")
    option("--max-tokens", type=int, help="completion tokens per request (default: the model family's)")
    option("--eval-tasks", metavar="FILE",
           help="held-out tasks each round is evaluated on (default: the env's declared eval split without "
                "the --tasks)")
    option("--eval-n", type=int, help="samples per held-out task")
    p.set_defaults(func=_run_rft)


def _check_base_model(base_model: str) -> None:
    from trajforge.sources.locate import is_local_path

    if is_local_path(base_model):
        if not os.path.isdir(os.path.expanduser(base_model)):
            raise SourceError(f"--base-model {base_model}: no such model folder; give a model folder or a Hub "
                              f"model id (ORG/NAME)")
        return
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(base_model)
    except HFValidationError:
        raise SourceError(f"--base-model {base_model}: neither a model folder nor a Hub model id "
                          f"(ORG/NAME)") from None


def _rft_given(args: argparse.Namespace) -> dict:
    """The rft flow's parameters from the options, checked."""
    given = {**_given(args, RFT), "sft_args": ["--config", args.sft_config]}
    given["sources"] = _source_map(given["sources"]) if "sources" in given else RFT.default("sources")
    _known_sources(given["sources"])
    _need_file("--tasks", args.tasks, "the held-out task file (AgentBench OS JSON, DBBench JSONL, or JSONL)")
    _need_env(args.env)
    _need_file("--sft-config", args.sft_config, "an SFT config (training/configs/sft_*.yaml)")
    if "eval_tasks" in given:
        _need_file("--eval-tasks", given["eval_tasks"], "a held-out task file of the same env")
        given["eval_tasks"] = os.path.abspath(given["eval_tasks"])
    _check_base_model(args.base_model)
    _need_out_folder(args.out)
    for key in ("rounds", "n", "max_turns", "eval_n"):
        _need_at_least("--" + key.replace("_", "-"), given.get(key))
    _readable_sources(given["sources"])
    return given


def _run_rft(args: argparse.Namespace) -> int:
    given = _rft_given(args)
    from trajforge.flows.rft import rft

    report = rft(**given)
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
    p = sub.add_parser("eval", help="evaluate a model on held-out benchmark tasks, with oracle and random "
                                    "calibration (a Prefect flow)")
    option = functools.partial(_option, p, EVAL)
    p.add_argument("--out", required=True, help="output folder: eval.json, report.html, episodes.parquet "
                                                "(rerunning into it resumes)")
    option("--model", help="model name as the server knows it, or with --serve the checkpoint folder; without it "
                           "only the oracle and random policies run")
    p.add_argument("--serve", type=_serve_arg, metavar="SERVER",
                   help="serve the --model checkpoint for the run: transformers (CPU), vllm (GPU), or a command "
                        "with {model} and {port}")
    option("--label", help="name of this checkpoint in the results table (default: the model)")
    option("--env", dest="envs", action="append", metavar="ENV", show_default=False,
           help="an env to evaluate (repeatable; default: every env with a declared held-out split: os, db, babyai)")
    option("--tasks", action=_Mapping, type=_env_file_arg, metavar="ENV=FILE",
           help="evaluate ENV on the tasks of FILE instead of its declared split (repeatable)")
    option("--n", type=int, help="samples per task (pass@k for k up to n)")
    # The command keeps a results table by default; the flow (and EvalConfig) only when named.
    p.add_argument("--results", default="results", metavar="DIR",
                   help="folder of the results table (results.parquet, results.csv) that runs append to")
    option("--train-data", metavar="BUILD", help="the model's training build: refuse when it holds eval tasks")
    option("--allow-overlap", action="store_true",
           help="evaluate anyway when --train-data holds eval tasks (warned in the log, eval.json and report)")
    option("--no-calibration", dest="calibrate", action="store_const", const=[], show_default=False,
           help="skip the oracle and random policies")
    p.add_argument("--agentgym-url", help="AgentGym server for `agentgym` tasks (--tasks agentgym=FILE)")
    _add_model_options(option)
    option("--seed", type=int, help="sample k uses seed+k")
    option("--timeout", type=float, dest="timeout_s", metavar="SECONDS", help="per request")
    option("--max-retries", type=int, metavar="N", help="retries of a request that failed for a transient reason")
    _add_api_key_env(p)
    p.set_defaults(func=_run_eval)


def _check_eval_inputs(envs: list[str], tasks: dict[str, str], train_data: str | None) -> None:
    from trajforge.pipeline.evaluation.splits import EVAL_SPLITS

    for env in [*envs, *tasks]:
        _need_env(env)
    for env in envs:
        if env not in EVAL_SPLITS and env not in tasks:
            raise SourceError(f"--env {env}: no declared held-out split (declared: {', '.join(EVAL_SPLITS)}); "
                              f"give its tasks with --tasks {env}=FILE")
    for path in [*tasks.values(), *([train_data] if train_data else [])]:
        if not os.path.exists(path):
            raise SourceError(f"eval: {path} does not exist")


def _eval_given(args: argparse.Namespace) -> dict:
    """The evaluate flow's parameters from the options, checked."""
    from trajforge.pipeline.envs import host

    given = _given(args, EVAL)
    envs, tasks = given.get("envs", []), given.get("tasks", {})
    _check_eval_inputs(envs, tasks, given.get("train_data"))
    if envs or tasks:
        given["envs"] = list(dict.fromkeys([*envs, *tasks]))
        given["tasks"] = {env: os.path.abspath(path) for env, path in tasks.items()}
    if args.serve:
        if not (args.model and os.path.isdir(args.model)):
            raise SourceError("--serve needs --model CHECKPOINT_FOLDER")
        given["model"] = os.path.abspath(args.model)
    if args.agentgym_url:
        given["env_kw"] = {host().name: {"base_url": args.agentgym_url}}
    return given


def _print_eval(report: dict, out: str) -> None:
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
    print(f"report: {out}/report.html  eval.json: {out}/eval.json"
          + (f"  results: {report['results']}" if report.get("results") else ""))


def _run_eval(args: argparse.Namespace) -> int:
    given = _eval_given(args)
    from trajforge.flows.eval import evaluate
    from trajforge.pipeline.evaluation.run import EvalRefused
    from trajforge.pipeline.llm.client import ServerUnreachable

    try:
        report = evaluate(serve=args.serve, api_key_env=args.api_key_env, **given)
    except EvalRefused as exc:
        print(f"trajforge: eval refused: {exc}", file=sys.stderr)
        return 2
    except ServerUnreachable as exc:
        print(f"trajforge: eval stopped: {exc.detail}", file=sys.stderr)
        return 1
    _print_eval(report, args.out)
    return 0


def _add_score(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("score", help="score trajectories with a reward model or an LLM judge; --min-score moves "
                                     "the low ones to the quarantine (a Prefect flow)")
    option = functools.partial(_option, p, SCORE)
    p.add_argument("inputs", help="records to score: a build folder (data/sft), a synth folder, or a Parquet file")
    p.add_argument("--out", required=True, help="output folder, same layout as the input, plus quarantine and report")
    p.add_argument("--scorer", required=True, choices=["rm", "prm", "judge"],
                   help="rm: outcome reward model (`trajforge train rm`), prm: process reward model (`trajforge "
                        "train prm`), judge: an LLM with a 0-5 rubric at --base-url")
    p.add_argument("--model", required=True, help="the trained model's folder (rm, prm) or the judge model's name")
    option("--min-score", type=float,
           help="records scored below this go to the quarantine as low_score (on the scorer's scale)")
    option("--config", dest="config_name", metavar="NAME", help="release config to score in a build folder")
    option("--batch-size", type=int, help="records in flight")
    option("--max-length", type=int, help="rm / prm: tokens per trajectory")
    option("--base-url", help="judge: OpenAI-compatible endpoint (default: TRAJFORGE_BASE_URL)")
    option("--concurrency", type=int, help="judge: LLM requests in flight")
    option("--sampling", action=_Mapping, type=_sampling_arg, metavar="KEY=VALUE",
           help="judge: override a sampling default; repeatable")
    option("--max-calls", type=int, help="judge: LLM call budget (cache hits are free)")
    option("--max-tokens", type=int, help="judge: completion tokens per rating")
    option("--backend", choices=["openai", "vllm"], help=_BACKEND_HELP)
    _add_api_key_env(p)
    p.set_defaults(func=_run_score)


def _run_score(args: argparse.Namespace) -> int:
    from trajforge.flows.score import score
    from trajforge.pipeline.quality.score import summary_lines

    if not os.path.exists(args.inputs):
        raise SourceError(f"score: {args.inputs} does not exist")
    if args.scorer != "judge" and not os.path.isdir(args.model):
        raise SourceError(f"score: --model {args.model} is not a folder with a trained reward model")
    report = score(api_key_env=args.api_key_env, **_given(args, SCORE))
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
    # Last of the exit handlers: the interpreter's collections at exit would walk every object of the
    # command's imports (Prefect, pydantic, pandas, matplotlib: ~0.4M objects), 2.5-5 s after a build
    # on 2 cores, to free what the process's end frees anyway. Frozen, they are not walked (~0.2 s).
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
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
