"""Every long command checks its arguments before Prefect starts, as `build` does: through the real
CLI, exit 2 with one line that names the argument, fast (bounded in CPU seconds), nothing written."""
from __future__ import annotations

import pytest

from tests.support.cli import refused
from tests.support.paths import FIXTURES, RAW, REPO

DB_TASKS = str(FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl")
SFT_TINY = str(REPO / "training" / "configs" / "sft_tiny.yaml")


def rft(out, **changes) -> list[str]:
    """An `rft` command line whose every argument is usable, but for `changes`."""
    options = {"--source": f"agentinstruct={RAW / 'agentinstruct'}", "--tasks": DB_TASKS, "--env": "db",
               "--base-model": str(out.parent), "--sft-config": SFT_TINY, "--out": str(out), **changes}
    return ["rft", *(part for option, value in options.items() for part in (option, value))]


@pytest.mark.parametrize("changes, says", [
    ({"--tasks": "tasks.jsonl"}, "--tasks tasks.jsonl: no such file; give the held-out task file"),
    ({"--env": "webshop"}, "--env webshop: unknown environment 'webshop'; known: agentgym, "),
    ({"--eval-tasks": "held_out.jsonl"}, "--eval-tasks held_out.jsonl: no such file"),
    ({"--sft-config": "sft.yaml"}, "--sft-config sft.yaml: no such file; give an SFT config"),
    ({"--base-model": "/tmp/no/such/tiny"}, "--base-model /tmp/no/such/tiny: no such model folder"),
    ({"--base-model": "not a model"}, "--base-model not a model: neither a model folder nor a Hub model id"),
    ({"--source": "agentinstruct=./no/such/agentinstruct"},
     "--source agentinstruct=./no/such/agentinstruct: no such file or folder"),
    ({"--source": "nope=x"}, "--source nope: unknown source 'nope'"),
    ({"--rounds": "0"}, "--rounds 0: must be at least 1"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_rft_checks_its_arguments_before_prefect(tmp_path, changes, says):
    out = tmp_path / "rft"
    assert says in refused(*rft(out, **changes), cwd=tmp_path)
    assert not out.exists()  # no round, no `.staging` begun


def test_salvage_checks_its_arguments_before_prefect(tmp_path):
    out = str(tmp_path / "out")
    failures = tmp_path / "failures.parquet"
    line = refused("salvage", str(failures), "--tasks", DB_TASKS, "--out", out, "--model", "m")
    assert line.endswith(f"salvage {failures}: no such file; give the failures.parquet of `trajforge synth`, "
                         f"or records with success false")
    failures.write_bytes(b"")
    assert "--tasks t.json: no such file" in refused("salvage", str(failures), "--tasks", "t.json", "--out", out,
                                                     "--model", "m")
    assert "--max-prefixes 0: must be at least 1" in refused("salvage", str(failures), "--tasks", DB_TASKS, "--out",
                                                             out, "--model", "m", "--max-prefixes", "0")
    assert f"--out {failures}: is a file" in refused("salvage", str(failures), "--tasks", DB_TASKS, "--out",
                                                     str(failures), "--model", "m")


def test_select_steps_checks_its_arguments_before_prefect(tmp_path):
    line = refused("select-steps", str(tmp_path / "build"), "--out", str(tmp_path / "o"), "--model", "m")
    assert f"select-steps {tmp_path / 'build'}: no such file or folder" in line
    assert "--batch-size 0: must be at least 1" in refused("select-steps", DB_TASKS, "--out", str(tmp_path / "o"),
                                                           "--model", "m", "--batch-size", "0")


def test_synth_checks_its_arguments_before_prefect(tmp_path):
    out = str(tmp_path / "out")
    assert "--tasks t.json: no such file" in refused("synth", "--tasks", "t.json", "--env", "db", "--model", "m",
                                                     "--out", out)
    assert "--env webshop: unknown environment" in refused("synth", "--tasks", DB_TASKS, "--env", "webshop",
                                                           "--model", "m", "--out", out)
    assert "--episodes 0: must be at least 1" in refused("synth", "--tasks", DB_TASKS, "--env", "db", "--model", "m",
                                                         "--out", out, "--episodes", "0")
    assert f"--out {DB_TASKS}: is a file" in refused("synth", "--tasks", DB_TASKS, "--env", "db", "--model", "m",
                                                     "--out", DB_TASKS)
