"""Where a `--source` value points, checked before any flow starts.

A value is a local path if it exists, if its first component exists here, or if it starts with
`.`, `/` or `~`; anything else is a Hub repo id. A repo is looked up once with a short timeout,
so a mistyped path or an offline machine fails in a second with a message that says what was
tried and how to read a local copy instead, rather than after Prefect's start-up and retries.

Only light modules are imported here: the CLI runs these checks before Prefect loads. The lowest
module of `sources`: what a location may hold (the data file suffixes) and the error of an unusable
one (SourceError) are defined here, for sources/base.py to read the files, and which Hub commit a
downloaded file came from (`hub_revision`), for the provenance of every record read from it.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# Seconds to wait for the Hub's answer to one metadata request.
HUB_CHECK_TIMEOUT = float(os.environ.get("TRAJFORGE_HUB_TIMEOUT", "5"))

PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".json",)
JSONL_SUFFIXES = (".jsonl", ".ndjson")
DATA_SUFFIXES = PARQUET_SUFFIXES + JSON_SUFFIXES + JSONL_SUFFIXES
# A file huggingface_hub downloaded lies in its cache under snapshots/<commit>/.
SNAPSHOT_RE = re.compile(r"/snapshots/([0-9a-f]{40})/")


class SourceError(ValueError):
    """An unusable argument: unknown source, missing path, no data files. Fails the build fast."""


class HubUnavailable(Exception):
    """The Hub did not serve a repo. `offline`: it could not be reached at all; `retryable`: asking
    again soon might work (a timeout, a 5xx), unlike offline, 401, 403 or 404."""

    def __init__(self, repo_id: str, reason: str, retryable: bool = False, offline: bool = False):
        super().__init__(f"Hub dataset {repo_id}: {reason}")
        self.repo_id = repo_id
        self.reason = reason
        self.retryable = retryable
        self.offline = offline


def is_local_path(location: str | os.PathLike) -> bool:
    """Whether a `--source` location names a local path (see the module docstring) or a repo id."""
    if isinstance(location, os.PathLike):
        return True
    if location.startswith((".", "/", "~")) or os.path.exists(location):
        return True
    first = Path(location).parts[0] if Path(location).parts else ""
    return bool(first) and os.path.exists(first)


def local_path(location: str | os.PathLike) -> Path:
    return Path(location).expanduser()


def hub_revision(path: Path) -> str | None:
    """The Hub commit a downloaded file came from (its HF cache snapshot), None for local files.

    The path is made absolute but not resolved: in the cache a snapshot's file is a symlink to
    blobs/<hash>, which names no commit."""
    match = SNAPSHOT_RE.search(Path(path).absolute().as_posix())
    return match.group(1) if match else None


def hub_failure(repo_id: str, exc: Exception) -> HubUnavailable:
    """What a huggingface_hub error means for the user, and whether a retry could change it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(exc, HFValidationError):
        return HubUnavailable(repo_id, "not a valid repo id (ORG/NAME)")
    if isinstance(exc, OfflineModeIsEnabled):
        return HubUnavailable(repo_id, "offline (HF_HUB_OFFLINE is set)", offline=True)
    if isinstance(exc, LocalEntryNotFoundError):
        # snapshot_download's answer when the Hub is unreachable and nothing is cached.
        return HubUnavailable(repo_id, f"Hub unreachable and not in the local cache ({exc.__context__ or exc})",
                              offline=True)
    if isinstance(exc, GatedRepoError):
        return HubUnavailable(repo_id, f"gated: accept its terms on the Hub and {login}")
    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError)):
        return HubUnavailable(repo_id, f"not found on the Hub (if it is private, {login})")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return HubUnavailable(repo_id, f"access denied (HTTP {status}): {login}")
        if status == 404:
            return HubUnavailable(repo_id, "not found on the Hub")
        return HubUnavailable(repo_id, f"the Hub answered HTTP {status}", retryable=True)
    # The transport's errors, by name: its library (httpx or a fork) is huggingface_hub's choice.
    name = type(exc).__name__
    if "Timeout" in name and "Connect" not in name:
        return HubUnavailable(repo_id, f"the Hub did not answer in time ({name})", retryable=True)
    # Connect and DNS errors: no network, or the endpoint is down.
    return HubUnavailable(repo_id, f"Hub unreachable ({name}: {exc})".replace("\n", " "), offline=True)


