"""A small Hugging Face Hub-compatible HTTP server on loopback, for the release tests.

The Hub cannot be reached from the test machines, and no open-source Hub server exists, so this
implements just the endpoints that huggingface_hub (create_repo, create_commit, list_repo_tree,
refs, branches, tags, downloads) and `datasets.load_dataset` call, for dataset repos, keeping
every commit in memory. Every URL it answers with stays on its own host, as the client requires.

Files are stored as regular git blobs (preupload answers `uploadMode: "regular"`), so the commit
carries their content base64-encoded in its NDJSON body and a commit is applied only once the
whole body has arrived: an interrupted push leaves the branch where it was, as on the Hub.

Faults for the tests: `cut_commits` closes the connection half-way through the next commit
bodies; `corrupt_next_commit` stores one file of the next commit with a byte flipped (so the
post-push verification has something to catch).
"""
from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit


def git_blob_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


@dataclass
class Commit:
    oid: str
    parent: str | None
    message: str
    files: dict[str, bytes]


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: dict[str, Commit] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        oid = self.branches.get(revision) or self.tags.get(revision)
        if oid is None and revision in self.commits:
            oid = revision
        return self.commits.get(oid) if oid else None

    def add_commit(self, parent: Commit | None, files: dict[str, bytes], message: str) -> Commit:
        seed = json.dumps([parent.oid if parent else None, message,
                           sorted((p, git_blob_oid(c)) for p, c in files.items())])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent.oid if parent else None, message, files)
        self.commits[commit.oid] = commit
        return commit


class HubState:
    def __init__(self, token: str | None):
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        self.cut_commits = 0
        self.corrupt_next_commit = False
        self.commit_requests = 0


