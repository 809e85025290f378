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
- and if the command is still running `grace_s` later (it waits on a server that is gone), stops
  the child processes left and exits with 128 + the signal number. A second signal does that at once.

The watchdog thread learns of the signal through `signal.set_wakeup_fd`, which the interpreter
writes to whichever Python handler is installed (ours, or Prefect's during a flow run).

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
from typing import Iterator

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Seconds a stopping command has to unwind (mark its flow run Crashed, remove temp files) before
# it is ended.
STOP_GRACE_S = 4.0


class Stopped(BaseException):
    """The command was stopped by a signal (a BaseException, like KeyboardInterrupt: no `except
    Exception` on the way up may take it for a failure of its own)."""

    def __init__(self, signum: int):
        self.signum = signum
        self.name = signal.Signals(signum).name
        super().__init__(f"stopped by {self.name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stopped_message(name: str) -> str:
    return f"trajforge: stopped by {name}; what finished is kept: run the same command again to resume"


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


def _prefect_servers() -> set[int]:
    """Process ids of the temporary Prefect servers this process started (none if Prefect is not loaded)."""
    server = sys.modules.get("prefect.server.api.server")
    if server is None:
        return set()
    return {instance.server_process.pid for instance in list(server.SubprocessASGIServer._instances.values())
            if instance.server_process is not None}


class _Watchdog(threading.Thread):
    """Reads the signal numbers the interpreter writes to the wakeup socket; acts on SIGTERM/SIGINT."""

    def __init__(self, receiver: socket.socket, grace_s: float):
        super().__init__(name="trajforge-stop-watchdog", daemon=True)
        self.receiver = receiver
        self.grace_s = grace_s
        self.signum: int | None = None

    def run(self) -> None:
        deadline = None
        while True:
            self.receiver.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
            try:
                data = self.receiver.recv(64)
            except TimeoutError:
                break
            except OSError:
                return
            if not data:
                return  # the command ended; the socket was closed
            received = [number for number in data if number in STOP_SIGNALS]
            if not received:
                continue
            if self.signum is not None or len(received) > 1:
                self.signum = self.signum or received[0]
                break
            self.signum = received[0]
            deadline = time.monotonic() + self.grace_s
            spared = _prefect_servers()
            stop_processes([p for p in psutil.Process().children(recursive=True) if p.pid not in spared])
        # Still running: the grace is over, or a second signal came.
        stop_processes(psutil.Process().children(recursive=True), timeout_s=1.0)
        with contextlib.suppress(Exception):
            sys.stderr.write(stopped_message(signal.Signals(self.signum).name) + "\n")
            sys.stderr.flush()
        os._exit(128 + self.signum)


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
        nonlocal raised
        if not raised:  # later signals are the watchdog's
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
        raise (exc if isinstance(exc, Stopped) else Stopped(signum)) from None
    finally:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if watchdog.signum is None:
            sender.close()  # ends the watchdog; once a stop began it stays, to end a hung exit
