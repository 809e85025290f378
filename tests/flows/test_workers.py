"""The `processes` runner forks its workers from the fork server (flows/workers.py)."""
from __future__ import annotations

import json
import multiprocessing.forkserver
import signal
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.support.paths import REPO
from trajforge.flows.build import ForkedProcessPoolTaskRunner, make_task_runner
from trajforge.flows.workers import fork_server_available, start_fork_server


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


def _loops_loaded() -> list[int]:
    from trajforge.pipeline.quality import keys_kernel, sketch_screen

    return [len(loop.signatures) for loop in (keys_kernel.tokens, keys_kernel.signatures_and_sketches,
                                              sketch_screen.pairs_within, sketch_screen.pairs_across)]


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_a_forked_worker_starts_with_the_compiled_loops_loaded():
    """The fork server loaded the compiled loops (flows/worker_preload.py): a worker has them
    before its first key batch and its first screen."""
    start_fork_server()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        assert pool.submit(_loops_loaded).result() == [1, 1, 1, 1]


# A command that starts the fork server as the CLI does (flows/cli.py), inside the stop handling of
# every command, with a pipe of its own open; it prints what it saw as JSON. `{thread}` runs first.
FORKING_COMMAND = """
import json, multiprocessing, multiprocessing.forkserver, os, select, signal, threading, time
from concurrent.futures import ProcessPoolExecutor

import psutil

from tests.flows.test_workers import _loops_loaded
from trajforge.flows.stopping import stop_on_signals
from trajforge.flows.workers import start_fork_server, stop_fork_server

{thread}
with stop_on_signals():
    held_r, held_w = os.pipe()
    start_fork_server(fork=True)
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        worker_parent, loops = pool.submit(os.getppid).result(), pool.submit(_loops_loaded).result()
        os.close(held_w)
        closed = select.select([held_r], [], [], 5)[0] == [held_r] and os.read(held_r, 1) == b""
    forked = psutil.Process(server).cmdline() == psutil.Process().cmdline()
    stop_fork_server()
    _, status = os.waitpid(server, 0)
    time.sleep(0.5)  # a stop of this command would have begun by now
print(json.dumps({{"forked": forked, "worker_parent": worker_parent == server, "loops": loops,
                  "pipe_closed": closed, "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}}))
"""


def _run_forking_command(thread: str = "") -> dict:
    done = subprocess.run([sys.executable, "-c", FORKING_COMMAND.format(thread=thread)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_the_command_forks_its_fork_server_which_holds_none_of_its_files_and_ends_on_sigterm():
    """Forked from the command (flows/workers.py), the fork server forks the workers, with the
    compiled loops loaded; it holds none of the command's descriptors (the command's pipe reads
    its end once the command closes its own), and SIGTERM ends it as it ends a new process, without
    stopping the command (whose handlers it had inherited)."""
    seen = _run_forking_command()
    assert seen == {"forked": True, "worker_parent": True, "loops": [1, 1, 1, 1], "pipe_closed": True,
                    "signal": signal.SIGTERM}


@pytest.mark.skipif(not fork_server_available(), reason="no fork server on this platform")
def test_with_another_thread_running_the_fork_server_is_spawned():
    """A thread that may hold a lock makes forking the command unsafe: the fork server is spawned
    as multiprocessing does, and works the same."""
    seen = _run_forking_command("stop = threading.Event(); threading.Thread(target=stop.wait, daemon=True).start()")
    assert seen["forked"] is False
    assert seen["worker_parent"] and seen["loops"] == [1, 1, 1, 1] and seen["pipe_closed"]
