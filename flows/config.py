"""Every command's run configuration: flow parameters, CLI flags and YAML files onto nested dataclasses.

The dataclasses are the one statement of every default. Each command has one `Parameters` table
(flat parameter -> place in its config) that its flow and its CLI options share: a flow parameter
left None, or an option not given, keeps the dataclass's value; a file (`--config`) names only
what it changes, a key no dataclass has is an error that names it, and flags override the file.
This module is light (YAML and dataclasses only), so that the CLI checks its arguments before
Prefect loads; a command's config class is imported only when that command runs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trajforge.sources import SourceError


class ConfigError(SourceError):
    """An unusable configuration file; the CLI exits 2 with its one-line message."""


def read_config(path: str) -> dict:
    """The mapping at the top of a YAML file (an empty file is an empty mapping)."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}; give a YAML file") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" (line {where.line + 1})" if where else ""
        raise ConfigError(f"--config {path}: not valid YAML{at}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of keys, not {type(data).__name__}")
    return data


def _non_null(hint) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed) of an annotation."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False


_PLAIN = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}


def _nested_value(hint, value, key: str, where: str):
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {key} must be a mapping of {', '.join(f.name for f in dataclasses.fields(hint))}")
    return from_dict(hint, value, where, f"{key}.")


def _plain_value(kind, value, key: str, where: str):
    if isinstance(value, bool) and kind is not bool or not isinstance(value, _PLAIN[kind]):
        raise ConfigError(f"{where}: {key} must be {kind.__name__}, not {type(value).__name__} {value!r}")
    return value


def _container_value(kind, value, key: str, where: str):
    if kind in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: {key} must be a list")
        return tuple(value) if kind is tuple else list(value)
    if kind is dict and not isinstance(value, dict):
        raise ConfigError(f"{where}: {key} must be a mapping")
    return value


def _value(hint, value, key: str, where: str):
    hint, nullable = _non_null(hint)
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{where}: {key} must not be null")
    if dataclasses.is_dataclass(hint):
        return _nested_value(hint, value, key, where)
    kind = typing.get_origin(hint) or hint
    if kind in _PLAIN:
        return _plain_value(kind, value, key, where)
    return _container_value(kind, value, key, where)


def from_dict(cls, data: dict, where: str, prefix: str = ""):
    """An instance of dataclass `cls` from a mapping: unset fields keep their defaults, nested
    dataclasses come from nested mappings. `where` (the file) and `prefix` name a bad key."""
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in data if key not in known]
    if unknown:
        raise ConfigError(f"{where}: unknown key {prefix}{unknown[0]}; known under {prefix.rstrip('.') or 'the top'}: "
                          f"{', '.join(known)}")
    hints = typing.get_type_hints(cls)
    kwargs = {key: _value(hints[key], value, f"{prefix}{key}", where) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'config'}: {exc}") from None


def merge(base: dict, overrides: dict) -> dict:
    """`base` with `overrides` laid over it, nested mappings merged key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


RUNNERS = ("processes", "threads", "dask", "ray")
# The default: the runner chosen by the size of the input. Up to SMALL_INPUT_BYTES the work takes
# seconds, less than spawning worker processes that each import the stages; the CLI then runs the
# build in its own process, without Prefect when no Prefect server is configured.
AUTO = "auto"
SMALL_INPUT_BYTES = 16 * 2**20


def auto_runner(input_bytes: int) -> str:
    """What `auto` means for an input of this size: threads (no worker to spawn) or processes."""
    return "threads" if input_bytes <= SMALL_INPUT_BYTES else "processes"


def _load(reference: str):
    """The object `module:name` names. Config modules load only for the command that runs, so
    that `--help` and the argument checks stay fast."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


def default_of(cls, path: str):
    """The default of the field at the dotted `path` under dataclass `cls` (None: it has none). A
    mapping field whose metadata names a config (`BuildRun.stages`) is walked as that config."""
    head, _, rest = path.partition(".")
    found = next(f for f in dataclasses.fields(cls) if f.name == head)
    value = (found.default if found.default is not dataclasses.MISSING else
             found.default_factory() if found.default_factory is not dataclasses.MISSING else None)
    if not rest:
        return value
    if dataclasses.is_dataclass(value):
        return functools.reduce(getattr, rest.split("."), value)
    inner = found.metadata.get("config")
    return default_of(_load(inner) if inner else _non_null(typing.get_type_hints(cls)[head])[0], rest)


