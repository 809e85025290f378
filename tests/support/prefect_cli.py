"""The `prefect` command of this interpreter's environment, run as a user runs it, from the repository."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.paths import REPO

PREFECT = str(Path(sys.executable).with_name("prefect"))


def run(cmd: list[str], env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done
