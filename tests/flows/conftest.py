"""Fixtures of the orchestration tests: a real Prefect server on loopback."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.support.paths import REPO
from tests.support.prefect_cli import PREFECT
from trajforge.flows.temporary_server import send_queued_logs_and_events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def prefect_server(tmp_path):
    """`prefect server start` on a free loopback port, its home under tmp_path: (API URL, the env
    that points the `prefect` command at it)."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect_home"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false",
           "HF_HUB_OFFLINE": "1", "PWD": str(REPO),
           # A PYTHONPATH already set (a checkout of its own) stays in front of the repository.
           "PYTHONPATH": os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), str(REPO))))}
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        yield api, env
    finally:
        # What the test's in-process flows queued for this server goes while it is up, as before a
        # temporary server stops: sent at the worker's end, it found no server ("--- Error logging
        # to API ---" under pytest-xdist).
        send_queued_logs_and_events()
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()
