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
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from trajforge.pipeline.atomic import write_json

MANIFEST = "manifest.json"
# Says that a folder is the output of `trajforge build`: the `generator` of its manifest.json and
# report.json. While a rebuild runs, the earlier manifest waits under .staging (EARLIER_MANIFEST).
GENERATOR = "trajforge"
EARLIER_MANIFEST = Path(".staging") / "earlier-manifest.json"
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


def file_entry(path: Path) -> dict:
    """A file's manifest entry: its size and sha256."""
    return {"size": path.stat().st_size, "sha256": file_sha256(path)}


def write_manifest(out: Path, build: str, files: Iterable[str] | None = None, known: dict[str, dict] | None = None) -> dict:
    """Write `out/manifest.json` (temp name + rename) listing `files` (paths relative to `out`):
    the files the build wrote. Without `files`, every published file under `out`. `known`: the
    entries (`file_entry`, extra keys ignored) of files already digested by their writers once
    renamed into place (a build's shards, while each is in the page cache and on every worker):
    at 1M, ~2.8 GB that would be read again here, ~2.5 s on one core."""
    paths = published_files(out) if files is None else [out / rel for rel in sorted(set(files))]
    known = known or {}
    listed = {}
    for p in paths:
        rel = p.relative_to(out).as_posix()
        entry = known.get(rel) or file_entry(p)
        listed[rel] = {"size": entry["size"], "sha256": entry["sha256"]}
    manifest = {"generator": GENERATOR, "build_id": build, "files": listed}
    write_json(out / MANIFEST, manifest)
    return manifest


def set_manifest_aside(out: Path) -> set[str]:
    """Before a build writes into `out`: move an earlier build's manifest out of the way (so no
    reader takes the folder for a finished build meanwhile) and return the files it listed.

    A rebuild that was killed left the manifest set aside; it still says what the earlier build owns.
    """
    current, aside = out / MANIFEST, out / EARLIER_MANIFEST
    if current.exists():
        aside.parent.mkdir(parents=True, exist_ok=True)
        os.replace(current, aside)
    try:
        manifest = json.loads(aside.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return set()
    return set(manifest.get("files", {}))


def remove_earlier_files(out: Path, stale: Iterable[str]) -> None:
    """Delete files an earlier build wrote and this one did not, then its set-aside manifest."""
    root = out.resolve()
    for rel in stale:
        path = (out / rel).resolve()
        if path.is_relative_to(root) and path != root:  # a manifest names files inside its folder only
            path.unlink(missing_ok=True)
    (out / EARLIER_MANIFEST).unlink(missing_ok=True)


def read_manifest(out: Path) -> dict:
    path = out / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {out} the output folder of `trajforge build`?")
    return json.loads(path.read_text())
