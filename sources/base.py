"""What every source shares: locating files (local or Hub), streaming rows from any container.

Mirrors re-serialize the upstream files, so every source accepts Parquet, JSON arrays and JSON
Lines whatever its upstream container is. Rows are streamed (Parquet by record batch, JSON arrays
with ijson, JSON Lines by line): memory does not grow with the file.

A row that cannot be decoded is not an exception: it comes out as a `RawRow` with `error` set
(a reason code) and the raw text, and the build quarantines it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import ijson
import pyarrow.parquet as pq

from trajforge.sources.locate import hub_failure, is_local_path, local_path

PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".json",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATA_SUFFIXES = PARQUET_SUFFIXES + JSON_SUFFIXES + JSONL_SUFFIXES

# One record's raw text larger than this is not read into a record; it is quarantined.
MAX_RAW_BYTES = 8 * 1024 * 1024


class SourceError(ValueError):
    """An unusable argument: unknown source, missing path, no data files. Fails the build fast."""


@dataclass
class RawRow:
    """One upstream row, or the trace of one that could not be decoded."""
    source_file: str
    index: int
    row: dict | None = None
    error: str | None = None
    raw_text: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class SourceFile:
    path: Path
    split: str  # the upstream split or env name, taken from the file name


def _parquet_rows(path: Path, name: str) -> Iterator[RawRow]:
    try:
        reader = pq.ParquetFile(path)
        index = 0
        for batch in reader.iter_batches(batch_size=256):
            for row in batch.to_pylist():
                yield RawRow(name, index, row=row)
                index += 1
    except Exception as exc:  # pyarrow raises several types for a corrupt or mislabelled file
        yield RawRow(name, -1, error="unreadable_file", detail=f"not a readable Parquet file: {exc}"[:500])


def _jsonl_rows(path: Path, name: str) -> Iterator[RawRow]:
    with open(path, "rb") as fh:
        for index, line in enumerate(fh):
            if not line.strip():
                continue
            if len(line) > MAX_RAW_BYTES:
                yield RawRow(name, index, error="too_long", raw_text=line[:2000].decode("utf-8", "replace"),
                             detail=f"{len(line)} bytes")
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRow(name, index, error="invalid_utf8", raw_text=line.decode("utf-8", "replace"),
                             detail=str(exc))
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                yield RawRow(name, index, error="malformed_json", raw_text=text, detail=str(exc))
                continue
            if not isinstance(row, dict):
                yield RawRow(name, index, error="not_an_object", raw_text=text)
                continue
            yield RawRow(name, index, row=row)


def _json_rows(path: Path, name: str) -> Iterator[RawRow]:
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"{"):
        # A single object (AgentBench task files do this) or JSON Lines under a .json name.
        with open(path, "rb") as fh:
            first = fh.readline()
        try:
            json.loads(first)
            yield from _jsonl_rows(path, name)
            return
        except (json.JSONDecodeError, UnicodeDecodeError):
            pass
        yield from _whole_object(path, name)
        return
    index = 0
    try:
        with open(path, "rb") as fh:
            for index, row in enumerate(ijson.items(fh, "item", use_float=True)):
                if isinstance(row, dict):
                    yield RawRow(name, index, row=row)
                else:
                    yield RawRow(name, index, error="not_an_object", raw_text=json.dumps(row)[:2000])
    except (ijson.JSONError, UnicodeDecodeError) as exc:
        # Rows before the break were yielded; the rest of the file cannot be located reliably.
        yield RawRow(name, index + 1, error="malformed_json", detail=f"JSON array broken after row {index}: {exc}"[:500])


def _whole_object(path: Path, name: str) -> Iterator[RawRow]:
    if path.stat().st_size > MAX_RAW_BYTES:
        yield RawRow(name, 0, error="too_long", detail=f"{path.stat().st_size} bytes in one object")
        return
    raw = path.read_bytes()
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        yield RawRow(name, 0, error="invalid_utf8", raw_text=raw.decode("utf-8", "replace")[:2000], detail=str(exc))
        return
    except json.JSONDecodeError as exc:
        yield RawRow(name, 0, error="malformed_json", raw_text=raw.decode("utf-8", "replace")[:2000], detail=str(exc))
        return
    yield RawRow(name, 0, row=row)


def iter_rows(path: Path, name: str | None = None) -> Iterator[RawRow]:
    """Stream the rows of one data file, whatever container it is in."""
    name = name or path.name
    suffix = path.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        yield from _parquet_rows(path, name)
    elif suffix in JSONL_SUFFIXES:
        yield from _jsonl_rows(path, name)
    elif suffix in JSON_SUFFIXES:
        yield from _json_rows(path, name)
    else:
        raise SourceError(f"{path}: not a data file (expected one of {', '.join(DATA_SUFFIXES)})")


def find_data_files(root: Path) -> list[Path]:
    """Data files under a folder, sorted so that builds are deterministic."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def download_from_hub(repo_id: str, patterns: list[str], revision: str | None = None) -> Path:
    """Fetch a dataset repo's data files (only those matching `patterns`) into the HF cache.

    Uses huggingface_hub so `HF_ENDPOINT`, `HF_HUB_OFFLINE`, the token from the environment or
    the HF login, and the shared cache all behave as users expect.
    Errors that a retry cannot fix (offline, 401, 403, 404) become a SourceError, which the
    build does not retry.
    """
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo_id=repo_id, repo_type="dataset", revision=revision, allow_patterns=patterns)
    except Exception as exc:  # huggingface_hub's and its transport's errors, classified by hub_failure
        failure = hub_failure(repo_id, exc)
        if failure.retryable:
            raise
        raise SourceError(str(failure)) from exc
    return Path(local)


