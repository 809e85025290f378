"""Worker processes of the `processes` runner, forked from a fork server that imported the build once.

Prefect's ProcessPoolTaskRunner spawns each worker as a new interpreter, which imports Prefect and
the stages (~3 s of CPU each) before its first unit, and only once the build's subflow has begun,
after the temporary Prefect server has started. Forked from a fork server instead, a worker starts
with those modules loaded.

The CLI forks the fork server from itself (`start_fork_server`) once it has imported the build's
flow, before the temporary server answers: the fork server then has Prefect and the stages loaded
as this process has them (their pages shared) and only loads the compiled loops of
flows/worker_preload.py. Spawned as multiprocessing does it, it imported all of it again (~2 s of
CPU of a 2-core machine's start-up, while this process and the temporary server import too).
Where this process cannot fork it safely (another thread holds a lock, or multiprocessing's fork
server is not the one this code knows), it is spawned.

A fork server starts no thread, so forking it is safe; each worker gets this run's Prefect API from
the runner's initializer.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import sys
from multiprocessing import connection, resource_tracker

from trajforge.flows.stopping import fork_safe

# What a worker runs, loaded once in the fork server (flows/worker_preload.py).
PRELOAD = ["trajforge.flows.worker_preload"]


def fork_server_available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def preload() -> None:
    """The modules the fork server loads when it starts (at the first worker, unless started before)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def start_fork_server(fork: bool = False) -> None:
    """Start the fork server now, loading `PRELOAD` (idempotent; nothing where there is no fork
    server): forked from this process with `fork` (module doc) where that is safe, else spawned."""
    if not fork_server_available():
        return
    preload()
    if not (fork and _fork_fork_server()):
        multiprocessing.forkserver.ensure_running()


# The state of multiprocessing's fork server (Python 3.11's, which pyproject pins) that a forked one sets.
_FORK_SERVER_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")


def _fork_fork_server() -> bool:
    """Fork the fork server from this process, as multiprocessing's `ensure_running` spawns it (a
    listening socket, the "alive" pipe whose end tells it every client is gone); False, starting
    nothing, where one runs already or forking is not safe (`fork_safe`)."""
    server = multiprocessing.forkserver._forkserver
    if not all(hasattr(server, name) for name in _FORK_SERVER_STATE) or server._forkserver_pid is not None:
        return False
    if not fork_safe():
        return False
    with server._lock:
        resource_tracker.ensure_running()
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")
            listener.bind(address)
            os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()
            for stream in (sys.stdout, sys.stderr):  # else both processes would write what is buffered
                if stream is not None:
                    stream.flush()
            pid = os.fork()
            if pid == 0:
                _serve_forks(listener.fileno(), alive_r, alive_w)
            os.close(alive_r)
        server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid
    return True


def _serve_forks(listener_fd: int, alive_r: int, alive_w: int):
    """The forked fork server: multiprocessing's loop, with the signal handling of a new process
    (this one's handlers would stop the command), until every client is gone. Never returns."""
    code = 1
    try:
        os.close(alive_w)
        _detach_fds(keep={0, 1, 2, listener_fd, alive_r})
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        multiprocessing.forkserver.main(listener_fd, alive_r, PRELOAD)
    except SystemExit:  # the loop's end: no client left
        code = 0
    except BaseException:
        sys.excepthook(*sys.exc_info())
    finally:
        sys.stderr.flush()
        os._exit(code)


def _detach_fds(keep: set[int]) -> None:
    """Point every open descriptor of this process but `keep` at /dev/null, as a spawned fork server
    has only its own: the workers must not hold the command's sockets and pipes open. Not closed,
    so that an object of the command that still names one cannot later close another file that was
    given its number."""
    folder = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    null = os.open(os.devnull, os.O_RDWR)
    # The listing names its own descriptor too, closed by now: /dev/null is opened there, harmless.
    for fd in map(int, os.listdir(folder)):
        if fd not in keep and fd != null:
            os.dup2(null, fd)
    os.close(null)


def stop_fork_server() -> None:
    """End the fork server now, at the end of the build: left to see this process exit, it would
    unload Prefect and the stages (~0.6 s, more on a busy machine) with the console's output still
    open (a pipe such as `| tee` would wait for it). It holds nothing to save; a later pool starts a
    new one."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid if fork_server_available() else None
    if pid is not None:
        os.kill(pid, signal.SIGTERM)  # not reaped here: ensure_running reaps it, or this process's exit
