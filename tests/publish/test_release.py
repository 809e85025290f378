"""Release to a Hub over real HTTP: the real huggingface_hub client against the loopback Hub server.

The tests turn huggingface_hub's offline switch off (the suite runs offline) and point its
endpoint at the loopback server, as HF_ENDPOINT does for a fresh process.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.hub_server import HubServer
from tests.support.oracles import write_config
from trajforge.pipeline.publish.manifest import read_manifest, write_manifest
from trajforge.pipeline.publish.release import ReleaseError, ReleaseVerificationError, plan_release, release
from trajforge.pipeline.publish.shards import ShardConfig, layout

TOKEN = "hf_loopbackTestToken_7f3a9c"
REPO = "trajforge-test/agent-trajectories"


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with HubServer(token=TOKEN) as server:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", server.endpoint)
        yield server


@pytest.fixture
def build(fixtures_build, tmp_path):
    out = tmp_path / "build"
    shutil.copytree(fixtures_build, out, ignore=shutil.ignore_patterns(".staging"))
    return out


def reshard(out, rows: int) -> None:
    """The same build cut into other shards: another release with added, changed and deleted files."""
    table = pa.concat_tables(pq.read_table(out / p) for p in layout(out)["sft"]["train"])
    write_config(out, "sft", {"train": table}, ShardConfig(max_rows=rows))
    write_manifest(out, read_manifest(out)["build_id"])


def remote_files(hub: HubServer, revision: str = "main") -> dict[str, bytes]:
    return hub.state.repos[REPO].resolve(revision).files


def rows_hash(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


def cli(args: list[str]) -> str:
    """Run `trajforge ARGS` in this process; its stdout. (Prefect's log handlers keep the real streams.)"""
    from trajforge.flows.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    return out.getvalue()


def test_cli_dry_run_release_and_load_dataset_through_hf_endpoint(hub, build, tmp_path):
    dry = cli(["release", str(build), "--repo", REPO, "--tag", "v1", "--dry-run"])
    assert REPO not in hub.state.repos, "a dry run must not create or push anything"
    expected = sorted(read_manifest(build)["files"]) + ["manifest.json"]
    assert [line[2:] for line in dry.splitlines() if line.startswith("+ ")] == sorted(expected)
    # Prefect configured its logging during the first run; from now on every log record is seen here.
    logs = Collect()
    for name in ("", "prefect", "trajforge", "huggingface_hub"):
        logging.getLogger(name).addHandler(logs)
    try:
        pushed = cli(["release", str(build), "--repo", REPO, "--tag", "v1", "--private"])
    finally:
        for name in ("", "prefect", "trajforge", "huggingface_hub"):
            logging.getLogger(name).removeHandler(logs)
    assert any(f"released {REPO}@main" in line for line in logs.lines)
    assert TOKEN not in dry + pushed + "\n".join(logs.lines)
    repo = hub.state.repos[REPO]
    assert repo.private and repo.tags["v1"] == repo.branches["main"]
    assert f"{len(expected)} files verified" in pushed
    # One release, one commit on top of the repo's initial one.
    head = repo.commits[repo.branches["main"]]
    assert repo.commits[head.parent].parent is None
    for path in expected:
        assert remote_files(hub)[path] == (build / path).read_bytes()

    # A fresh process reads the pushed repo with `datasets`, through HF_ENDPOINT and the token.
    script = (
        "import json, sys, hashlib\n"
        "from datasets import load_dataset\n"
        "ds = load_dataset(sys.argv[1], 'sft', split='train', revision='v1')\n"
        "print(hashlib.sha256(json.dumps(ds.to_list(), sort_keys=True, default=str).encode()).hexdigest())\n")
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0",
           "HF_TOKEN": TOKEN, "HF_HOME": str(tmp_path / "hf_home")}
    done = subprocess.run([sys.executable, "-c", script, REPO], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    local = pa.concat_tables(pq.read_table(build / p) for p in layout(build)["sft"]["train"]).to_pylist()
    assert done.stdout.split()[-1] == rows_hash(local)


def test_dry_run_lists_added_changed_deleted(hub, build):
    release(build, REPO, tag="v1")
    reshard(build, 50)
    plan = plan_release_for(build)
    new_shards = sorted(p for p in layout(build)["sft"]["train"])
    assert len(new_shards) > 1
    assert [p for p in plan.added if p.startswith("data/sft/")] == new_shards
    assert plan.changed == ["manifest.json"]
    assert plan.deleted == ["data/sft/train-00000-of-00001.parquet"]
    assert "README.md" in plan.unchanged and "report.json" in plan.unchanged

    result = release(build, REPO, tag="v2")
    assert sorted(p for p in remote_files(hub) if p.startswith("data/sft/")) == new_shards
    assert result.verified == len(read_manifest(build)["files"]) + 1
    # The earlier release is still reachable by its tag.
    assert "data/sft/train-00000-of-00001.parquet" in remote_files(hub, "v1")


def plan_release_for(build):
    from huggingface_hub import HfApi

    return plan_release(HfApi(), build, REPO)


def test_interrupted_push_keeps_the_previous_revision(hub, build):
    first = release(build, REPO, tag="v1")
    before = dict(remote_files(hub))
    reshard(build, 40)
    hub.state.cut_commits = 1
    with pytest.raises(Exception) as failure:
        release(build, REPO, tag="v2")
    assert not isinstance(failure.value, ReleaseVerificationError)
    repo = hub.state.repos[REPO]
    assert repo.branches["main"] == first.commit and remote_files(hub) == before
    assert "v2" not in repo.tags
    # Pushing again completes the release whole.
    second = release(build, REPO, tag="v2")
    assert repo.branches["main"] == second.commit != first.commit
    assert repo.commits[second.commit].parent == first.commit


def test_verification_mismatch_fails_loudly_and_tags_nothing(hub, build):
    hub.state.corrupt_next_commit = True
    with pytest.raises(ReleaseVerificationError, match=r"\.parquet: content on the remote"):
        release(build, REPO, tag="v1")
    assert hub.state.repos[REPO].tags == {}


def test_existing_tag_and_wrong_token_are_refused(hub, build, monkeypatch):
    release(build, REPO, tag="v1")
    commits = hub.state.commit_requests
    with pytest.raises(ReleaseError, match="tag v1 already exists"):
        release(build, REPO, tag="v1")
    assert hub.state.commit_requests == commits
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(Exception):  # noqa: B017 - whichever error the Hub client raises for a refused token
        release(build, "other/repo")
    assert "other/repo" not in hub.state.repos
