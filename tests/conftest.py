"""Shared test fixtures: the real upstream records in tests/fixtures (provenance in its README);
their paths are in tests/support/paths.py."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tests read Prefect's INFO records (progress, "released ...", secrets kept out of logs): a user's
# PREFECT_LOGGING_LEVEL=WARNING must not hide them, here or in the CLI subprocesses.
os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"
# Test files run in parallel worker processes (pytest-xdist, `-n` in pyproject's addopts), and each
# worker's in-process flows start a temporary Prefect server: one home per worker keeps their
# servers off one SQLite database. Set before Prefect loads its settings (the import below).
WORKER_PREFECT_HOME = None
if os.environ.get("PYTEST_XDIST_WORKER"):
    WORKER_PREFECT_HOME = tempfile.mkdtemp(prefix=f"prefect-{os.environ['PYTEST_XDIST_WORKER']}-")
    os.environ["PREFECT_HOME"] = WORKER_PREFECT_HOME

# Prefect binds its console log handler to sys.stderr when its flow machinery is first imported.
# Importing it here, at collection, binds it to pytest's session-wide stream; imported first inside a
# test that captures output (capsys), it would keep that test's stream and every later in-process
# flow would log to a closed file.
import trajforge.flows.build  # noqa: E402,F401
from tests.support.paths import FIXTURE_SOURCES, RAW  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--fuzz-records", type=int, default=3000,
                     help="records the fuzz suite generates (tests/e2e/test_fuzz.py); 10000+ for the full run")


@pytest.fixture(scope="session")
def fuzz_records(request) -> int:
    return request.config.getoption("--fuzz-records")


@pytest.fixture(scope="session")
def raw_dir() -> Path:
    assert RAW.is_dir(), f"fixtures not found at {RAW} (set TRAJFORGE_FIXTURES)"
    return RAW


@pytest.fixture
def serve():
    """Loopback servers of AgentGym's protocol (tests/support/agentgym_server.py): serve(**kwargs)
    starts one and returns (server, url); all are stopped after the test."""
    from tests.support.agentgym_server import guess_servers

    with guess_servers() as start:
        yield start


@pytest.fixture(scope="session")
def fixtures_build(tmp_path_factory) -> Path:
    """The stages of `trajforge build` over every fixture source, without Prefect (fast)."""
    from trajforge.pipeline.build import BuildConfig, finalize, process_unit
    from trajforge.sources import get_source

    out = tmp_path_factory.mktemp("fixtures_build")
    config = BuildConfig()
    units = [process_unit(name, f, out / ".staging", config)
             for name, location in FIXTURE_SOURCES.items() for f in get_source(name).files(location)]
    finalize(units, out, config)
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """Stop Prefect's temporary servers while pytest still captures output.

    Prefect stops them at interpreter exit otherwise, after pytest has closed the stream its log
    handler writes to, and every test run would end with a "Logging error" traceback.
    """
    from prefect.logging.handlers import APILogHandler
    from prefect.server.api.server import SubprocessASGIServer

    APILogHandler().flush()  # send the logs still queued for the server before it goes
    # Its "Stopping temporary server" notice would land after pytest's closing summary line.
    logging.getLogger("prefect").setLevel(logging.WARNING)
    for server in list(SubprocessASGIServer._instances.values()):
        server.stop()
    if WORKER_PREFECT_HOME:
        shutil.rmtree(WORKER_PREFECT_HOME, ignore_errors=True)


def pytest_collection_modifyitems(items):
    """The files that hold a `slow` test first, each file's tests in their order: the workers take
    whole files in this order, and a slow file taken last would run alone at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
