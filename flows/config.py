"""Run configuration files (`trajforge build --config build.yaml`): YAML onto nested dataclasses.

The dataclasses are the one statement of every default: a file names only what it changes, a
key no dataclass has is an error that names it, and command-line flags override the file. This
module is light (YAML and dataclasses only), so that the CLI checks a file before Prefect loads.
"""
from __future__ import annotations

import dataclasses
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


def _value(hint, value, key: str, where: str):
    hint, nullable = _non_null(hint)
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{where}: {key} must not be null")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key} must be a mapping of {', '.join(f.name for f in dataclasses.fields(hint))}")
        return from_dict(hint, value, where, f"{key}.")
    origin = typing.get_origin(hint) or hint
    if origin in _PLAIN:
        if isinstance(value, bool) and origin is not bool or not isinstance(value, _PLAIN[origin]):
            raise ConfigError(f"{where}: {key} must be {origin.__name__}, not {type(value).__name__} {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key} must be a list")
        return tuple(value) if origin is tuple else value
    if origin is dict and not isinstance(value, dict):
        raise ConfigError(f"{where}: {key} must be a mapping")
    return value


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
    stages: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.runner not in (AUTO, *RUNNERS):
            raise ValueError(f"runner must be one of {', '.join((AUTO, *RUNNERS))}, not {self.runner!r}")
        if self.workers < 1:
            raise ValueError("workers must be at least 1")


def load_build_run(path: str) -> BuildRun:
    return from_dict(BuildRun, read_config(path), path)


def stage_config(stages: dict, where: str):
    """The stages' `BuildConfig` from the `stages` mapping of a build config."""
    from trajforge.pipeline.build import BuildConfig

    return from_dict(BuildConfig, stages, where, "stages.")


# The synth flow's flat parameters (and the CLI's options) -> their place in a synth config file,
# which has the shape of `pipeline.synth.config.SynthConfig`.
SYNTH_PARAMETERS = {
    "tasks": "tasks", "env": "env", "out": "out", "n": "n", "keep": "keep",
    "episode_concurrency": "episode_concurrency", "backend": "backend", "env_kw": "env_kw",
    "model": "llm.model", "base_url": "llm.base_url", "sampling": "llm.sampling", "concurrency": "llm.concurrency",
    "timeout_s": "llm.timeout_s", "max_retries": "llm.max_retries",
    "max_connection_failures": "llm.max_connection_failures",
    "max_turns": "agent.max_turns", "max_tokens": "agent.max_tokens", "seed": "agent.seed", "license": "agent.license",
    "search": "search.strategy", "branch": "search.branch", "max_calls": "search.max_calls",
    "max_task_tokens": "search.max_tokens", "value_model": "search.value_model",
}
# Set by the run, never by a file: the key is read from the environment, the gate is Prefect's.
NOT_IN_FILES = {"llm.api_key": "name the environment variable that holds it with api_key_env",
                "llm.request_gate": "use the flow's api_limit / api_rate_limit"}


def nested(values: dict, paths: dict[str, str] = SYNTH_PARAMETERS) -> dict:
    """Flat values that were given (not None) as a nested mapping, placed by `paths`."""
    out: dict = {}
    for key, value in values.items():
        if value is None:
            continue
        *parents, leaf = paths[key].split(".")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return out


def synth_config(data: dict, where: str):
    """`SynthConfig` from a synth config mapping (tasks, env, out and llm.model are required)."""
    from trajforge.pipeline.synth.config import SynthConfig

    llm = data.get("llm")
    for path, instead in NOT_IN_FILES.items():
        if isinstance(llm, dict) and path.split(".")[1] in llm:
            raise ConfigError(f"{where}: {path} cannot be set here; {instead}")
    for flat in ("tasks", "env", "out", "model"):
        *parents, leaf = SYNTH_PARAMETERS[flat].split(".")
        node = data.get(parents[0], {}) if parents else data
        if not isinstance(node, dict) or node.get(leaf) is None:
            raise ConfigError(f"synth: no {flat}; give --{flat} (or `{SYNTH_PARAMETERS[flat]}` in the --config file)")
    return from_dict(SynthConfig, data, where)
