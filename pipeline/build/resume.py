"""Resuming a build: a unit is done once its completion marker names the same input fingerprint.

A unit's marker (`<out>/.staging/markers/units/<key>.done`) is written after its staged files, with
the fingerprint of what the unit depends on (the input's content and place, the config, the code)
and the unit's `UnitResult`. A rerun after a crash, even a SIGKILL, skips the units whose marker
matches and whose staged files are there.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

from trajforge.pipeline.atomic import remove_stale_temp_files, write_json
from trajforge.pipeline.build.config import BuildConfig
from trajforge.pipeline.build.units import UnitResult, process_unit, unit_files, unit_key
from trajforge.pipeline.publish.manifest import code_version, file_sha256
from trajforge.sources import SourceFile


def read_marker(path: Path, fingerprint: str) -> dict | None:
    """The marker's payload if it exists and was written for this fingerprint, else None."""
    try:
        marker = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return marker["payload"] if marker.get("fingerprint") == fingerprint else None


def write_marker(path: Path, fingerprint: str, payload: dict) -> None:
    write_json(path, {"fingerprint": fingerprint, "payload": payload}, indent=None)


def staging_folder(out: Path) -> Path:
    """`out/.staging` (made if missing), once the temp files of an interrupted run are gone from `out`."""
    staging = (out / ".staging").resolve()
    staging.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_files(out)
    return staging


def unit_fingerprint(source: str, path: Path, split: str, config: dict, input_sha256: str) -> str:
    """What a staged unit depends on: the input file's content (`input_sha256`), its place, the config, the code."""
    payload = [source, str(Path(path).resolve()), split, input_sha256, config, code_version()]
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def unit_marker(staging: Path, key: str) -> Path:
    return staging / "markers" / "units" / f"{key}.done"


def resume_unit(source_name: str, file: SourceFile, staging: Path,
                config: BuildConfig = BuildConfig()) -> tuple[UnitResult, bool]:
    """`process_unit`, unless an earlier run finished the unit on the same input and config (its
    marker, written after its staged files, says so, and names the files this code stages, in
    their format, which are there): (the result, whether it was finished earlier)."""
    # Hashed once, for the fingerprint and the unit's provenance: a second pass over the input cost
    # ~1 % of a 1M build's CPU.
    input_sha256 = file_sha256(file.path)
    fingerprint = unit_fingerprint(source_name, file.path, file.split, asdict(config), input_sha256)
    key = unit_key(source_name, file)
    marker = unit_marker(staging, key)
    done = read_marker(marker, fingerprint)
    if done and all(done.get(field) == str(path) and path.exists() for field, path in unit_files(staging, key).items()):
        return UnitResult(**done), True
    result = process_unit(source_name, file, staging, config, input_sha256)
    write_marker(marker, fingerprint, asdict(result))
    return result, False
