"""What every source shares: locating files (local or Hub), streaming rows from any container.

Mirrors re-serialize the upstream files, so every source accepts Parquet, JSON arrays and JSON
Lines whatever its upstream container is. Rows are streamed (Parquet by row group and record batch,
JSON arrays by element, JSON Lines by line): memory does not grow with the file.

A row that cannot be decoded is not an exception: it comes out as a `RawRow` with `error` set
(a reason code) and the raw text, and the build quarantines it. A damaged container loses as
little as possible: a JSON array resumes at the next row after a malformed element, a Parquet
file at the next row group.
"""
from __future__ import annotations

import codecs
import json
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import ClassVar

import pyarrow.parquet as pq

from trajforge.sources.locate import (
    DATA_SUFFIXES,
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    SourceError,
    hub_failure,
    is_local_path,
    local_path,
)

log = logging.getLogger("trajforge.sources")

# One record's raw text larger than this is not read into a record; it is quarantined.
MAX_RAW_BYTES = 8 * 1024 * 1024
# Raw text kept on a RawRow that could not be decoded (the quarantine cuts it again).
MAX_KEPT_RAW = 100_000
# JSON arrays are decoded this many bytes at a time.
CHUNK_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"
# The Hub's shard suffix on a file stem: `os-00000-of-00001`, `train-00000-of-00003-1a2b3c4d`.
SHARD_SUFFIX = re.compile(r"-\d{5}-of-\d{5}(?:-[0-9a-fA-F]+)?$")
# Top-level keys of an upstream row (or of one of our records); a JSON array reader that lost
# its place resumes at the next object with one of them.
ROW_KEYS = frozenset({"id", "item_id", "conversations", "conversation", "schema_version"})
TURN_KEYS = frozenset({"from", "role", "value", "content", "loss"})


@dataclass
class RawRow:
    """One upstream row, or the trace of one that could not be decoded.

    `rows` is how many upstream rows the entry stands for: 1, except for an unreadable Parquet
    row group, which is one entry holding the row count its footer states.
    """
    source_file: str
    index: int
    row: dict | None = None
    error: str | None = None
    raw_text: str | None = None
    detail: str | None = None
    rows: int = 1


@dataclass(frozen=True)
class SourceFile:
    path: Path
    split: str  # the upstream split or env name, taken from the file name
    # The file's path relative to the source root: how the report and the quarantine name it.
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.path.name


def file_stem(path: Path) -> str:
    """The file name without extensions and without the Hub's `-NNNNN-of-MMMMM[-hash]` suffix."""
    return SHARD_SUFFIX.sub("", path.name.split(".")[0])


def row_ids(rows: list[dict], key: str) -> list[str]:
    """The `key` value of every row as text; empty unless every row has one (a file with a row
    that lacks it is not recognized by it)."""
    ids = [row.get(key) for row in rows]
    return [str(i) for i in ids] if ids and all(isinstance(i, (str, int)) for i in ids) else []


