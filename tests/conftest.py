"""Shared test fixtures: the real upstream records in tests/fixtures (provenance in its README)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Tests read Prefect's INFO records (progress, "released ...", secrets kept out of logs): a user's
# PREFECT_LOGGING_LEVEL=WARNING must not hide them, here or in the CLI subprocesses.
os.environ["PREFECT_LOGGING_LEVEL"] = "INFO"

# Prefect binds its console log handler to sys.stderr when its flow machinery is first imported.
# Importing it here, at collection, binds it to pytest's session-wide stream; imported first inside a
# test that captures output (capsys), it would keep that test's stream and every later in-process
# flow would log to a closed file.
import trajforge.flows.build  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("TRAJFORGE_FIXTURES", REPO / "tests" / "fixtures"))
RAW = FIXTURES / "raw"
# Agent-FLAN rows we wrote in the upstream layout (no raw rows are public in reach).
AGENT_FLAN = FIXTURES / "agent_flan"

# The build over all real fixture records: source name -> folder in the upstream layout.
FIXTURE_SOURCES = {
    "agentinstruct": str(RAW / "agentinstruct"),
    "agenttraj_l": str(RAW / "agenttraj_l"),
    "openmanus_rl": str(RAW / "openmanus_rl"),
}

# What the fixture build quarantines, (upstream id, reason) -> rows: each a real defect of the row
# (db_291/db_314/db_326 are in two containers). Anything else quarantined is a regression. Steps the
# env refused inside an episode that goes on are masked, not quarantined (alfworld_53 `End of the
# task.`, textcraft_205's prose turns, textcraft_251 `get` without a count: all answered with the
# env's refusal, all followed by a recovery; tests/test_grounding.py).
FIXTURE_QUARANTINE = {
    ("mind2web_46", "invalid_action"): 1,        # its one action, operation `SET`, is not CLICK/TYPE/SELECT
    ("db_291", "incomplete_episode"): 2,         # ends on an Operation that never ran, no Answer
    ("db_314", "incomplete_episode"): 2,
    ("db_326", "action_loop"): 2,                # the same INSERT, refused with the same MySQL error, six times
}


def pytest_addoption(parser):
    parser.addoption("--fuzz-records", type=int, default=3000,
                     help="records the fuzz suite generates (tests/test_fuzz.py); 10000+ for the full run")


@pytest.fixture(scope="session")
def fuzz_records(request) -> int:
    return request.config.getoption("--fuzz-records")


@pytest.fixture(scope="session")
def raw_dir() -> Path:
    assert RAW.is_dir(), f"fixtures not found at {RAW} (set TRAJFORGE_FIXTURES)"
    return RAW


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
