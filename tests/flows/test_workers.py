"""The `processes` runner forks its workers from the fork server (flows/workers.py)."""
from __future__ import annotations

import multiprocessing.forkserver

import pytest

from trajforge.flows.build import ForkedProcessPoolTaskRunner, make_task_runner
from trajforge.flows.workers import fork_server_available


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_processes_runner_and_its_copies_fork_their_workers_from_the_fork_server():
    runner = make_task_runner("processes", workers=2)
    copy = runner.duplicate()  # what a flow run enters (and each task run in a worker)
    assert isinstance(copy, ForkedProcessPoolTaskRunner)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with copy as entered:
        assert entered._executor._mp_context.get_start_method() == "forkserver"
        assert entered._executor._max_workers == runner._max_workers
    # Entering starts nothing: only a first submit starts the fork server and its workers.
    assert multiprocessing.forkserver._forkserver._forkserver_pid == server