def _shown(text: str) -> str:
    """Decoded text made safe to store: undecodable bytes (kept as surrogate escapes) as `\\xNN`."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")[:MAX_KEPT_RAW]


# An object that follows a separator: where a JSON array reader that lost its place looks for a row.
_ROW_CANDIDATE = re.compile(r'[,\[]\s*(\{)\s*"')
_FIRST_KEY = re.compile(r'\{\s*"([^"\\]*)"')
_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value) -> bool:
    """Whether any string (or key) in a decoded JSON value holds an unpaired surrogate."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _undecodable(text: str) -> bool:
    """Whether the reader kept bytes of `text` that are not UTF-8 (as surrogate escapes,
    U+DC80-U+DCFF). Decoded text holds no other surrogate, so that is whether it fails to encode:
    several times faster than searching it, and ASCII text (a flag Python keeps) holds none."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _decoded_row(name: str, index: int, text: str, value) -> RawRow:
    """A decoded JSON value as a row, or the reason it cannot be one. `text` is its source text."""
    if _undecodable(text):
        return RawRow(name, index, error="invalid_utf8", raw_text=_shown(text), detail="bytes that are not UTF-8")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(value):
        # Valid JSON, but no UTF-8 text can hold it; replacing it would change the text silently.
        return RawRow(name, index, error="unpaired_surrogate", raw_text=text[:MAX_KEPT_RAW],
                      detail="a \\uD800-\\uDFFF escape without its pair")
    if not isinstance(value, dict):
        return RawRow(name, index, error="not_an_object", raw_text=text[:MAX_KEPT_RAW])
    return RawRow(name, index, row=value)


def _parquet_rows(path: Path, name: str) -> Iterator[RawRow]:
    """Rows of a Parquet file, row group by row group: a damaged group costs only its own rows."""
    try:
        reader = pq.ParquetFile(path)
        meta = reader.metadata
    except Exception as exc:  # pyarrow raises several types for a corrupt or mislabelled file
        yield RawRow(name, -1, error="unreadable_file",
                     detail=f"not a readable Parquet file (bytes 0-{path.stat().st_size}): {exc}"[:500])
        return
    index = 0
    for group in range(meta.num_row_groups):
        in_group = meta.row_group(group).num_rows
        done = 0
        try:
            for batch in reader.iter_batches(batch_size=256, row_groups=[group]):
                for row in batch.to_pylist():
                    yield RawRow(name, index + done, row=row)
                    done += 1
        except Exception as exc:
            lost = in_group - done
            yield RawRow(name, index + done, error="unreadable_row_group", rows=lost,
                         detail=(f"row group {group} of {meta.num_row_groups}: rows {index + done}-{index + in_group - 1}"
                                 f" ({lost} rows{_row_group_bytes(meta, group)}) unreadable: {exc}")[:1000])
        index += in_group


def _row_group_bytes(meta, group: int) -> str:
    """`, bytes A-B` of a row group in the file, from its column chunks ('' when the footer lacks it)."""
    try:
        columns = [meta.row_group(group).column(i) for i in range(meta.row_group(group).num_columns)]
        starts = [min(c.data_page_offset, c.dictionary_page_offset or c.data_page_offset) for c in columns]
        ends = [c.data_page_offset + c.total_compressed_size for c in columns]
        return f", bytes {min(starts)}-{max(ends)}"
    except Exception:
        return ""


def _jsonl_rows(path: Path, name: str) -> Iterator[RawRow]:
    with open(path, "rb") as fh:
        for index, line in enumerate(fh):
            # A BOM opens the file, or a line of files that were concatenated.
            line = line.removeprefix(UTF8_BOM)
            if not line.strip():
                continue
            if len(line) > MAX_RAW_BYTES:
                yield RawRow(name, index, error="too_long", raw_text=line[:2000].decode("utf-8", "replace"),
                             detail=f"{len(line)} bytes")
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield RawRow(name, index, error="invalid_utf8", raw_text=line.decode("utf-8", "backslashreplace"),
                             detail=str(exc))
                continue
            text = text.rstrip("\r\n")
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                yield RawRow(name, index, error="malformed_json", raw_text=text, detail=str(exc))
                continue
            except RecursionError:
                yield RawRow(name, index, error="too_deep", raw_text=text, detail="nested deeper than the JSON parser goes")
                continue
            yield _decoded_row(name, index, text, row)


class _JsonText:
    """A JSON file's text, decoded a chunk at a time into a window that the reader trims.

    Bytes that are not UTF-8 are kept as surrogate escapes, so one bad byte spoils only the
    element it is in, and the element's raw bytes can still be shown.
    """

    def __init__(self, fh):
        self.fh = fh
        # Strict until a chunk holds bytes that are not UTF-8 (`more`).
        self.decoder = codecs.getincrementaldecoder("utf-8-sig")()
        self.buf = ""
        self.eof = False
        self.read_bytes = 0  # bytes of the file fed to the decoder
        # Whether the text read so far may hold bytes that are not UTF-8 or an escaped surrogate: until
        # it does (most files never), its elements need no check of their own (`_decoded_row`'s).
        self.suspect = False

    def more(self) -> bool:
        """Read one more chunk; False at the end of the file."""
        if self.eof:
            return False
        chunk = self.fh.read(CHUNK_BYTES)
        self.read_bytes += len(chunk)
        # Text decoded strictly holds no surrogate escape: no `_undecodable` pass over it (an encoding
        # of each non-ASCII chunk, ~13 % of reading the generated corpus's JSON arrays). The first
        # chunk that fails is decoded again from the same state, its bad bytes kept as escapes, and
        # so is every chunk after it.
        state = self.decoder.getstate()
        try:
            text = self.decoder.decode(chunk, final=not chunk)
        except UnicodeDecodeError:
            self.decoder.setstate(state)
            self.decoder.errors = "surrogateescape"
            text = self.decoder.decode(chunk, final=not chunk)
            self.suspect = True
        # An escape may also begin in the last 5 characters before the chunk's text.
        self.suspect = self.suspect or any(_SURROGATE_ESCAPE.search(part) for part in (text, self.buf[-5:] + text[:5]))
        self.buf += text
        self.eof = not chunk
        return True

    def skip_space(self, pos: int) -> int:
        while True:
            while pos < len(self.buf) and self.buf[pos] in " \t\r\n":
                pos += 1
            if pos < len(self.buf) or not self.more():
                return pos

    def drop(self, pos: int) -> None:
        """Forget the text before `pos` (positions shift by `pos`)."""
        self.buf = self.buf[pos:]

    def byte_at(self, pos: int) -> int:
        """The file offset of `buf[pos]`, counted back from the last byte decoded (the BOM and bytes
        held for an incomplete character lie outside the text): only a malformed element needs it,
        so forgetting text costs no encoding of it."""
        held = len(self.decoder.getstate()[0])
        return self.read_bytes - held - len(self.buf[pos:].encode("utf-8", "surrogateescape"))

    def value_at(self, pos: int, decoder=json.JSONDecoder()):
        """(value, end) of the JSON value at `pos`, reading on while the value may continue."""
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, pos)
            except json.JSONDecodeError as exc:
                if self.cut_off(exc) and len(self.buf) - pos <= MAX_RAW_BYTES and self.more():
                    continue
                raise
            if end == len(self.buf) and self.more():
                continue  # a number (or the file) may go on
            return value, end

    def cut_off(self, exc: json.JSONDecodeError) -> bool:
        """Whether a decoding error comes from the end of the text (more may follow), not bad JSON."""
        return exc.msg.startswith("Unterminated string") or len(self.buf) - exc.pos <= 16

    def next_row_start(self, pos: int) -> int:
        """Where the next row begins after `pos`, or the end of the text: an object after a `,`
        that has a row key and is followed by `,` or `]`, or that is broken too and does not
        start like a turn."""
        search = pos + 1
        while True:
            match = _ROW_CANDIDATE.search(self.buf, search)
            if match is None:
                search = max(search, len(self.buf) - 64)  # a candidate may straddle two chunks
                if self.more():
                    continue
                return len(self.buf)
            start = match.start(1)
            try:
                value, end = self.value_at(start)
            except (json.JSONDecodeError, RecursionError):
                # Broken too (or too deep to decode): judged by its first key, since a turn of
                # the broken row is not a row.
                first_key = _FIRST_KEY.match(self.buf, start)
                if first_key and first_key[1] not in TURN_KEYS:
                    return start
                search = start + 1
                continue
            after = self.skip_space(end)
            if isinstance(value, dict) and ROW_KEYS & value.keys() and (after == len(self.buf)
                                                                        or self.buf[after] in ",]"):
                return start
            search = start + 1


def _json_array_rows(text: _JsonText, name: str, pos: int) -> Iterator[RawRow]:
    """Elements of the array opening at `pos`. A malformed element (or one cut off) is one
    quarantine entry with its raw text and byte span, and reading resumes at the next row."""
    index = 0
    pos += 1
    error = None
    while True:
        pos = text.skip_space(pos)
        if pos >= len(text.buf):
            if index and error is None:
                log.warning("%s: the JSON array is not closed (cut off after element %d)", name, index - 1)
            return
        if text.buf[pos] == "]":
            return
        if text.buf[pos] == ",":  # an empty slot (`,,`) holds no record
            pos += 1
            continue
        try:
            value, end = text.value_at(pos)
            error = None
        except json.JSONDecodeError as exc:
            error, detail = ("truncated", f"the file ends inside this element: {exc.msg}") \
                if text.eof and text.cut_off(exc) else ("malformed_json", str(exc))
        except RecursionError:
            error, detail = "too_deep", "nested deeper than the JSON parser goes"
        if error is None:
            yield (RawRow(name, index, row=value) if type(value) is dict and not text.suspect
                   else _decoded_row(name, index, text.buf[pos:end], value))
            pos = text.skip_space(end)
            if pos < len(text.buf) and text.buf[pos] == ",":
                pos += 1
        else:
            resume = text.next_row_start(pos)
            span = text.buf[pos:resume].rstrip().removesuffix(",").rstrip()
            first, last = text.byte_at(pos), text.byte_at(pos + len(span))
            yield RawRow(name, index, error=error, raw_text=_shown(span),
                         detail=f"{detail}; bytes {first}-{last}"[:1000])
            pos = resume
        index += 1
        if pos > CHUNK_BYTES:
            text.drop(pos)
            pos = 0


def _json_rows(path: Path, name: str) -> Iterator[RawRow]:
    with open(path, "rb") as fh:
        text = _JsonText(fh)
        pos = text.skip_space(0)
        if pos >= len(text.buf):
            return  # an empty file holds no record
        if text.buf[pos] == "[":
            yield from _json_array_rows(text, name, pos)
            return
    with open(path, "rb") as fh:
        first = fh.readline().removeprefix(UTF8_BOM)
    try:
        json.loads(first)
        # JSON Lines under a .json name.
        yield from _jsonl_rows(path, name)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        # A single object (AgentBench task files do this), or no JSON at all.
        yield from _whole_object(path, name)


def _whole_object(path: Path, name: str) -> Iterator[RawRow]:
    if path.stat().st_size > MAX_RAW_BYTES:
        yield RawRow(name, 0, error="too_long", detail=f"bytes 0-{path.stat().st_size} in one object")
        return
    raw = path.read_bytes().removeprefix(UTF8_BOM)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        yield RawRow(name, 0, error="invalid_utf8", raw_text=raw.decode("utf-8", "backslashreplace")[:MAX_KEPT_RAW],
                     detail=str(exc))
        return
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        yield RawRow(name, 0, error="malformed_json", raw_text=text[:MAX_KEPT_RAW], detail=str(exc))
        return
    except RecursionError:
        yield RawRow(name, 0, error="too_deep", raw_text=text[:MAX_KEPT_RAW],
                     detail="nested deeper than the JSON parser goes")
        return
    yield _decoded_row(name, 0, text, row)


def iter_rows(path: Path, name: str | None = None) -> Iterator[RawRow]:
    """Stream the rows of one data file, whatever container it is in. An empty file has none."""
    name = name or path.name
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise SourceError(f"{path}: not a data file (expected one of {', '.join(DATA_SUFFIXES)})")
    if path.stat().st_size == 0:
        return
    if suffix in PARQUET_SUFFIXES:
        yield from _parquet_rows(path, name)
    elif suffix in JSONL_SUFFIXES:
        yield from _jsonl_rows(path, name)
    else:
        yield from _json_rows(path, name)


def find_data_files(root: Path) -> list[Path]:
    """Data files under a folder, sorted so that builds are deterministic."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(root).parts))