@dataclass(frozen=True)
class Parameters:
    """A command's flat parameters (its flow's keyword arguments and its CLI options) and their place
    in its config dataclass (`module:Class`), which states every default once: a parameter left
    None, or an option not given, keeps the dataclass's value (or the config file's)."""
    config: type | str
    paths: dict[str, str]
    # Top-level parameters whose given value replaces the file's mapping instead of merging into it.
    replace: tuple[str, ...] = ()

    @property
    def config_class(self) -> type:
        return _load(self.config) if isinstance(self.config, str) else self.config

    def default(self, name: str):
        """What parameter `name` is when neither a flag nor a file sets it."""
        return default_of(self.config_class, self.paths[name])

    def nested(self, values: dict) -> dict:
        """The values that were given (not None) as a nested mapping in the config's shape."""
        out: dict = {}
        # Shallow paths first: a parameter inside a mapping that another one gives (a stage setting
        # inside `stages`) is laid over it; copies, so that a caller's mapping is never changed.
        for key in sorted(values, key=lambda key: self.paths[key].count(".")):
            if values[key] is None:
                continue
            *parents, leaf = self.paths[key].split(".")
            node = out
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = copy.deepcopy(values[key])
        return out

    def config_of(self, given: dict, where: str, data: dict | None = None):
        """The config from a file's mapping `data` with the `given` parameters laid over it."""
        base = {key: value for key, value in (data or {}).items() if key not in self.replace or given.get(key) is None}
        return from_dict(self.config_class, merge(base, self.nested(given)), where)


@dataclass
class BuildRun:
    """`trajforge build --config FILE`: what to read, where to write and run; `stages` is the
    stages' own configuration (`pipeline.build.BuildConfig`, checked when the build starts)."""
    out: str | None = None
    overwrite: bool = False
    # Source name -> local path or Hub repo id (null: its Hub repo); empty: the default sources.
    sources: dict[str, str | None] = field(default_factory=dict)
    # Sources whose files are read as that source although they look like another's (the user's word).
    source_as: list[str] = field(default_factory=list)
    runner: str = AUTO
    address: str | None = None   # Dask / Ray cluster address; None starts a local cluster
    workers: int = 4             # threads, or local cluster workers
    stages: dict[str, Any] = field(default_factory=dict, metadata={"config": "trajforge.pipeline.build:BuildConfig"})

    def __post_init__(self):
        if self.runner not in (AUTO, *RUNNERS):
            raise ValueError(f"runner must be one of {', '.join((AUTO, *RUNNERS))}, not {self.runner!r}")
        if self.workers < 1:
            raise ValueError("workers must be at least 1")


# The build flow's parameters (and the CLI's options); `--source` replaces the file's sources.
BUILD = Parameters(BuildRun, {
    "out": "out", "overwrite": "overwrite", "sources": "sources", "source_as": "source_as", "runner": "runner",
    "address": "address", "workers": "workers", "stages": "stages", "rendering": "stages.rendering",
    "invalid_steps": "stages.invalid_steps", "dedup_threshold": "stages.dedup.threshold",
    "shard_rows": "stages.shards.max_rows", "decontaminate": "stages.decontaminate", "rl_tasks": "stages.rl_tasks",
}, replace=("sources",))


def build_run(given: dict, where: str, data: dict | None = None) -> BuildRun:
    """The build's `BuildRun`: a config file's mapping `data` with the given parameters over it."""
    run = BUILD.config_of(given, where, data)
    if run.out is None:
        raise ConfigError("build: no output folder; give --out DIR (or `out:` in the --config file)")
    return run


def stage_config(stages: dict, where: str):
    """The stages' `BuildConfig` from the `stages` mapping of a build config."""
    from trajforge.pipeline.build import BuildConfig

    return from_dict(BuildConfig, stages, where, "stages.")


