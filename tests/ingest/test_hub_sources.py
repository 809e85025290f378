"""With no --source, the build reads the three upstream datasets from the Hub by repo id.

The Hub is out of reach, so the upstream repos are laid out (same file names and containers)
in the loopback Hub-compatible server, and the real huggingface_hub client downloads them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import huggingface_hub
import pytest
from huggingface_hub import CommitOperationAdd, HfApi

from tests.support.hub_server import HubServer
from tests.support.paths import AGENT_FLAN, RAW, REPO
from trajforge.sources.locate import hub_revision

# Upstream repo -> {path in the repo: local file with that content}.
UPSTREAM = {
    "THUDM/AgentInstruct": {"data/db-00000-of-00001-916a87c4725da8c0.parquet": RAW / "agentinstruct" / "db-sample.parquet"},
    "AgentGym/AgentTraj-L": {p.name: p for p in sorted((RAW / "agenttraj_l").glob("*_train.json"))},
    "internlm/Agent-FLAN": {f"data/{p.name}": p for p in sorted((AGENT_FLAN / "data").glob("*.jsonl"))},
}


@pytest.mark.slow
def test_default_build_reads_the_upstream_repos_from_the_hub(tmp_path, monkeypatch):
    # conftest keeps the tests offline; this one talks to its own loopback Hub only.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with HubServer() as hub:
        api = HfApi(endpoint=hub.endpoint, token="hf_test_token")
        commits = {}
        for repo, files in UPSTREAM.items():
            api.create_repo(repo, repo_type="dataset", exist_ok=True)
            operations = [CommitOperationAdd(path, str(local)) for path, local in files.items()]
            commits[repo] = api.create_commit(repo, repo_type="dataset", commit_message="upstream layout",
                                              operations=operations).oid
        env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="0",
                   HF_TOKEN="hf_test_token")
        out = tmp_path / "build"
        proc = subprocess.run([sys.executable, "-m", "trajforge.flows.cli", "build", "--out", str(out)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "hf_test_token" not in proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    expected_rows = {"agentinstruct": 20, "agenttraj_l": 40, "agent_flan": 8}
    assert {name: entry["read"] for name, entry in report["sources"].items()} == expected_rows
    files = report["sources"]["agenttraj_l"]["files"]
    assert set(files) == set(UPSTREAM["AgentGym/AgentTraj-L"])
    # The card names the commit each repo was read at, found from the files' cache snapshot (hub_revision).
    provenance = [line for line in (out / "README.md").read_text().splitlines() if "huggingface.co/datasets" in line]
    for repo, commit in commits.items():
        assert f"`{commit}`" in next(line for line in provenance if f"/{repo}" in line), repo


def test_hub_revision_comes_from_the_cache_snapshot(tmp_path):
    # huggingface_hub's cache layout: the snapshot's file is a symlink to the content-addressed blob.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "datasets--THUDM--AgentInstruct"
    blob = repo / "blobs" / "5f8c1d2e"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"x")
    path = repo / "snapshots" / commit / "data" / "os.parquet"
    path.parent.mkdir(parents=True)
    path.symlink_to(blob)
    assert hub_revision(path) == commit
    assert hub_revision(blob) is None
    assert hub_revision(tmp_path) is None
