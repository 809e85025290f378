"""`trajforge build --config FILE`: the shipped example, validation, and flags over the file.

The example build runs end to end through the real CLI in tests/test_build_e2e.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from trajforge.flows.cli import _build_run, parser
from trajforge.flows.config import BuildRun, ConfigError, from_dict, load_build_run, stage_config
from trajforge.pipeline.build import BuildConfig
from trajforge.pipeline.quality.dedup import DedupConfig
from trajforge.sources import REGISTRY
from tests.conftest import AGENT_FLAN, FIXTURE_SOURCES, REPO

EXAMPLE = REPO / "configs" / "build.yaml"


def build_args(*argv: str):
    return parser().parse_args(["build", *argv])


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
                                "--workers", "2", "--rendering", "react", "--source", "agentinstruct=x"))
    assert (run.out, run.workers, run.sources) == ("elsewhere", 2, {"agentinstruct": "x"})
    config = stage_config(run.stages, "test")
    assert config.dedup == DedupConfig(threshold=0.9) and config.rendering == "react"
    assert config.negatives == BuildConfig().negatives  # the file's other stage settings stay


def test_without_a_file_the_flags_alone_decide():
    run = _build_run(build_args("--out", "o"))
    assert run == BuildRun(out="o")
    assert stage_config(run.stages, "options") == BuildConfig()


@pytest.mark.parametrize("text, says", [
    ("workers: four\n", "workers must be int, not str 'four'"),
    ("runner: slurm\n", "runner must be one of threads, dask, ray"),
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
])
def test_stage_settings_are_checked(stages, says):
    with pytest.raises(ConfigError) as err:
        stage_config(stages, "build.yaml")
    assert says in str(err.value)


def test_lists_become_the_tuples_the_stages_hold():
    config = stage_config({"rl_tasks": ["a.jsonl"], "shards": {"max_rows": 10}}, "build.yaml")
    assert config.rl_tasks == ("a.jsonl",) and config.shards.max_rows == 10
    assert from_dict(BuildRun, {"sources": {"agentinstruct": None}}, "x").sources == {"agentinstruct": None}
