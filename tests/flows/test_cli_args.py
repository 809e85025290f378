"""Unusable arguments fail through the real CLI with exit 2, fast, in one line that names the
argument and says what to do; every --help answers fast. Nothing here starts Prefect.

Each run is bounded twice: in CPU seconds (load-independent; importing Prefect alone costs more
than the bound) and, generously for loaded CI machines, in wall seconds. On a quiet 2-core
machine each case takes about 1 s (2 s with a Hub lookup) and 0.2-0.6 s of CPU.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import psutil
import pytest

from tests.support.cli import CPU_BOUND_S, WALL_BOUND_S, refused, trajforge
from tests.support.hub_server import HubServer
from tests.support.paths import RAW, REPO
from trajforge.flows.cli import _check_out
from trajforge.sources import REGISTRY, SourceError
from trajforge.sources.base import download_from_hub
from trajforge.sources.locate import is_local_path


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unknown_source(tmp_path):
    line = refused("build", "--out", str(tmp_path / "o"), "--source", "nope=x")
    assert "--source nope: unknown source" in line and "agenttraj_l" in line


def test_missing_path(tmp_path):
    line = refused("build", "--out", str(tmp_path / "o"), "--source", f"agenttraj_l={tmp_path}/missing/dir")
    assert f"--source agenttraj_l={tmp_path}/missing/dir: no such file or folder" in line
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_mistyped_relative_path_says_what_path_and_what_repo_were_tried(tmp_path):
    line = refused("build", "--out", "o", "--source", "agentinstruct=fixtures/agentinstruct", cwd=tmp_path)
    assert f"local path ({tmp_path}/fixtures/agentinstruct does not exist)" in line
    assert "Hub dataset (fixtures/agentinstruct: offline" in line and "--source agentinstruct=PATH" in line


def test_folder_without_data_files(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("no data here")
    for folder in ("empty", "docs"):
        line = refused("build", "--out", str(tmp_path / "o"), "--source", f"agenttraj_l={tmp_path / folder}")
        assert f"--source agenttraj_l={tmp_path / folder}: no data files (.parquet" in line


def test_unsupported_file_type(tmp_path):
    (tmp_path / "rows.csv").write_text("a,b\n")
    line = refused("build", "--out", str(tmp_path / "o"), "--source", f"agenttraj_l={tmp_path / 'rows.csv'}")
    assert "rows.csv is not a data file (suffix .csv)" in line and ".jsonl" in line


def test_foreign_out_folder_is_refused_and_left_alone(tmp_path):
    out = tmp_path / "mine"
    (out / "sub").mkdir(parents=True)
    (out / "README.md").write_text("my own notes")
    (out / "sub" / "thing.csv").write_text("1,2\n")
    line = refused("build", "--out", str(out), "--source", f"agenttraj_l={RAW / 'agenttraj_l'}")
    assert f"--out {out}: holds files that no trajforge build wrote (README.md, sub)" in line
    assert "--overwrite" in line
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["README.md", "sub", "sub/thing.csv"]
    assert (out / "README.md").read_text() == "my own notes"


def test_out_folder_rules(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("x")
    with pytest.raises(SourceError, match="--overwrite"):
        _check_out(str(foreign), overwrite=False)
    _check_out(str(foreign), overwrite=True)
    _check_out(str(tmp_path / "new"), overwrite=False)
    (tmp_path / "empty").mkdir()
    _check_out(str(tmp_path / "empty"), overwrite=False)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "manifest.json").write_text('{"build_id": "0123456789abcdef", "files": {}}')
    _check_out(str(earlier), overwrite=False)
    interrupted = tmp_path / "interrupted"
    (interrupted / ".staging").mkdir(parents=True)
    _check_out(str(interrupted), overwrite=False)
    with pytest.raises(SourceError, match="is a file"):
        _check_out(str(foreign / "notes.txt"), overwrite=False)


def test_default_build_offline_names_the_source_and_repo(tmp_path):
    line = refused("build", "--out", str(tmp_path / "o"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    assert "--source agentinstruct (Hub dataset THUDM/AgentInstruct): offline" in line
    assert "pass --source agentinstruct=PATH" in line


def test_default_build_with_the_hub_down(tmp_path):
    line = refused("build", "--out", str(tmp_path / "o"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0",
                   HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    assert "--source agentinstruct (Hub dataset THUDM/AgentInstruct): Hub unreachable (ConnectError" in line
    assert "pass --source agentinstruct=PATH" in line


def test_repo_missing_on_the_hub(tmp_path):
    with HubServer() as hub:
        env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": hub.endpoint}
        line = refused("build", "--out", str(tmp_path / "o"), "--source", "agentinstruct=org/missing", **env)
        assert "readable Hub dataset (org/missing: not found on the Hub" in line
        # Inside the flow the download raises a SourceError too, which the flow does not retry.
        code = f"from {download_from_hub.__module__} import download_from_hub; download_from_hub('org/missing', ['*'])"
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, **env), timeout=60)
        assert "SourceError: Hub dataset org/missing: not found" in proc.stderr.splitlines()[-1]


def test_retry_condition_skips_source_errors():
    from prefect.states import Failed

    from trajforge.flows.build import _worth_retrying

    assert not _worth_retrying(None, None, Failed(data=SourceError("offline")))
    assert _worth_retrying(None, None, Failed(data=TimeoutError("slow")))


@pytest.mark.parametrize("location, local", [
    ("/abs/missing", True), ("./rel", True), ("~/data", True), ("tests/no/such", True),
    ("fixtures/agentinstruct", False), ("THUDM/AgentInstruct", False), ("tests", True),
])
def test_local_path_or_repo_id(location, local, monkeypatch):
    monkeypatch.chdir(REPO)
    assert is_local_path(location) is local


@pytest.mark.parametrize("command", [[], ["build"], ["release"], ["synth"], ["train"], ["train", "sft"],
                                     ["train", "grpo"], ["train", "dpo"]], ids=lambda c: " ".join(c) or "top")
def test_help_is_fast(command):
    proc, wall, cpu = trajforge(*command, "--help")
    assert proc.returncode == 0, proc.stderr
    assert cpu < CPU_BOUND_S and wall < WALL_BOUND_S, f"{cpu:.1f} s CPU, {wall:.1f} s wall"
    text = proc.stdout
    if command == ["build"]:
        assert all(name in text for name in REGISTRY) and "THUDM/AgentInstruct" in text
    if command == ["synth"]:
        assert "(default: 8)" in text and "(default: openai)" in text and "(default: 4)" in text
    if command == ["train"]:
        assert all(f"  {name} " in text for name in ("sft", "grpo", "dpo"))
    if command[:1] == ["train"] and len(command) == 2:
        lines = text.splitlines()
        assert lines[5].lstrip().startswith("--config FILE") and "--help-all" in text and len(lines) < 30


def test_train_without_a_trainer_lists_them():
    proc, _, _ = trajforge("train")
    assert proc.returncode == 2 and "sft" in proc.stderr and "dpo" in proc.stderr


def test_release_of_a_folder_that_is_no_build(tmp_path):
    line = refused("release", str(tmp_path), "--repo", "org/name", "--dry-run")
    assert f"release {tmp_path}: no manifest.json there" in line
    (tmp_path / "manifest.json").write_text('{"build_id": "0123456789abcdef", "files": {}}')
    line = refused("release", str(tmp_path), "--repo", "org/na me", "--dry-run")
    assert "--repo org/na me: not a Hub repo id" in line


@pytest.mark.parametrize("status, error_code, retryable, says", [
    (401, "RepoNotFound", False, "not found on the Hub (if it is private, log in"),
    (401, None, False, "log in with `hf auth login`"),  # huggingface_hub takes a 401 for a missing repo
    (403, "GatedRepo", False, "gated"),
    (403, None, False, "access denied (HTTP 403)"),
    (404, "RepoNotFound", False, "not found on the Hub"),
    (500, None, True, "HTTP 500"),
    (503, None, True, "HTTP 503"),
])
def test_hub_answers_that_a_retry_cannot_change(status, error_code, retryable, says):
    """huggingface_hub's own mapping of a Hub answer to an error, then ours to retry or not."""
    from huggingface_hub.utils import hf_raise_for_status

    from trajforge.sources.locate import hub_failure

    httpx = pytest.importorskip("httpx2")  # the transport huggingface_hub uses here
    headers = {"X-Error-Code": error_code} if error_code else {}
    response = httpx.Response(status, headers=headers, json={"error": "x"},
                              request=httpx.Request("GET", "https://huggingface.co/api/datasets/org/name"))
    with pytest.raises(Exception) as raised:
        hf_raise_for_status(response)
    failure = hub_failure("org/name", raised.value)
    assert failure.retryable is retryable and says in failure.reason


