"""SIGTERM and Ctrl-C stop a command within seconds, with its worker processes.

SIGTERM is what `timeout`, systemd, Kubernetes and a Prefect cancel send; Ctrl-C sends SIGINT to
the terminal's whole process group and `timeout` signals its own group, so worker processes and
Prefect's temporary server may get the signal too. Left alone, a flow run turns SIGTERM into a
crash report to its API and then waits for its task runner: against a server that the same signal
stopped, the client retries for minutes; a process pool waits for the units in flight.

Inside `stop_on_signals`, the first SIGTERM or SIGINT
- raises `Stopped` in the main thread (during a flow run Prefect's own SIGTERM handler runs
  first: it marks the run Crashed, then sends the signal again, to ours);
- stops every child process at once (process-pool workers, a local cluster, sandboxes, a model
  server), except Prefect's temporary server, on which the run can still be marked Crashed;
- and once the main thread has unwound (files being written are removed, the temp files of
  pipeline/atomic.py), stops the child processes left and ends the process with 128 + the signal
  number (143 for SIGTERM, 130 for SIGINT). If the main thread has not unwound `grace_s` later
  (it waits on a server that is gone), the watchdog thread does that; a second signal, at once.

The watchdog thread learns of the signal through `signal.set_wakeup_fd`, which the interpreter
writes to whichever Python handler is installed (ours, or Prefect's during a flow run).

A command killed outright (SIGKILL, the OOM killer) runs no handler: its workers and Prefect's
temporary server end by themselves within seconds once it is gone (`end_with_owner`).

Stopping loses nothing finished: files are written under a temp name and renamed whole
(pipeline/atomic.py), a build's manifest is written last, finished units and episodes are marked or
journaled, and the same command run again resumes.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import NoReturn

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds a stopping command has to unwind (mark its flow run Crashed, remove temp files) before
# it is ended.
STOP_GRACE_S = 4.0
# Seconds between a child's looks at the command it serves (`end_with_owner`).
OWNER_POLL_S = 1.0


class Stopped(BaseException):
    """Raised in the main thread by the first stop signal (a BaseException, like KeyboardInterrupt:
    no `except Exception` on the way up takes it for a failure of its own)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def stop_processes(processes: list[psutil.Process], timeout_s: float = 2.0) -> None:
    """SIGTERM each process, then SIGKILL those still running `timeout_s` later."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=timeout_s)


def end_with_owner(owner_pid: int, poll_s: float = OWNER_POLL_S, grace_s: float = STOP_GRACE_S) -> None:
    """End this process once process `owner_pid` has: for the children a command cannot stop when it
    is killed outright (SIGKILL, the OOM killer), its task runner's workers and Prefect's temporary
    server, which would otherwise run on orphaned (a worker finishing its unit first). A daemon
    thread looks every `poll_s`; this process then gets SIGTERM, and is ended `grace_s` later if it
    still runs."""
    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        owner = None

    def gone() -> bool:
        try:
            return owner is None or not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def watch() -> None:
        while not gone():
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="trajforge-end-with-owner", daemon=True).start()


def _resource_tracker() -> set[int]:
    """multiprocessing's resource tracker, if running: it ignores SIGTERM, and removes the workers'
    semaphores once this process has exited, so it is left to end then."""
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    return {tracker._resource_tracker._pid} - {None} if tracker is not None else set()


def _prefect_servers() -> set[int]:
    """The temporary Prefect servers this process started (Prefect's, or the CLI's:
    flows/temporary_server.py), on which a run can be marked Crashed."""
    from trajforge.flows.temporary_server import running_pids

    server = sys.modules.get("prefect.server.api.server")
    instances = list(server.SubprocessASGIServer._instances.values()) if server is not None else []
    return running_pids() | {instance.server_process.pid for instance in instances if instance.server_process is not None}


def _children(spared: set[int]) -> list[psutil.Process]:
    return [process for process in psutil.Process().children(recursive=True) if process.pid not in spared]


def end_process(signum: int) -> NoReturn:
    """Stop the child processes left, say so, and exit with 128 + `signum`, skipping the interpreter's
    exit handlers: Prefect's would close a temporary server gracefully, or wait on one that is gone."""
    stop_processes(_children(_resource_tracker()), timeout_s=1.0)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write(f"trajforge: stopped by {signal.Signals(signum).name}; what finished is kept: run the "
                         f"same command again to resume\n")
        sys.stderr.flush()
    os._exit(128 + signum)


class _Watchdog(threading.Thread):
    """Waits for the first SIGTERM or SIGINT (the signal numbers the interpreter writes to the
    wakeup socket), stops the workers, then ends the process if it is still running `grace_s`
    later or when `hard_stop` is set (a second signal)."""

    def __init__(self, receiver: socket.socket, grace_s: float):
        super().__init__(name="trajforge-stop-watchdog", daemon=True)
        self.receiver = receiver
        self.grace_s = grace_s
        self.signum: int | None = None
        self.hard_stop = threading.Event()

    def run(self) -> None:
        while self.signum is None:
            try:
                data = self.receiver.recv(64)
            except OSError:
                return
            if not data:
                return  # the command ended; the socket was closed
            self.signum = next((number for number in data if number in STOP_SIGNALS), None)
        stop_processes(_children(_resource_tracker() | _prefect_servers()))
        self.hard_stop.wait(self.grace_s)
        end_process(self.signum)


@contextlib.contextmanager
def stop_on_signals(grace_s: float = STOP_GRACE_S) -> Iterator[None]:
    """Run the body so that SIGTERM or SIGINT stops it within seconds (see the module docstring).
    Outside the main thread signals cannot be handled: the body runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    receiver, sender = socket.socketpair()
    sender.setblocking(False)
    watchdog = _Watchdog(receiver, grace_s)
    raised = False

    def raise_stopped(signum, frame):
        # During a flow run, Prefect's handler takes the first SIGTERM and sends it again once the
        # run is marked Crashed: the first call here can be that one, only a later one is a second signal.
        nonlocal raised
        if raised:
            watchdog.hard_stop.set()
            return
        raised = True
        raise Stopped(signum)

    previous = {signum: signal.signal(signum, raise_stopped) for signum in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    watchdog.start()
    try:
        yield
    except BaseException as exc:
        # Whatever the stop broke on its way (a killed worker's pool, a server gone) is the stop.
        signum = watchdog.signum or (exc.signum if isinstance(exc, Stopped) else None)
        if signum is None:
            raise
        end_process(signum)
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sender.close()  # ends a watchdog that is still waiting for a signal
