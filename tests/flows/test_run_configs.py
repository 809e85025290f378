"""`trajforge build|synth --config FILE`: the shipped examples, validation, and flags over the file.

The examples run end to end through the real CLI in tests/e2e/test_build_e2e.py and tests/synth/test_synth.py.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.paths import AGENT_FLAN, FIXTURE_SOURCES, REPO
from trajforge.flows.cli import _build_run, _given, _synth_run, parser
from trajforge.flows.config import (
    BUILD,
    EVAL,
    RFT,
    SALVAGE,
    SCORE,
    SELECT_STEPS,
    SYNTH,
    BuildRun,
    ConfigError,
    from_dict,
    merge,
    read_config,
    stage_config,
    synth_config,
)
from trajforge.pipeline.build import BuildConfig
from trajforge.pipeline.evaluation.run import EvalConfig
from trajforge.pipeline.ingest.validate import validate_record
from trajforge.pipeline.llm.client import LLMConfig
from trajforge.pipeline.quality.critical_steps import SelectConfig
from trajforge.pipeline.quality.dedup import DedupConfig
from trajforge.pipeline.quality.score import ScoreConfig
from trajforge.pipeline.synth.config import AgentConfig, RFTConfig, SynthConfig
from trajforge.pipeline.synth.salvage import SalvageConfig
from trajforge.sources import REGISTRY

EXAMPLE = REPO / "configs" / "build.yaml"
SYNTH_EXAMPLE = REPO / "configs" / "synth.yaml"


def build_args(*argv: str):
    return parser().parse_args(["build", *argv])


def load_build_run(path: str) -> BuildRun:
    return from_dict(BuildRun, read_config(path), path)


def test_example_config_loads_and_states_the_defaults():
    run = load_build_run(str(EXAMPLE))
    # Every fixture source (test_build_e2e builds from this file and checks the fixture counts).
    assert {name: (REPO / path).resolve() for name, path in run.sources.items()} == {
        name: Path(path).resolve() for name, path in {**FIXTURE_SOURCES, "agent_flan": AGENT_FLAN}.items()}
    assert set(run.sources) <= set(REGISTRY)
    # The example shows the defaults; it must not drift from the dataclasses that state them.
    assert stage_config(run.stages, str(EXAMPLE)) == BuildConfig()
    assert (run.runner, run.workers) == (BuildRun.runner, BuildRun.workers)


def test_flags_override_the_file(monkeypatch):
    monkeypatch.chdir(REPO)
    run = _build_run(build_args("--config", str(EXAMPLE), "--out", "elsewhere", "--dedup-threshold", "0.9",
                                "--workers", "2", "--rendering", "react", "--source", "agentinstruct=x",
                                "--invalid-steps", "drop"))
    assert (run.out, run.workers, run.sources) == ("elsewhere", 2, {"agentinstruct": "x"})
    config = stage_config(run.stages, "test")
    assert config.dedup == DedupConfig(threshold=0.9) and config.rendering == "react"
    assert config.invalid_steps == "drop" and config.validate.invalid_steps == "drop"
    assert config.negatives == BuildConfig().negatives  # the file's other stage settings stay


def test_without_a_file_the_flags_alone_decide():
    run = _build_run(build_args("--out", "o"))
    assert run == BuildRun(out="o")
    assert stage_config(run.stages, "options") == BuildConfig()


@pytest.mark.parametrize("text, says", [
    ("workers: four\n", "workers must be int, not str 'four'"),
    ("runner: slurm\n", "runner must be one of auto, processes, threads, dask, ray"),
    ("stages: [1]\n", "stages must be a mapping"),
    ("- out\n", "expected a mapping of keys, not list"),
    ("out: [unclosed\n", "not valid YAML (line 2)"),
])
def test_bad_values_name_the_key(tmp_path: Path, text, says):
    path = tmp_path / "build.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"build\.yaml") as err:
        load_build_run(str(path))
    assert says in str(err.value)


@pytest.mark.parametrize("stages, says", [
    ({"dedup": {"treshold": 0.9}}, "unknown key stages.dedup.treshold; known under stages.dedup: near, threshold"),
    ({"dedup": {"threshold": 2.0}}, "stages.dedup: threshold must be in (0, 1], not 2.0"),
    ({"max_turn_chars": "many"}, "stages.max_turn_chars must be int"),
    ({"dedup": {"threshold": True}}, "stages.dedup.threshold must be float, not bool"),
    ({"invalid_steps": "skip"}, "stages: invalid_steps must be one of mask, drop, keep, not 'skip'"),
])
def test_stage_settings_are_checked(stages, says):
    with pytest.raises(ConfigError) as err:
        stage_config(stages, "build.yaml")
    assert says in str(err.value)


def test_lists_become_the_tuples_the_stages_hold():
    config = stage_config({"rl_tasks": ["a.jsonl"], "shards": {"max_rows": 10}}, "build.yaml")
    assert config.rl_tasks == ("a.jsonl",) and config.shards.max_rows == 10
    assert from_dict(BuildRun, {"sources": {"agentinstruct": None}}, "x").sources == {"agentinstruct": None}


def synth_args(*argv: str):
    return parser().parse_args(["synth", *argv])


def test_synth_example_loads_and_states_the_defaults():
    data = read_config(str(SYNTH_EXAMPLE))
    assert data.pop("api_key_env") is None
    config = synth_config(data, str(SYNTH_EXAMPLE))
    assert (REPO / config.tasks).is_file() and config.env == "db"
    assert config.llm == LLMConfig(model=config.llm.model, base_url=config.llm.base_url)
    assert config.agent == AgentConfig()
    assert config == SynthConfig(tasks=config.tasks, env="db", out=config.out, llm=config.llm)


def test_synth_flags_override_the_file():
    config, api_key_env, given = _synth_run(synth_args(
        "--config", str(SYNTH_EXAMPLE), "--n", "1", "--max-turns", "3", "--timeout", "30", "--api-key-env", "K",
        "--sampling", "temperature=0.5", "--sampling", "top_k=null"))
    assert api_key_env == "K" and "api_key_env" not in config
    job = synth_config(merge(config, SYNTH.nested(given)), "test")
    assert (job.n, job.agent.max_turns, job.llm.timeout_s) == (1, 3, 30.0)
    assert job.llm.sampling == {"temperature": 0.5, "top_k": None}
    assert job.llm.max_retries == LLMConfig.max_retries and job.keep == SynthConfig.keep


@pytest.mark.parametrize("data, says", [
    ({}, "no tasks; give --tasks"),
    ({"tasks": "t", "env": "db", "out": "o", "llm": {"model": "m", "api_key": "sk-1"}}, "llm.api_key cannot be set"),
    ({"tasks": "t", "env": "db", "out": "o", "llm": {"model": "m"}, "agent": {"max_turn": 3}},
     "unknown key agent.max_turn; known under agent: max_turns"),
    ({"tasks": "t", "env": "db", "out": "o", "llm": {"model": "m"}, "keep": "worst"}, "keep must be one of"),
])
def test_synth_config_is_checked(data, says):
    with pytest.raises(ConfigError) as err:
        synth_config(data, "synth.yaml")
    assert says in str(err.value)


# Every command: the options add no default of their own and the flows restate none; the config
# dataclasses state them. Each row: the command line with only what the command requires, the
# config those values alone make, and the flow.
LLM = LLMConfig(model="m")
COMMANDS = {
    "synth": (["--tasks", "t", "--env", "db", "--out", "o", "--model", "m"],
              SynthConfig(tasks="t", env="db", out="o", llm=LLM), "trajforge.flows.synth:synthesize"),
    "salvage": (["f.parquet", "--tasks", "t", "--out", "o", "--model", "m"],
                SalvageConfig(failures=["f.parquet"], tasks="t", out="o", llm=LLM), "trajforge.flows.salvage:salvage"),
    "select-steps": (["in", "--out", "o", "--model", "m"], SelectConfig(inputs="in", out="o", llm=LLM),
                     "trajforge.flows.select_steps:select_steps"),
    "score": (["in", "--out", "o", "--scorer", "rm", "--model", "m"],
              ScoreConfig(inputs="in", out="o", scorer="rm", model="m"), "trajforge.flows.score:score"),
    # The command keeps a results table where the flow keeps none unless named (the one option with
    # a default of its own); `envs` is the flow's (every declared split when not given).
    "eval": (["--out", "o"], EvalConfig(out="o", envs=["db"], results="results"), "trajforge.flows.eval:evaluate"),
    "rft": (["--tasks", "t", "--env", "db", "--base-model", "b", "--out", "o", "--sft-config", "s.yaml"],
            RFTConfig(tasks="t", env="db", base_model="b", out="o", sft_args=["--config", "s.yaml"]),
            "trajforge.flows.rft:rft"),
}
TABLES = {"build": BUILD, "synth": SYNTH, "salvage": SALVAGE, "select-steps": SELECT_STEPS, "score": SCORE,
          "eval": EVAL, "rft": RFT}
CLI_DEFAULTS = {("eval", "results"): "results"}


def subcommand(name: str) -> argparse.ArgumentParser:
    [commands] = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def at_path(config, path: str):
    """The value at a dotted path of a config instance (an `llm` that is None: LLMConfig's defaults)."""
    for part in path.split("."):
        config = getattr(LLMConfig() if config is None else config, part)
    return config


@pytest.mark.parametrize("command", TABLES)
def test_options_take_their_defaults_from_the_config(command):
    table = TABLES[command]
    options = [a for a in subcommand(command)._actions if a.option_strings and a.dest in table.paths]
    assert options
    for action in options:
        if not action.required:
            assert action.default == CLI_DEFAULTS.get((command, action.dest), argparse.SUPPRESS), action.dest
    if command == "build":  # parsed: test_without_a_file_the_flags_alone_decide
        return
    argv, expected, _ = COMMANDS[command]
    given = _given(parser().parse_args([command, *argv]), table)
    if command == "rft":
        given["sft_args"] = ["--config", "s.yaml"]
    config = table.config_of({"envs": ["db"], **given} if command == "eval" else given, "options")
    assert config == expected
    # --help shows the dataclass's default of each option not given.
    for action in options:
        if hasattr(action, "config_default") and action.dest not in given:
            assert action.config_default() == at_path(expected, table.paths[action.dest]), action.dest


@pytest.mark.parametrize("command", COMMANDS)
def test_flows_state_no_default_of_their_own(command):
    module, _, name = COMMANDS[command][2].partition(":")
    flow = getattr(importlib.import_module(module), name)
    parameters = inspect.signature(flow.fn).parameters
    table = TABLES[command]
    assert set(table.paths) <= set(parameters)
    for key in table.paths:
        assert parameters[key].default in (None, inspect.Parameter.empty), key


def test_a_build_config_sets_the_most_turns_a_record_may_have(fixtures_build):
    """`stages.max_record_turns` (the validator's limit, not an episode's `max_turns` budget)."""
    record = pq.read_table(fixtures_build / "data" / "sft").to_pylist()[0]
    turns = len(record["conversations"])
    assert validate_record(record, stage_config({"max_record_turns": turns}, "build.yaml").validate) is None
    too_long = validate_record(record, stage_config({"max_record_turns": turns - 1}, "build.yaml").validate)
    assert too_long.reason == "too_long" and f"(max {turns - 1})" in too_long.detail