def test_build_config_file_missing_or_with_an_unknown_key(tmp_path):
    line = refused("build", "--config", str(tmp_path / "build.yaml"))
    assert "--config" in line and "build.yaml" in line and "No such file" in line
    config = tmp_path / "typo.yaml"
    config.write_text(f"out: {tmp_path / 'out'}\nworker: 2\n")
    line = refused("build", "--config", str(config))
    assert "unknown key worker" in line and "workers" in line
    config.write_text(f"out: {tmp_path / 'out'}\nsources: {{nosuch: {RAW}}}\n")
    assert "--source nosuch: unknown source" in refused("build", "--config", str(config))


@pytest.mark.parametrize("runner", ["auto", "processes"])
def test_build_config_unknown_stage_key_exits_2_before_prefect(tmp_path, runner):
    """Stage settings are checked against the stage configs (which load in seconds, so this case has
    no time bound), before this process loads Prefect or the output folder is made. Where a build
    needs a temporary server (`processes`; `auto` on small input runs in process), it starts while
    they load, and a bad setting stops it: no server outlives the refusal."""
    config = tmp_path / "build.yaml"
    config.write_text(f"out: {tmp_path / 'out'}\nstages:\n  dedup:\n    treshold: 0.9\n")
    mark = f"refused-{os.getpid()}-{runner}"
    proc, _, _ = trajforge("build", "--config", str(config), "--runner", runner,
                           "--source", f"agentinstruct={RAW / 'agentinstruct'}", TRAJFORGE_TEST_MARK=mark)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "unknown key stages.dedup.treshold" in line and not (tmp_path / "out").exists()
    assert not [p for p in psutil.process_iter() if _environ(p).get("TRAJFORGE_TEST_MARK") == mark]


def _environ(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except psutil.Error:
        return {}


def test_build_needs_an_output_folder():
    assert "--out" in refused("build", "--source", "agentinstruct")


def test_synth_config_file_checks(tmp_path):
    config = tmp_path / "synth.yaml"
    config.write_text("tasks: t.jsonl\nenv: db\nout: o\nllm:\n  model: m\n  api_key: sk-secret\n")
    line = refused("synth", "--config", str(config))
    assert "llm.api_key cannot be set" in line and "sk-secret" not in line
    config.write_text("tasks: t.jsonl\nenv: db\nout: o\nllm: {model: m}\nagent: {max_turn: 3}\n")
    assert "unknown key agent.max_turn" in refused("synth", "--config", str(config))
    assert "no model" in refused("synth", "--tasks", "t.jsonl", "--env", "db", "--out", str(tmp_path / "o"))
