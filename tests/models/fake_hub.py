"""A local stand-in for the HuggingFace Hub, serving test checkpoints on 127.0.0.1.

It implements the few endpoints ``huggingface_hub.snapshot_download`` uses, with the
headers the real Hub sends, so ``hf2q convert --repo`` is tested end to end through the
real client library without any network:

* ``GET  /api/models/{repo}/revision/{rev}``   → ``{"id", "sha", "siblings": [...]}``
* ``GET  /api/models/{repo}/tree/{rev}[/path]`` → file entries (``oid``, ``size``, ``lfs``)
* ``HEAD|GET /{repo}/resolve/{rev}/{file}``    → ``X-Repo-Commit``, ``ETag``, ``Content-Length``
  (and ``Range`` support on GET)

Unknown repos and revisions answer 404 with the ``X-Error-Code`` the client maps to
``RepositoryNotFoundError`` / ``RevisionNotFoundError``. Every request is logged in
``requests`` so tests can assert that a cached run made no download.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import attrs

LFS_SUFFIXES = (".safetensors", ".bin", ".gguf")


@attrs.define
class Revision:
    commit: str
    files: dict[str, bytes]


def _git_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@attrs.define
class FakeHub:
    repos: dict[str, dict[str, Revision]] = attrs.field(factory=dict)  # repo → name/commit → Revision
    requests: list[tuple[str, str]] = attrs.field(factory=list)
    server: ThreadingHTTPServer | None = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add_repo(self, repo_id: str, folder: Path, revision: str = "main",
                 extra: dict[str, bytes] | None = None) -> str:
        """Publish ``folder``'s files as ``repo_id`` at branch/tag ``revision``; returns the commit id."""
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        files.update(extra or {})
        h = hashlib.sha1()
        for name, data in sorted(files.items()):
            h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
        commit = h.hexdigest()
        rev = Revision(commit, files)
        revs = self.repos.setdefault(repo_id, {})
        revs[revision] = rev
        revs[commit] = rev
        return commit

    def downloads(self) -> list[str]:
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]

    # -- lookups used by the handler ------------------------------------------------
    def find(self, repo_id: str, rev: str) -> tuple[str, Revision | None]:
        if repo_id not in self.repos:
            return "RepoNotFound", None
        r = self.repos[repo_id].get(rev)
        return ("RevisionNotFound", None) if r is None else ("", r)

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _json(self, code: int, obj, headers: dict | None = None):
                self._send(code, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

            def _not_found(self, code: str, head: bool = False):
                self._send(404, b"" if head else json.dumps({"error": code}).encode(),
                           {"X-Error-Code": code, "X-Error-Message": code, "Content-Type": "application/json"},
                           head=head)

            def _split_repo(self, parts: list[str]) -> tuple[str, list[str]] | None:
                # repo ids are ORG/NAME (two segments) or NAME; try the longer form first
                for n in (2, 1):
                    if len(parts) > n and "/".join(parts[:n]) in hub.repos:
                        return "/".join(parts[:n]), parts[n:]
                return ("/".join(parts[:2]), parts[2:]) if len(parts) > 2 else None

            def do_HEAD(self):
                self._handle(head=True)

            def do_GET(self):
                self._handle(head=False)

            def _handle(self, head: bool):
                url = urlparse(self.path)
                hub.requests.append(("HEAD" if head else "GET", url.path))
                parts = [unquote(p) for p in url.path.strip("/").split("/")]
                if parts[:2] == ["api", "models"]:
                    return self._api(parts[2:], head)
                split = self._split_repo(parts)
                if split is None or len(split[1]) < 3 or split[1][0] != "resolve":
                    return self._send(404, b"not found")
                repo_id, rest = split
                code, rev = hub.find(repo_id, rest[1])
                if rev is None:
                    return self._not_found(code, head)
                name = "/".join(rest[2:])
                if name not in rev.files:
                    return self._not_found("EntryNotFound", head)
                data = rev.files[name]
                etag = hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else _git_oid(data)
                headers = {"X-Repo-Commit": rev.commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes=") and not head:
                    start_s, _, end_s = rng[6:].partition("-")
                    start = int(start_s or 0)
                    end = int(end_s) if end_s else len(data) - 1
                    headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
                    return self._send(206, data[start:end + 1], headers)
                if head:
                    self.send_response(200)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return None
                return self._send(200, data, headers)

            def _api(self, parts: list[str], head: bool):
                for kind in ("revision", "tree"):
                    if kind in parts:
                        i = parts.index(kind)
                        repo_id, rest = "/".join(parts[:i]), parts[i + 1:]
                        break
                else:
                    repo_id, rest, kind = "/".join(parts), [], "info"
                rev_name = rest[0] if rest else "main"
                code, rev = hub.find(repo_id, rev_name)
                if rev is None:
                    return self._not_found(code, head)
                if kind in ("revision", "info"):
                    return self._json(200, {"id": repo_id, "modelId": repo_id, "sha": rev.commit, "private": False,
                                            "siblings": [{"rfilename": n} for n in sorted(rev.files)]})
                prefix = "/".join(rest[1:])
                entries = []
                for n, data in sorted(rev.files.items()):
                    if prefix and not n.startswith(prefix + "/"):
                        continue
                    e = {"type": "file", "path": n, "size": len(data), "oid": _git_oid(data)}
                    if n.endswith(LFS_SUFFIXES):
                        e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                    entries.append(e)
                return self._json(200, entries)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-hub", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
