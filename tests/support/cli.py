"""The CLI as a user runs it, in a child process: its exit, its output, and its cost. A refusal is
bounded twice: in CPU seconds of the child (load-independent) and, generously for loaded CI
machines, in wall seconds."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

from tests.support.paths import REPO

WALL_BOUND_S = 15.0
CPU_BOUND_S = 2.0


def trajforge(*args: str, cwd=REPO, **env: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run the CLI; (the finished process, wall seconds, CPU seconds of the child)."""
    # REPO after any PYTHONPATH already set, which may point at the checkout under test.
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)])),
                   **env)
    command = [sys.executable, "-m", "trajforge.flows.cli", *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.monotonic()
        child = subprocess.Popen(command, cwd=cwd, env=environ, stdout=out, stderr=err, text=True)
        guard = threading.Timer(120, child.kill)  # wait4 has no timeout; a hung child must not hang the suite
        guard.start()
        _, status, usage = os.wait4(child.pid, 0)
        guard.cancel()
        wall = time.monotonic() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(command, child.returncode, out.read(), err.read())
    return proc, wall, usage.ru_utime + usage.ru_stime


def refused(*args: str, **kwargs) -> str:
    """Run a command that must be refused; returns its one-line message."""
    proc, wall, cpu = trajforge(*args, **kwargs)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert cpu < CPU_BOUND_S and wall < WALL_BOUND_S, f"{cpu:.1f} s CPU, {wall:.1f} s wall"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and not proc.stdout, proc.stderr
    return lines[0]
