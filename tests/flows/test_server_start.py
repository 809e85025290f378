"""`trajforge build` starts Prefect's temporary server before it loads the stages and the flow
(flows/cli.py `_start_prefect_server`): the flow's client then finds that server and starts no
other; with a Prefect API set, nothing starts."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.flows.conftest import free_port

pytestmark = pytest.mark.slow

# What the build command does before its flow (start the server, load the rest, wait for it),
# then the command's server processes.
STARTED = """
import psutil
from trajforge.flows.cli import _start_prefect_server
started = _start_prefect_server()
started()
servers = lambda: sum("uvicorn" in p.cmdline() for p in psutil.Process().children())
print(servers())
"""
# Then a client as the flow's (get_client), and the server processes again.
FLOW_CLIENT = """
from prefect.client.orchestration import get_client
with get_client(sync_client=True) as client:
    print(client.api_url, client.api_healthcheck())
print(servers())
"""


def run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_the_flow_client_uses_the_temporary_server_started_early(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    proc = run(STARTED + FLOW_CLIENT, env)
    before, client, after = proc.stdout.splitlines()
    url, health = client.split()
    assert url.startswith("http://127.0.0.1:") and health == "None"  # api_healthcheck: None when healthy
    assert before == after == "1"  # one server: the client started no other


def test_a_set_prefect_api_starts_no_server(tmp_path):
    api = f"http://127.0.0.1:{free_port()}/api"
    proc = run(STARTED, {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_API_URL": api})
    assert proc.stdout.split() == ["0"]
