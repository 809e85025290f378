"""The `prefect` command of this interpreter's environment, run as a user runs it, from the repository;
and an HTTP client for the server's REST API that retries as Prefect's own client does."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.paths import REPO

PREFECT = str(Path(sys.executable).with_name("prefect"))


def run(cmd: list[str], env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


class RetryingTransport(httpx.HTTPTransport):
    """Retries the answers Prefect's server marks as retryable (503 when its SQLite database is locked
    under load, 502, 429) with exponential backoff, as `PrefectClient` does (PREFECT_CLIENT_MAX_RETRIES)."""

    RETRY_STATUS = {429, 502, 503}

    def __init__(self, retries: int = 6):
        super().__init__()
        self.delays = [min(2 ** n, 16) for n in range(retries)]

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        for delay in self.delays:
            if response.status_code not in self.RETRY_STATUS:
                break
            response.read()
            response.close()
            time.sleep(delay)
            response = super().handle_request(request)
        return response


# The server answers slowly on a loaded machine; httpx's default 5 s is not enough there.
API = httpx.Client(timeout=60, transport=RetryingTransport())
