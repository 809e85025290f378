"""Prefect's temporary server for a flow run from the CLI, started as the command starts.

With no Prefect API configured, Prefect starts a temporary server at a flow's first API call: the
flow's process first imports Prefect's server package to launch it (~3 s on a 2-core machine, on
the critical path), then waits for it to answer (~4 s). `TemporaryServer.start` launches the same
server (Prefect's ASGI app factory under uvicorn, with the environment Prefect gives its temporary
server: no UI, the services of an ephemeral server; and no block types registered at start) as
soon as a command's arguments are checked, without that import, so that its start overlaps the
command's own imports; the flow then runs within `api()`, which waits until the server answers and
sets Prefect's API to it: Prefect starts none. Flow-run heartbeats are off there: they let a server
notice a crashed run later, and this server ends with the command.

The app is Prefect's, behind `RetryBusyDatabase`: a request that finds SQLite busy is answered 503,
and Prefect's client waits 2 s before it tries again (its backoff, 2**try seconds), with the whole
build idle (once at every build's start, where the subflow's first task run is written while the
server records the events of the tasks before it). The server tries such a request again itself,
after a few milliseconds.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# uvicorn's exit status when it cannot start (the port was taken since it was chosen): Prefect's
# own temporary server then tries another port, as `api` does.
UVICORN_STARTUP_FAILURE = 3
# Starts before a server that keeps failing to start is an error (uvicorn gives the same status when
# Prefect's app fails to start).
STARTS = 3
# Prefect's environment for its temporary server (prefect.server.api.server.SubprocessASGIServer),
# without registering the block types at start: to do that, its app imports every installed Prefect
# collection (prefect-dask loads dask.distributed: ~0.7 s of the server's ~4.5 s start on 2 cores,
# on the build's critical path) and hashes the block registry. A build's flows use no block, and a
# block saved on this server registers its own type and schema (`Block.save`). Nor the automation
# services (triggers and their actions): an automation lives on a lasting server, and this one ends with
# the command; they read every event of the build, and their start delays the first answer (~0.5 s of
# ~4.3 s on a quiet 2-core machine; ~0.6 s of the server's ~7 s of CPU in a 100k build). Nor the
# event persister: it writes every event to the database for the UI's event feed and automations,
# which this server has neither of (the task run recorder, a service of its own, still records the
# task runs from their events); ~0.4 s of the server's ~4.1 s of CPU in a 100k build.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
              "PREFECT_API_BLOCKS_REGISTER_ON_START": "0", "PREFECT_MEMOIZE_BLOCK_AUTO_REGISTRATION": "0",
              "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
              "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false"}
# `python -m uvicorn`, with Prefect's server package imported first without cyclic garbage
# collection: its imports (FastAPI, pydantic models, SQLAlchemy) make ~0.5M objects and next to no
# garbage, and the collections they set off walk them again and again; frozen afterwards, the
# server's own collections skip them. Answers ~1 s sooner on 2 cores (3.4-5.5 -> 2.8-3.4 s). Its
# command line still names `uvicorn` as an argument of its own, as `-m uvicorn` did (what tools and
# tests that look for the server match).
# Its first argument is the command's pid: the server ends once the command has (`end_with_owner`).
SERVER_MAIN = ("import gc, sys; from trajforge.flows.stopping import end_with_owner; end_with_owner(int(sys.argv[1])); "
               "gc.disable(); import uvicorn, prefect.server.api.server; gc.freeze(); gc.enable(); "
               "sys.argv = sys.argv[2:]; uvicorn.main()")
# A request Prefect's app answers 503 (SQLite busy: its transaction was rolled back) is run again
# this many times, this many seconds apart, before the 503 goes out (and the client's backoff applies).
BUSY_ATTEMPTS, BUSY_PAUSE_S = 5, 0.02
# Seconds to wait for Prefect to send its queued logs and events before the server stops.
DRAIN_TIMEOUT_S = 5
# The temporary servers of this process, for flows/stopping.py (it spares them while a stopped run
# is marked Crashed).
RUNNING: dict[int, TemporaryServer] = {}


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TemporaryServer:
    """One temporary Prefect server: `start`, then run flows within `api()`, then `stop`."""

    def __init__(self):
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.address}/api"

    def start(self) -> TemporaryServer:
        self.port = _free_port()
        prefect_dir = Path(importlib.util.find_spec("prefect").origin).parent
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER_MAIN, str(os.getpid()), "uvicorn", "--app-dir", str(prefect_dir.parent), "--factory",
             f"{__name__}:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, **SERVER_ENV})
        RUNNING[self.process.pid] = self
        return self

    def wait_until_ready(self, timeout_s: float) -> None:
        """Until the server answers its health check; a server that could not start (its port
        taken since it was chosen) is started again on another port, up to `STARTS` times."""
        import httpx

        deadline = time.monotonic() + timeout_s
        starts = 1
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    if self.process.returncode != UVICORN_STARTUP_FAILURE or starts == STARTS:
                        raise RuntimeError(f"the temporary Prefect server exited with status {self.process.returncode}"
                                           " (its error is above)")
                    RUNNING.pop(self.process.pid, None)
                    self.start()
                    starts += 1
                with contextlib.suppress(httpx.TransportError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                time.sleep(0.05)
        raise RuntimeError(f"the temporary Prefect server did not answer within {timeout_s:.0f} s")

    @contextlib.contextmanager
    def api(self) -> Iterator[None]:
        """Prefect's API set to this server (flow runs without heartbeats, no UI link) once it answers: in this
        thread's settings, and in the environment and the process-wide settings, which Prefect's
        threads without a context of their own (the process pool's message forwarder) read."""
        from prefect.context import refresh_global_settings_context
        from prefect.logging import get_logger
        from prefect.settings import (
            PREFECT_API_URL,
            PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
            PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
            PREFECT_UI_URL,
            temporary_settings,
        )

        get_logger().info(f"Starting temporary server on {self.address}")
        self.wait_until_ready(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
        earlier = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = self.url
        refresh_global_settings_context()
        try:
            # No UI link in the logs either: the server serves no UI, and ends with the command.
            with temporary_settings(updates={PREFECT_API_URL: self.url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,
                                             PREFECT_UI_URL: ""}):
                yield
        finally:
            if earlier is None:
                os.environ.pop("PREFECT_API_URL", None)
            else:
                os.environ["PREFECT_API_URL"] = earlier
            refresh_global_settings_context()

    def stop(self) -> None:
        """Stop the server, once Prefect has sent it the logs and events still queued (as Prefect's
        test harness does before stopping its server): sent later, they would fail and be retried."""
        if self.process is None:
            return
        if send_queued_logs_and_events():
            from prefect.logging import get_logger

            get_logger().info(f"Stopping temporary server on {self.address}")
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        RUNNING.pop(self.process.pid, None)
        self.process = None


def send_queued_logs_and_events() -> bool:
    """Wait (up to DRAIN_TIMEOUT_S each) until Prefect has sent the logs and events this process
    queued, before a server they are bound for stops. False, sending nothing, where Prefect's workers
    were never loaded (a command that failed before its flow): they are not loaded for it."""
    if "prefect.events.worker" not in sys.modules:
        return False
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=DRAIN_TIMEOUT_S)
    EventsWorker.drain_all(timeout=DRAIN_TIMEOUT_S)
    return True


class RetryBusyDatabase:
    """ASGI middleware: an HTTP request the app answers 503 is run again, with the same body, up
    to `attempts` times `pause_s` apart; any other answer (and the last attempt's) goes out as
    it is. Prefect's app answers 503 only for errors its client retries itself (SQLite busy or
    locked, a dropped database connection), after a rolled-back transaction."""

    def __init__(self, app, attempts: int = BUSY_ATTEMPTS, pause_s: float = BUSY_PAUSE_S):
        self.app, self.attempts, self.pause_s = app, attempts, pause_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        request = {"type": "http.request", "body": b"".join(body), "more_body": False}
        for attempt in range(1, self.attempts + 1):
            if not await self._attempt(scope, request, receive, send, last=attempt == self.attempts):
                return
            await asyncio.sleep(self.pause_s)

    async def _attempt(self, scope, request: dict, receive, send, last: bool) -> bool:
        """Run the request once; True when it was answered 503 and not sent (to be run again)."""
        given, busy = False, False

        async def replay() -> dict:
            nonlocal given
            if not given:
                given = True
                return request
            return await receive()

        async def forward(message: dict) -> None:
            nonlocal busy
            if message["type"] == "http.response.start" and message["status"] == 503 and not last:
                busy = True
            if not busy:
                await send(message)

        try:
            await self.app({**scope, "state": dict(scope.get("state", {}))}, replay, forward)
        except Exception:
            # Starlette raises the error again once its handler has answered (for the server to log
            # it): of an answer held back here, the error is this attempt's, not the request's.
            if not busy:
                raise
        return busy


def create_app():
    """Prefect's server app (its factory, configured by `SERVER_ENV`) behind `RetryBusyDatabase`."""
    from prefect.server.api.server import create_app as prefect_app

    return RetryBusyDatabase(prefect_app())


def running_pids() -> set[int]:
    return set(RUNNING)
