"""What a closed sandbox must not leave behind."""
from __future__ import annotations

from pathlib import Path


def sandbox_leftovers(name: str) -> list[str]:
    """Mounts, cgroups, /tmp entries and processes that still carry the sandbox's name."""
    found = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if name in line]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob(f"**/{name}")]
    found += [str(p) for p in Path("/tmp").glob(f"{name}*")]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if name in (entry / "cmdline").read_text(errors="replace"):
                    found.append(f"process {entry.name}")
            except OSError:
                pass
    return found
