"""The CLI's temporary Prefect server (flows/temporary_server.py): a real uvicorn server with Prefect's
app, a real flow run on it, with a task in a worker process whose logs the parent forwards."""
from __future__ import annotations

import os
import socket

import psutil
import pytest
from fastapi import Request
from prefect import flow, get_run_logger, task
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, get_current_settings, temporary_settings

from trajforge.flows import temporary_server
from trajforge.flows.build import make_task_runner
from trajforge.flows.temporary_server import TemporaryServer


def _uvicorn_children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "uvicorn" in " ".join(p.cmdline())]


@task
def _logs_in_a_worker(x: int) -> int:
    get_run_logger().info("from a worker process")
    return x + 1


@flow
def _on_the_api(x: int) -> tuple[int, str | None, int | None, str | None]:
    # The task runs in a worker process; its logs and events reach the server through the parent's
    # message forwarder, a thread without this run's settings context.
    result = _logs_in_a_worker.with_options(task_run_name="in-worker").submit(x).result()
    settings = get_current_settings()
    return result, settings.api.url, settings.flows.heartbeat_frequency, settings.ui_url


@task
def _client_in_a_worker() -> tuple[int, int, str]:
    """(pid, task runs that this run's Prefect client has served, its API)."""
    client = get_client(sync_client=True)
    client.task_runs_served = getattr(client, "task_runs_served", 0) + 1
    return os.getpid(), client.task_runs_served, str(client.api_url)


@flow
def _task_runs_in_one_worker(runs: int) -> list[tuple[int, int, str]]:
    return [_client_in_a_worker.submit().result() for _ in range(runs)]


@task
def _max_retries_in_a_worker() -> int:
    return get_current_settings().client.max_retries


@flow
def _settings_changed_between_tasks() -> list[int]:
    """What one worker's task runs see of a setting the flow changes between them (the worker's
    settings are remembered from task to task: flows/settings_memo.py)."""
    first = _max_retries_in_a_worker.submit().result()
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: first + 2}):
        changed = _max_retries_in_a_worker.submit().result()
    return [first, changed, _max_retries_in_a_worker.submit().result()]


@pytest.fixture
def prefect_home(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect_home"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)


def test_a_flow_runs_on_the_temporary_server_and_only_there(prefect_home):
    before = {p.pid for p in _uvicorn_children()}
    server = TemporaryServer().start()
    try:
        with server.api():
            assert os.environ["PREFECT_API_URL"] == server.url
            state = _on_the_api.with_options(task_runner=make_task_runner("processes", workers=1))(1, return_state=True)
            result, api_url, heartbeat, ui_url = state.result()
            # A worker's task runs share one client, to the API its runner was told (flows/build.py,
            # `_start_worker`); untold, each task run makes its own from the run's settings, as
            # Prefect does, not one from the worker's (the fork server's: another server's, or none).
            told = make_task_runner("processes", workers=1, api_url=server.url)
            clients = _task_runs_in_one_worker.with_options(task_runner=told)(3)
            assert clients == [(clients[0][0], served, server.url + "/") for served in (1, 2, 3)], clients
            untold = _task_runs_in_one_worker.with_options(task_runner=make_task_runner("processes", workers=1))(2)
            assert [(served, url) for _, served, url in untold] == [(1, server.url + "/")] * 2, untold
            retries = _settings_changed_between_tasks.with_options(task_runner=told)()
            assert retries == [retries[0], retries[0] + 2, retries[0]], retries
            # Every Prefect server this process has is this one: the worker's forwarded logs started none.
            assert {p.pid for p in _uvicorn_children()} - before == {server.process.pid}

            async def recorded():
                async with get_client() as client:
                    of_the_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
                    return (await client.read_flow_run(state.state_details.flow_run_id),
                            [block.slug for block in await client.read_block_types()],
                            await client.read_task_runs(flow_run_filter=of_the_run),
                            (await client.read_events(limit=1)).total)

            import asyncio

            run, block_types_at_start, task_runs, events = asyncio.run(recorded())
            # Block types are not registered as the server starts (SERVER_ENV); saving a block still
            # registers its own.
            Secret(value="s3cret").save("token")
            saved = Secret.load("token").get()
        assert (result, api_url, heartbeat, ui_url) == (2, server.url, None, "")
        assert run.state.is_completed()
        # The task run is recorded from its events; the events themselves are not kept (SERVER_ENV).
        assert [(t.name, t.state.is_completed()) for t in task_runs] == [("in-worker", True)]
        assert events == 0
        assert block_types_at_start == [] and saved == "s3cret"
        assert "PREFECT_API_URL" not in os.environ
        assert get_current_settings().api.url != server.url
    finally:
        process = server.process
        server.stop()
    assert process.poll() is not None
    assert server.process is None and not temporary_server.running_pids()


def test_a_server_that_cannot_take_its_port_starts_again_on_another(prefect_home, monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    free = temporary_server._free_port
    monkeypatch.setattr(temporary_server, "_free_port", lambda: next(ports, None) or free())
    server = TemporaryServer().start()
    try:
        first = server.process
        server.wait_until_ready(120)
        assert first.returncode == temporary_server.UVICORN_STARTUP_FAILURE
        assert server.port != taken.getsockname()[1] and server.process.poll() is None
        assert first.pid not in temporary_server.running_pids()
    finally:
        server.stop()
        taken.close()


def test_a_server_that_fails_otherwise_is_an_error(prefect_home, monkeypatch):
    monkeypatch.setattr(temporary_server.sys, "executable", "/bin/false")
    server = TemporaryServer().start()
    try:
        with pytest.raises(RuntimeError, match="exited with status 1"):
            server.wait_until_ready(120)
    finally:
        server.stop()
    assert not temporary_server.running_pids()


def _busy_app(busy_calls: int, error: Exception | None = None):
    """A FastAPI app with Prefect's server exception handler (503 for a busy SQLite, 500 otherwise)
    whose endpoint fails its first `busy_calls` calls with SQLite's "database is locked" (or `error`)."""
    import sqlite3

    import sqlalchemy
    from fastapi import FastAPI
    from prefect.server.api.server import custom_internal_exception_handler

    app = FastAPI(exception_handlers={Exception: custom_internal_exception_handler})
    app.state.bodies = []

    @app.post("/runs")
    async def create(request: Request) -> dict:
        app.state.bodies.append(await request.body())
        if error is not None:
            raise error
        if len(app.state.bodies) <= busy_calls:
            raise sqlalchemy.exc.OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
        return {"created": len(app.state.bodies)}

    return app


def _post(app) -> tuple[int, str]:
    import asyncio

    import httpx

    async def post():
        transport = httpx.ASGITransport(app=temporary_server.RetryBusyDatabase(app), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            response = await client.post("/runs", json={"name": "unit-7"})
            return response.status_code, response.text

    return asyncio.run(post())


def test_a_request_that_finds_the_database_busy_is_run_again_with_its_body():
    app = _busy_app(busy_calls=2)
    assert _post(app) == (200, '{"created":3}')
    assert app.state.bodies == [b'{"name":"unit-7"}'] * 3


def test_a_database_busy_beyond_the_attempts_is_answered_503_for_the_client_to_retry():
    app = _busy_app(busy_calls=100)
    status, text = _post(app)
    assert status == 503 and "Service Unavailable" in text
    assert len(app.state.bodies) == temporary_server.BUSY_ATTEMPTS


def test_other_errors_are_not_run_again():
    app = _busy_app(busy_calls=0, error=ValueError("a bad request"))
    assert _post(app)[0] == 500
    assert len(app.state.bodies) == 1