def relative_name(path: Path, root: Path) -> str:
    """How a file is named in the report and quarantine: its path under the source root."""
    return path.name if root.is_file() else path.relative_to(root).as_posix()


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


class KeepRank(IntEnum):
    """Which copy of a duplicate the dedup keeps, by source (lower is kept): a re-release drops
    upstream fields (loss flags, ids), and synthetic rows are ours."""
    ORIGINAL = 0
    RE_RELEASE = 1
    SYNTHETIC = 2


class Source:
    """One upstream dataset. Subclasses say how file names map to splits and splits to envs,
    and state their keep rank (there is no default: a new source says what it is)."""

    name: str
    hub_repo: str
    license: str
    keep_rank: ClassVar[KeepRank]
    hub_patterns: tuple[str, ...] = ("data/*", "*.json", "*.jsonl", "*.parquet")
    # Upstream file (as `upstream_file` names it) -> negative type: files whose rows are negatives.
    negative_files: ClassVar[Mapping[str, str]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, "keep_rank", None), KeepRank):
            raise TypeError(f"source {cls.__name__} must state its keep_rank (a KeepRank)")

    def files(self, location: str | None) -> list[SourceFile]:
        """Data files at a local path (folder or file), or in the Hub repo (`None` or a repo id)."""
        if location is None or not is_local_path(location):
            root = download_from_hub(location or self.hub_repo, list(self.hub_patterns))
        else:
            root = self.local_root(location)
        paths = find_data_files(root)
        if not paths:
            raise SourceError(f"source {self.name}: no data files ({', '.join(DATA_SUFFIXES)}) under {root}")
        return [SourceFile(p, self.split_of(p), relative_name(p, root)) for p in paths]

    def local_root(self, location: str) -> Path:
        root = local_path(location)
        if not root.exists():
            raise SourceError(f"source {self.name}: path {location} does not exist")
        return root

    def split_of(self, path: Path) -> str:
        """Upstream split or env from an upstream file name (`os-00000-of-00001-<hash>.parquet`,
        `db-sample.parquet`)."""
        return file_stem(path).split("-")[0]

    def row_id(self, row: dict) -> object:
        """The row's upstream id as stored (a string or an integer in a well-formed row); a source
        whose rows keep it under another key overrides this. The normalizer checks its type."""
        return row.get("id", row.get("item_id"))

    def record_id(self, split: str, source_id: str) -> str:
        """The namespaced id: unique per source as long as upstream ids are unique per source."""
        return f"{self.name}/{source_id}"

    def upstream_file(self, split: str, source_id: str) -> str:
        """The upstream file a row comes from; a re-release overrides this to name the original."""
        return split

    def negative_type(self, split: str, source_id: str) -> str | None:
        """The negative type of a row from a file of upstream negatives, else None."""
        return self.negative_files.get(self.upstream_file(split, source_id))

    def domain_env(self, split: str, source_id: str, prompt: str = "") -> tuple[str, str] | None:
        """(domain, env) of a row, or None when neither its file, id nor prompt says which env it is."""
        raise NotImplementedError

    def recognizes(self, path: Path, rows: list[dict]) -> str | None:
        """Why a data file (its name and first decoded rows) is unmistakably in this source's
        upstream layout, or None. Only marks that no other registered source has count: the
        check that refuses one dataset read under another's name (and license) relies on it."""
        return None