@dataclass
class SourceSpec:
    """What one source needs to be read: its name, Hub repo, license, and file -> split rule."""
    name: str
    hub_repo: str
    license: str
    hub_patterns: list[str] = field(default_factory=lambda: ["data/*", "*.json", "*.jsonl", "*.parquet"])


class Source:
    """One upstream dataset. Subclasses say how file names map to splits and splits to envs."""

    name: str
    hub_repo: str
    license: str
    hub_patterns: tuple[str, ...] = ("data/*", "*.json", "*.jsonl", "*.parquet")

    def files(self, location: str | None) -> list[SourceFile]:
        """Data files at a local path (folder or file), or in the Hub repo (`None` or a repo id)."""
        if location is None or not is_local_path(location):
            root = download_from_hub(location or self.hub_repo, list(self.hub_patterns))
        else:
            root = self.local_root(location)
        paths = find_data_files(root)
        if not paths:
            raise SourceError(f"source {self.name}: no data files ({', '.join(DATA_SUFFIXES)}) under {root}")
        return [SourceFile(p, self.split_of(p)) for p in paths]

    def local_root(self, location: str) -> Path:
        root = local_path(location)
        if not root.exists():
            raise SourceError(f"source {self.name}: path {location} does not exist")
        return root

    def split_of(self, path: Path) -> str:
        """Upstream split or env from an upstream file name (`os-00000-of-00001-<hash>.parquet`)."""
        return path.name.split(".")[0].split("-")[0]

    def row_id(self, row: dict) -> str | None:
        value = row.get("id", row.get("item_id"))
        return None if value is None else str(value)

    def record_id(self, split: str, source_id: str) -> str:
        """The namespaced id: unique per source as long as upstream ids are unique per source."""
        return f"{self.name}/{source_id}"

    def upstream_file(self, split: str, source_id: str) -> str:
        """The upstream file a row comes from; a re-release overrides this to name the original."""
        return split

    def domain_env(self, split: str, source_id: str, prompt: str = "") -> tuple[str, str] | None:
        """(domain, env) of a row, or None when neither its file, id nor prompt says which env it is."""
        raise NotImplementedError
