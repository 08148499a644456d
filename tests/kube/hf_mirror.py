"""A Hugging Face Hub mirror on a local port: the part of the Hub's HTTP API that huggingface_hub's
`model_info`, `list_repo_tree` and `snapshot_download` use, serving model repositories made from
local directories. It stands in for huggingface.co (or a company mirror reached through HF_ENDPOINT),
which tests cannot reach.

Served, as the Hub answers them:
- GET  /api/models/{org}/{name}/revision/{revision}   the model's info, `sha` = the revision's commit
- GET  /api/models/{org}/{name}/tree/{revision}        its files (`?recursive=true`), with sizes and oids
- HEAD /{org}/{name}/resolve/{revision}/{path}         X-Repo-Commit, ETag and Content-Length of a file
- GET  /{org}/{name}/resolve/{revision}/{path}         the file (a `Range: bytes=N-` request resumes)
An unknown repository answers 404 with `X-Error-Code: RepoNotFound`, an unknown revision 404 with
`RevisionNotFound`, an unknown file 404 with `EntryNotFound`: the codes huggingface_hub turns into its
RepositoryNotFoundError, RevisionNotFoundError and EntryNotFoundError. With `token` set, a request
without `Authorization: Bearer <token>` is refused (401), as for a private repository.

Every request is recorded in `requests` ("GET /api/models/..."), so a test can tell a download
from a start that found the files in its cache. One commit per repository: its id is the sha1 of
the files (names and contents); `revisions` names the branches and tags that resolve to it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    revisions: set[str]

    def entry(self, path: str) -> dict[str, Any]:
        data = self.files[path]
        # git's blob id, as the Hub reports a file's oid
        oid = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        return {"type": "file", "oid": oid, "size": len(data), "path": path}


@dataclass
class HubMirror:
    host: str = "127.0.0.1"
    token: str | None = None
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    def add(self, repo_id: str, directory: Path, revisions: tuple[str, ...] = ("main",)) -> str:
        """Serves the files under `directory` as `repo_id`; returns the commit id."""
        files = {str(p.relative_to(directory)): p.read_bytes()
                 for p in sorted(directory.rglob("*")) if p.is_file()}
        digest = hashlib.sha1()
        for name, data in files.items():
            digest.update(name.encode() + b"\0" + data)
        commit = digest.hexdigest()
        self.repos[repo_id] = Repo(files, commit, set(revisions))
        return commit

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self._server.server_address[1]}"

    def start(self) -> HubMirror:
        mirror = self

        class Handler(_Handler):
            hub = mirror

        self._server = ThreadingHTTPServer((self.host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hf-mirror", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HubMirror:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def downloads(self) -> list[str]:
        """The file downloads (GET .../resolve/...) asked so far."""
        return [r for r in self.requests if r.startswith("GET ") and "/resolve/" in r]


class _Handler(BaseHTTPRequestHandler):
    hub: HubMirror
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # recorded in hub.requests instead of stderr

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        self.hub.requests.append(f"{self.command} {self.path}")
        if self.hub.token and self.headers.get("Authorization") != f"Bearer {self.hub.token}":
            return self._error(401, "RepoNotFound", "Invalid credentials in Authorization header")
        path = unquote(urlsplit(self.path).path)
        if path.startswith("/api/models/"):
            return self._api(path.removeprefix("/api/models/"))
        parts = path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id = "/".join(parts[:2])
            return self._file(repo_id, parts[3], "/".join(parts[4:]), body)
        self._error(404, "", f"no route for {path}")

    def _repo(self, repo_id: str, revision: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository not found: {repo_id}")
            return None
        if revision != repo.commit and revision not in repo.revisions:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _api(self, rest: str) -> None:
        # {org}/{name}/revision/{revision} or {org}/{name}/tree/{revision}; a revision may hold '/'
        parts = rest.split("/")
        if len(parts) < 4 or parts[2] not in ("revision", "tree"):
            return self._error(404, "", f"no route for /api/models/{rest}")
        repo_id, kind, revision = "/".join(parts[:2]), parts[2], "/".join(parts[3:])
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        if kind == "tree":
            return self._json([repo.entry(p) for p in sorted(repo.files)])
        self._json({"_id": repo.commit[:24], "id": repo_id, "modelId": repo_id, "sha": repo.commit,
                    "private": False, "gated": False, "disabled": False, "tags": [],
                    "siblings": [{"rfilename": p} for p in sorted(repo.files)]})

    def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        if name not in repo.files:
            return self._error(404, "EntryNotFound", f"{name} does not exist on {revision}")
        data = repo.files[name]
        start = 0
        ranged = (self.headers.get("Range") or "").removeprefix("bytes=")
        if ranged.endswith("-") and ranged[:-1].isdigit():
            start = min(int(ranged[:-1]), len(data))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{repo.entry(name)["oid"]}"')
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        if body:
            self.wfile.write(data[start:])

    def _json(self, value: Any) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
