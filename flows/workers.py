"""Worker processes of the `processes` runner, forked from a fork server that imported the build once.

Prefect's ProcessPoolTaskRunner spawns each worker as a new interpreter, which imports Prefect and
the stages (~3 s of CPU each) before its first unit, and only once the build's subflow has begun,
after the temporary Prefect server has started. Forked from a fork server instead, a worker starts
with those modules loaded; and the CLI starts the fork server (`start_fork_server`) as soon as the
arguments are checked, so that its imports run on another core while this process imports and
the temporary server starts. Light on purpose: no Prefect here.

The fork server imports the modules and starts no thread, so forking it is safe; it inherits this
process's environment when it starts (the console log level, analytics off), and each worker gets
this run's Prefect API from the runner's initializer as before.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal

# What a worker runs, loaded once in the fork server (flows/worker_preload.py).
PRELOAD = ["trajforge.flows.worker_preload"]


def fork_server_available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def preload() -> None:
    """The modules the fork server loads when it starts (at the first worker, unless started before)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)


def start_fork_server() -> None:
    """Start the fork server now, loading `PRELOAD` (idempotent; nothing where there is no fork server)."""
    if fork_server_available():
        preload()
        multiprocessing.forkserver.ensure_running()


def stop_fork_server() -> None:
    """End the fork server now, at the end of the build: left to see this process exit, it would
    unload Prefect and the stages (~0.6 s, more on a busy machine) with the console's output still
    open (a pipe such as `| tee` would wait for it). It holds nothing to save; a later pool starts a
    new one."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid if fork_server_available() else None
    if pid is not None:
        os.kill(pid, signal.SIGTERM)  # not reaped here: ensure_running reaps it, or this process's exit
