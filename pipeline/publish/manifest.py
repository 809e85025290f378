"""manifest.json: every published file with its size and sha256, and the build id.

The release pushes exactly the files the manifest lists and verifies the remote against it, so
the manifest is the contract between a build and what the Hub serves.

The build id and the code version are content hashes, not timestamps: the same inputs, config and
code give the same id and byte-identical files, whatever the runner, machine or run.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Iterable

MANIFEST = "manifest.json"
# The code whose behaviour shapes the output: a change here is a new code version.
CODE_PACKAGES = ("trajforge.pipeline", "trajforge.sources", "trajforge.schemas")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.cache
def code_version() -> str:
    """`<package version>+<hash of the pipeline, sources and schemas code>`.

    A content hash rather than a git commit: commits that touch only tests or docs do not change
    the data, and a dirty checkout still gets an honest version.
    """
    try:
        version = metadata.version("trajforge")
    except metadata.PackageNotFoundError:
        version = "0"
    digest = hashlib.sha256()
    for package in CODE_PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.rglob("*")):
            if path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
                name = f"{package}/{path.relative_to(root).as_posix()}"
                digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{version}+{digest.hexdigest()[:12]}"


def build_id(inputs: Iterable[tuple[str, str, str]], config: dict, code: str) -> str:
    """Deterministic id of a build: its inputs `(source, file, sha256)` in build order, config, code."""
    payload = json.dumps({"inputs": list(inputs), "config": config, "code": code}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def published_files(out: Path) -> list[Path]:
    """What a release publishes: every file under `out` except hidden paths (staging, markers)."""
    return sorted(p for p in out.rglob("*") if p.is_file() and p.name != MANIFEST
                  and not any(part.startswith(".") for part in p.relative_to(out).parts))


def write_manifest(out: Path, build: str) -> dict:
    """Write `out/manifest.json` (temp name + rename) listing every published file."""
    files = {p.relative_to(out).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
             for p in published_files(out)}
    manifest = {"build_id": build, "files": files}
    tmp = out / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest


def read_manifest(out: Path) -> dict:
    path = out / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {out} the output folder of `trajforge build`?")
    return json.loads(path.read_text())