class _Cut(Exception):
    """The connection is dropped without an answer (a simulated network failure)."""


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HubServer

    def log_message(self, format, *args):  # noqa: A002 - quiet: pytest shows failures, not access logs
        pass

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def state(self) -> HubState:
        return self.server.state

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json", head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, payload, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._json(status, {"error": message}, {"X-Error-Message": message, **(headers or {})})

    def _authorized(self) -> bool:
        if self.state.token is None:
            return True
        return self.headers.get("Authorization") == f"Bearer {self.state.token}"

    def _repo(self, repo_id: str, write: bool = False) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None or ((repo.private or write) and not self._authorized()):
            self._error(404, "Repository not found", {"X-Error-Code": "RepoNotFound"})
            return None
        return repo

    def _revision(self, repo: Repo, revision: str) -> Commit | None:
        commit = repo.resolve(revision)
        if commit is None:
            self._error(404, f"Invalid rev id: {revision}", {"X-Error-Code": "RevisionNotFound"})
        return commit

    def _repo_commit(self, repo_id: str, rest: list[str], write: bool = False):
        """(repo, commit at the revision in the path, default main), or None once an error is sent."""
        repo = self._repo(repo_id, write)
        if repo is None:
            return None
        commit = self._revision(repo, rest[0] if rest else "main")
        return None if commit is None else (repo, commit)

    def _entries(self, commit: Commit, prefix: str, recursive: bool) -> list[dict]:
        """Tree entries under `prefix` (files and folders), as /tree and /paths-info answer."""
        prefix = prefix.strip("/")
        base = f"{prefix}/" if prefix else ""
        files, folders = [], set()
        for path, content in sorted(commit.files.items()):
            if not path.startswith(base):
                continue
            rest = path[len(base):].split("/")
            if len(rest) == 1 or recursive:
                files.append({"type": "file", "oid": git_blob_oid(content), "size": len(content), "path": path})
            for depth in range(1, len(rest) if recursive else min(2, len(rest))):
                folders.add(base + "/".join(rest[:depth]))
        return [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                for f in sorted(folders)] + files

    # -- routing ----------------------------------------------------------------------------
    def do_GET(self):
        self._route("GET")

    def do_HEAD(self):
        self._route("HEAD")

    def do_POST(self):
        self._route("POST")

    def _route(self, method: str) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            # The commit handler takes the lock itself, after reading its (possibly large) body.
            lock = contextlib.nullcontext() if method == "POST" and "commit" in parts else self.state.lock
            with lock:
                self._dispatch(method, parts, query)
        except _Cut:
            self.close_connection = True

    def _dispatch(self, method: str, parts: list[str], query: dict[str, str]) -> None:
        if method == "POST" and parts == ["api", "repos", "create"]:
            return self._create_repo()
        if method == "POST" and parts == ["api", "validate-yaml"]:
            self._body()
            return self._json(200, {"errors": [], "warnings": []})
        if parts[:2] == ["api", "datasets"] and len(parts) >= 4:
            repo_id = f"{parts[2]}/{parts[3]}"
            action, rest = (parts[4], parts[5:]) if len(parts) > 4 else ("info", [])
            handler = {
                ("GET", "info"): self._info, ("GET", "revision"): self._info, ("GET", "tree"): self._tree,
                ("POST", "paths-info"): self._paths_info, ("GET", "refs"): self._refs,
                ("POST", "preupload"): self._preupload, ("POST", "commit"): self._commit,
                ("POST", "tag"): self._tag, ("POST", "branch"): self._branch,
            }.get((method, action))
            if handler is not None:
                return handler(repo_id, rest, query)
        if method in ("GET", "HEAD") and parts[:1] == ["datasets"] and len(parts) >= 6 and parts[3] == "resolve":
            return self._resolve(f"{parts[1]}/{parts[2]}", parts[4], "/".join(parts[5:]), method == "HEAD")
        self._body()
        self._error(404, f"no such endpoint on the test Hub: {method} {self.path}")

    # -- endpoints --------------------------------------------------------------------------
    def _create_repo(self) -> None:
        payload = json.loads(self._body())
        if not self._authorized():
            return self._error(401, "Invalid credentials in Authorization header")
        if payload.get("type") != "dataset":
            return self._error(400, "the test Hub only hosts datasets")
        repo_id = f"{payload['organization']}/{payload['name']}" if payload.get("organization") else payload["name"]
        url = f"{self.server.endpoint}/datasets/{repo_id}"
        if repo_id in self.state.repos:
            return self._json(409, {"error": "You already created this dataset repo", "url": url})
        repo = Repo(repo_id, payload.get("visibility") == "private" or bool(payload.get("private")))
        # The Hub starts every repo with one commit holding .gitattributes.
        first = repo.add_commit(None, {".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n"},
                                "initial commit")
        repo.branches["main"] = first.oid
        self.state.repos[repo_id] = repo
        self._json(200, {"url": url, "name": repo_id})

    def _info(self, repo_id: str, rest: list[str], query: dict) -> None:
        found = self._repo_commit(repo_id, rest)
        if found is None:
            return
        repo, commit = found
        self._json(200, {"id": repo_id, "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                         "author": repo_id.split("/")[0], "sha": commit.oid, "private": repo.private,
                         "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": [],
                         "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                         "siblings": [{"rfilename": p} for p in sorted(commit.files)]})

    def _tree(self, repo_id: str, rest: list[str], query: dict) -> None:
        repo = self._repo(repo_id)
        if repo is None or not rest:
            return None if repo is None else self._error(400, "missing revision")
        commit = self._revision(repo, rest[0])
        if commit is None:
            return
        path = "/".join(rest[1:])
        entries = self._entries(commit, path, query.get("recursive", "").lower() == "true")
        if path and not entries:
            return self._error(404, f"{path} does not exist", {"X-Error-Code": "EntryNotFound"})
        self._json(200, entries)

    def _paths_info(self, repo_id: str, rest: list[str], query: dict) -> None:
        form = parse_qs(self._body().decode())
        found = self._repo_commit(repo_id, rest)
        if found is None:
            return
        repo, commit = found
        out = []
        for path in form.get("paths", []):
            path = path.strip("/")
            if path in commit.files:
                content = commit.files[path]
                out.append({"type": "file", "oid": git_blob_oid(content), "size": len(content), "path": path})
            elif any(p.startswith(path + "/") for p in commit.files):
                out.append({"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0,
                            "path": path})
        self._json(200, out)

    def _refs(self, repo_id: str, rest: list[str], query: dict) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        self._json(200, {
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": o} for n, o in sorted(repo.branches.items())],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": o} for n, o in sorted(repo.tags.items())],
            "converts": []})

    def _preupload(self, repo_id: str, rest: list[str], query: dict) -> None:
        payload = json.loads(self._body())
        found = self._repo_commit(repo_id, rest, write=True)
        if found is None:
            return
        repo, commit = found
        files = []
        for f in payload["files"]:
            existing = commit.files.get(f["path"])
            files.append({"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                          "oid": git_blob_oid(existing) if existing is not None else None})
        self._json(200, {"files": files, "commitOid": commit.oid})

    def _commit(self, repo_id: str, rest: list[str], query: dict) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        with self.state.lock:
            self.state.commit_requests += 1
            cut = self.state.cut_commits > 0
            if cut:
                self.state.cut_commits -= 1
        if cut:
            # Half the body arrives, then the network goes: nothing may change on the remote.
            self.rfile.read(length // 2)
            raise _Cut
        body = self.rfile.read(length)
        with self.state.lock:
            repo = self._repo(repo_id, write=True)
            if repo is None:
                return
            branch = rest[0] if rest else "main"
            if branch not in repo.branches:
                return self._error(404, f"Invalid rev id: {branch}", {"X-Error-Code": "RevisionNotFound"})
            head = repo.commits[repo.branches[branch]]
            files = dict(head.files)
            header = {}
            for line in body.splitlines():
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    if value.get("encoding") != "base64":
                        return self._error(400, "the test Hub takes base64 file contents only")
                    files[value["path"]] = base64.b64decode(value["content"])
                elif key == "deletedFile":
                    if value["path"] not in files:
                        return self._error(404, "A file with this name doesn't exist",
                                           {"X-Error-Code": "EntryNotFound"})
                    del files[value["path"]]
                elif key == "deletedFolder":
                    files = {p: c for p, c in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
                else:
                    return self._error(400, f"the test Hub does not support {key} operations")
            parent = header.get("parentCommit")
            if parent is not None and parent != head.oid:
                return self._error(412, "A commit has happened since. Please refresh and try again.")
            if self.state.corrupt_next_commit:
                self.state.corrupt_next_commit = False
                victim = next(p for p in sorted(files) if p.endswith(".parquet"))
                content = bytearray(files[victim])
                content[len(content) // 2] ^= 0xFF
                files[victim] = bytes(content)
            commit = repo.add_commit(head, files, header.get("summary", ""))
            repo.branches[branch] = commit.oid
            self._json(200, {"success": True, "commitOid": commit.oid,
                             "commitUrl": f"{self.server.endpoint}/datasets/{repo_id}/commit/{commit.oid}"})

    def _tag(self, repo_id: str, rest: list[str], query: dict) -> None:
        payload = json.loads(self._body() or b"{}")
        found = self._repo_commit(repo_id, rest, write=True)
        if found is None:
            return
        repo, commit = found
        if payload["tag"] in repo.tags:
            return self._error(409, f"Tag {payload['tag']} already exists")
        repo.tags[payload["tag"]] = commit.oid
        self._json(200, {"name": payload["tag"], "ref": f"refs/tags/{payload['tag']}", "targetCommit": commit.oid})

    def _branch(self, repo_id: str, rest: list[str], query: dict) -> None:
        payload = json.loads(self._body() or b"{}")
        repo = self._repo(repo_id, write=True)
        if repo is None:
            return
        name = "/".join(rest)
        if name in repo.branches:
            return self._error(409, f"Branch {name} already exists")
        start = self._revision(repo, payload.get("startingPoint") or "main")
        if start is None:
            return
        repo.branches[name] = start.oid
        self._json(200, {"name": name, "ref": f"refs/heads/{name}", "targetCommit": start.oid})

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = self._revision(repo, revision)
        if commit is None:
            return
        if path not in commit.files:
            return self._error(404, f"Entry not found: {path}", {"X-Error-Code": "EntryNotFound"})
        content = commit.files[path]
        self._send(200, content, {"X-Repo-Commit": commit.oid, "ETag": f'"{git_blob_oid(content)}"',
                                  "Accept-Ranges": "none"}, content_type="application/octet-stream", head=head)


class HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, token: str | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.state = HubState(token)
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
