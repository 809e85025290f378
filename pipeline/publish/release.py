"""Publish a build folder to a Hugging Face dataset repo, atomically, and verify what landed.

A release is one `create_commit` holding every added, changed and deleted file, so readers see
either the previous revision or the new one, never a mix. The commit names the remote head it was
planned against (`parent_commit`): if someone pushed in between, the Hub refuses it instead of
silently mixing two builds. After the commit the remote tree at the new commit is compared with
the manifest (size and sha256 of every file); any difference raises `ReleaseVerificationError`.

The token comes from huggingface_hub itself (HF_TOKEN or the stored `hf auth login`); this module
never reads, logs or prints it.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi
from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

from trajforge.pipeline.publish.manifest import MANIFEST, file_sha256, read_manifest

log = logging.getLogger("trajforge.release")

# Files the Hub manages itself in every repo; a release neither deletes nor verifies them.
HUB_MANAGED = {".gitattributes"}


class ReleaseError(RuntimeError):
    """A release that must not go ahead (bad folder, tag already taken, remote moved)."""


class ReleaseVerificationError(ReleaseError):
    """The remote files after the push do not match the manifest."""


@dataclass
class ReleasePlan:
    repo_id: str
    revision: str
    parent_commit: str | None  # remote head the plan was made against; None: branch or repo is new
    added: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.added or self.changed or self.deleted)

    def lines(self) -> list[str]:
        out = [f"{self.repo_id}@{self.revision}: {len(self.added)} added, {len(self.changed)} changed, "
               f"{len(self.deleted)} deleted, {len(self.unchanged)} unchanged"]
        for tag, paths in (("+", self.added), ("~", self.changed), ("-", self.deleted)):
            out += [f"  {tag} {p}" for p in paths]
        return out


@dataclass
class ReleaseResult:
    plan: ReleasePlan
    commit: str
    tag: str | None
    verified: int


def git_blob_oid(path: Path) -> str:
    """The git object id of a file, which the Hub reports for files it stores as plain git blobs."""
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def local_files(folder: Path) -> dict[str, dict]:
    """What the release publishes: the manifest's files (checked against the disk) plus the manifest.

    Checking sha256 here lets the remote check compare git object ids of these very bytes.
    """
    manifest = read_manifest(folder)
    files = dict(manifest["files"])
    for path, entry in files.items():
        local = folder / path
        if not local.is_file() or local.stat().st_size != entry["size"] or file_sha256(local) != entry["sha256"]:
            raise ReleaseError(f"{local} is missing or differs from {MANIFEST}; rebuild before releasing")
    manifest_path = folder / MANIFEST
    files[MANIFEST] = {"size": manifest_path.stat().st_size, "sha256": file_sha256(manifest_path)}
    return files


def remote_head(api: HfApi, repo_id: str, revision: str) -> str | None:
    try:
        return api.repo_info(repo_id, repo_type="dataset", revision=revision).sha
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return None


def remote_tree(api: HfApi, repo_id: str, revision: str) -> dict:
    """path -> RepoFile at a revision (empty when the repo or branch does not exist yet)."""
    try:
        return {f.path: f for f in api.list_repo_tree(repo_id, repo_type="dataset", revision=revision, recursive=True)
                if hasattr(f, "blob_id")}
    except (RepositoryNotFoundError, RevisionNotFoundError):
        return {}


def _same(remote, local: Path, entry: dict) -> bool:
    if remote.size != entry["size"]:
        return False
    if remote.lfs is not None:
        return remote.lfs.sha256 == entry["sha256"]
    return remote.blob_id == git_blob_oid(local)


def plan_release(api: HfApi, folder: Path, repo_id: str, revision: str = "main") -> ReleasePlan:
    """What a release of `folder` would change on the remote (the dry run), without writing."""
    files = local_files(folder)
    head = remote_head(api, repo_id, revision)
    remote = remote_tree(api, repo_id, revision) if head else {}
    plan = ReleasePlan(repo_id, revision, head)
    for path, entry in sorted(files.items()):
        if path not in remote:
            plan.added.append(path)
        elif _same(remote[path], folder / path, entry):
            plan.unchanged.append(path)
        else:
            plan.changed.append(path)
    plan.deleted = sorted(p for p in remote if p not in files and p not in HUB_MANAGED)
    return plan


def verify_remote(api: HfApi, folder: Path, repo_id: str, commit: str) -> int:
    """Compare the remote files at `commit` with the manifest; raise on any difference.

    Large files live in LFS on the Hub, whose tree gives their sha256. Files stored as git blobs
    only have a git object id there; it is compared with the id of the local bytes, which
    `local_files` has checked against the manifest's sha256.
    """
    files = local_files(folder)
    remote = remote_tree(api, repo_id, commit)
    problems = []
    for path, entry in sorted(files.items()):
        problems += _check(folder / path, path, entry, remote.get(path))
    extra = sorted(p for p in remote if p not in files and p not in HUB_MANAGED)
    problems += [f"{p}: on the remote but not in the manifest" for p in extra]
    if problems:
        raise ReleaseVerificationError(f"{repo_id}@{commit} does not match {MANIFEST}:\n  " + "\n  ".join(problems))
    return len(files)


def _check(local: Path, path: str, entry: dict, item) -> list[str]:
    if item is None:
        return [f"{path}: missing on the remote"]
    if item.size != entry["size"]:
        return [f"{path}: size {item.size} on the remote, {entry['size']} in the manifest"]
    if item.lfs is not None:
        if item.lfs.sha256 != entry["sha256"]:
            return [f"{path}: sha256 {item.lfs.sha256} on the remote, {entry['sha256']} in the manifest"]
    elif item.blob_id != git_blob_oid(local):
        return [f"{path}: content on the remote (git oid {item.blob_id}) differs from sha256 {entry['sha256']} "
                "in the manifest"]
    return []


def release(folder: Path, repo_id: str, revision: str = "main", tag: str | None = None, private: bool = False,
            dry_run: bool = False, endpoint: str | None = None) -> ReleasePlan | ReleaseResult:
    """Push `folder` (a build output) to the dataset repo `repo_id` in one commit, tag it, verify it.

    With `dry_run` only the plan (added/changed/deleted against the remote) is returned.
    """
    folder = Path(folder)
    api = HfApi(endpoint=endpoint)
    build = read_manifest(folder)["build_id"]
    if tag is not None and tag in {t.name for t in _tags(api, repo_id)}:
        raise ReleaseError(f"tag {tag} already exists on {repo_id}; a release tag names one build")
    plan = plan_release(api, folder, repo_id, revision)
    if dry_run:
        return plan
    api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True)
    if plan.parent_commit is None and revision != "main":
        api.create_branch(repo_id, repo_type="dataset", branch=revision, exist_ok=True)
        plan = plan_release(api, folder, repo_id, revision)
    if plan.empty:
        commit = plan.parent_commit or remote_head(api, repo_id, revision)
        log.info("%s@%s already holds build %s; nothing to commit", repo_id, revision, build)
    else:
        operations = ([CommitOperationAdd(path_in_repo=p, path_or_fileobj=str(folder / p))
                       for p in plan.added + plan.changed]
                      + [CommitOperationDelete(path_in_repo=p) for p in plan.deleted])
        info = api.create_commit(repo_id, operations, repo_type="dataset", revision=revision,
                                 commit_message=f"trajforge build {build}" + (f" ({tag})" if tag else ""),
                                 commit_description="\n".join(plan.lines()),
                                 parent_commit=plan.parent_commit)
        commit = info.oid
    verified = verify_remote(api, folder, repo_id, commit)
    if tag is not None:
        api.create_tag(repo_id, repo_type="dataset", tag=tag, revision=commit,
                       tag_message=f"trajforge build {build}")
    return ReleaseResult(plan, commit, tag, verified)


def _tags(api: HfApi, repo_id: str) -> list:
    try:
        return api.list_repo_refs(repo_id, repo_type="dataset").tags
    except RepositoryNotFoundError:
        return []