# The synth flow's flat parameters (and the CLI's options) -> their place in a synth config file,
# which has the shape of `pipeline.synth.config.SynthConfig`.
SYNTH = Parameters("trajforge.pipeline.synth.config:SynthConfig", {
    "tasks": "tasks", "env": "env", "out": "out", "n": "n", "keep": "keep",
    "episode_concurrency": "episode_concurrency", "backend": "backend", "env_kw": "env_kw",
    "model": "llm.model", "base_url": "llm.base_url", "sampling": "llm.sampling", "concurrency": "llm.concurrency",
    "timeout_s": "llm.timeout_s", "max_retries": "llm.max_retries",
    "max_connection_failures": "llm.max_connection_failures",
    "max_turns": "agent.max_turns", "max_tokens": "agent.max_tokens", "seed": "agent.seed", "license": "agent.license",
    "search": "search.strategy", "branch": "search.branch", "max_calls": "search.max_calls",
    "max_task_tokens": "search.max_tokens", "value_model": "search.value_model",
})
# Set by the run, never by a file: the key is read from the environment, the gate is Prefect's.
NOT_IN_FILES = {"llm.api_key": "name the environment variable that holds it with api_key_env",
                "llm.request_gate": "use the flow's api_limit / api_rate_limit"}


def synth_config(data: dict, where: str):
    """`SynthConfig` from a synth config mapping (tasks, env, out and llm.model are required)."""
    llm = data.get("llm")
    for path, instead in NOT_IN_FILES.items():
        if isinstance(llm, dict) and path.split(".")[1] in llm:
            raise ConfigError(f"{where}: {path} cannot be set here; {instead}")
    for flat in ("tasks", "env", "out", "model"):
        *parents, leaf = SYNTH.paths[flat].split(".")
        node = data.get(parents[0], {}) if parents else data
        if not isinstance(node, dict) or node.get(leaf) is None:
            raise ConfigError(f"synth: no {flat}; give --{flat} (or `{SYNTH.paths[flat]}` in the --config file)")
    return from_dict(SYNTH.config_class, data, where)


# The other model-calling commands: flow parameter -> place in the command's config. The model
# endpoint's settings (model, base_url, sampling, concurrency) are the job's `llm` (LLMConfig), the
# episode's (max_turns: the turn budget of one episode) its `agent` (AgentConfig).
_LLM = {"model": "llm.model", "base_url": "llm.base_url", "sampling": "llm.sampling", "concurrency": "llm.concurrency"}
SALVAGE = Parameters("trajforge.pipeline.synth.salvage:SalvageConfig", {
    **_LLM, "failures": "failures", "tasks": "tasks", "out": "out", "max_prefixes": "max_prefixes",
    "max_calls": "max_calls", "episode_concurrency": "episode_concurrency", "max_turns": "agent.max_turns",
    "max_tokens": "agent.max_tokens", "backend": "backend", "license": "agent.license",
})
SELECT_STEPS = Parameters("trajforge.pipeline.quality.critical_steps:SelectConfig", {
    **_LLM, "inputs": "inputs", "out": "out", "config_name": "config_name", "batch_size": "batch_size",
    "max_tokens": "max_tokens", "backend": "backend", "envs": "envs",
})
# The judge's model is the scorer's `model`, not `llm.model`.
SCORE = Parameters("trajforge.pipeline.quality.score:ScoreConfig", {
    "base_url": "llm.base_url", "sampling": "llm.sampling", "concurrency": "llm.concurrency",
    "inputs": "inputs", "out": "out", "scorer": "scorer", "model": "model", "min_score": "min_score",
    "config_name": "config_name", "batch_size": "batch_size", "max_length": "max_length", "max_calls": "max_calls",
    "max_tokens": "max_tokens", "backend": "backend",
})
EVAL = Parameters("trajforge.pipeline.evaluation.run:EvalConfig", {
    **_LLM, "timeout_s": "llm.timeout_s", "max_retries": "llm.max_retries", "out": "out", "envs": "envs",
    "label": "label", "tasks": "tasks", "n": "n", "calibrate": "calibrate", "max_turns": "agent.max_turns",
    "max_tokens": "agent.max_tokens", "seed": "agent.seed", "episode_concurrency": "episode_concurrency",
    "env_kw": "env_kw", "results": "results", "train_data": "train_data", "allow_overlap": "allow_overlap",
    "backend": "backend", "exclude": "exclude",
})
RFT = Parameters("trajforge.pipeline.synth.config:RFTConfig", {
    "sources": "sources", "tasks": "tasks", "env": "env", "base_model": "base_model", "out": "out",
    "rounds": "rounds", "sft_args": "sft_args", "serve": "serve", "n": "n", "max_turns": "agent.max_turns",
    "max_tokens": "agent.max_tokens", "concurrency": "llm.concurrency", "sampling": "llm.sampling",
    "startup_timeout_s": "startup_timeout_s", "eval_tasks": "eval_tasks", "eval_n": "eval_n",
})