def in_local_cache(repo_id: str, patterns: list[str]) -> bool:
    """Whether an earlier download left a snapshot of the repo that huggingface_hub can serve offline."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id=repo_id, repo_type="dataset", allow_patterns=patterns, local_files_only=True)
    except OSError:  # LocalEntryNotFoundError, OfflineModeIsEnabled: nothing usable is cached
        return False
    return True


def check_hub_repo(repo_id: str, patterns: list[str]) -> None:
    """One quick metadata request; raises HubUnavailable when the repo cannot be read now.

    A cached snapshot counts as readable offline (the download falls back to it); a timeout or a
    5xx is left to the download, which retries.
    """
    from huggingface_hub import HfApi

    try:
        HfApi().dataset_info(repo_id, timeout=HUB_CHECK_TIMEOUT)
    except Exception as exc:  # classified below; anything the Hub client raises means "not readable now"
        failure = hub_failure(repo_id, exc)
        if failure.retryable or (failure.offline and in_local_cache(repo_id, patterns)):
            return
        raise failure from None


def _source_arg(source, location: str | None) -> str:
    """The argument as the user gave it, for the first words of an error."""
    if location is not None:
        return f"--source {source.name}={location}"
    return f"--source {source.name} (Hub dataset {source.hub_repo})" if source.hub_repo else f"--source {source.name}"


def _local_files(source, location: str | None, arg: str) -> list:
    """The SourceFiles of a local location (None: a local-only source's own default)."""
    suffixes = ", ".join(DATA_SUFFIXES)
    path = local_path(location or "")
    if location is not None and not path.exists():
        raise SourceError(f"{arg}: no such file or folder {path.absolute()}; give the folder or data file "
                          f"of a local copy")
    if location is not None and path.is_file() and path.suffix.lower() not in DATA_SUFFIXES:
        raise SourceError(f"{arg}: {path.name} is not a data file (suffix {path.suffix or 'none'}); "
                          f"give a {suffixes} file or a folder of them")
    try:
        return source.files(location)  # the source's own discovery of its files, local and cheap
    except SourceError:
        if location is None:
            raise  # a local-only source without a path: its own message says what to give
        raise SourceError(f"{arg}: no data files ({suffixes}) under {path.absolute()}; give the folder "
                          f"that holds the upstream files") from None


def check_source(source, location: str | None) -> list | None:
    """Raise SourceError (one line: the argument, what is wrong, what to do) unless `source`
    (a sources.Source) can be read from `location` (a path, a repo id, or None: its own Hub repo).
    Returns the files of a local location (its SourceFiles), None for a Hub repo."""
    name = source.name
    arg = _source_arg(source, location)
    if not source.hub_repo or (location is not None and is_local_path(location)):
        return _local_files(source, location, arg)
    repo_id = location or source.hub_repo
    try:
        check_hub_repo(repo_id, list(source.hub_patterns))
    except HubUnavailable as exc:
        if location is None:
            raise SourceError(f"{arg}: {exc.reason}; to build from a local copy, pass --source {name}=PATH") from None
        raise SourceError(f"{arg}: neither a local path ({local_path(location).absolute()} does not exist) nor a "
                          f"readable Hub dataset ({repo_id}: {exc.reason}); give an existing folder or file "
                          f"(--source {name}=PATH) or a Hub repo id (--source {name}=ORG/NAME)") from None
    return None
