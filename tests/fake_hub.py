"""A Hugging Face hub on 127.0.0.1 serving folders as model repos: what huggingface_hub's snapshot_download asks
for (the repo's revision, its file tree, each file's metadata and bytes), so tests download a hub id with the real
client and never touch the network. `with fake_hub({"org/name": folder}) as hub:` then HF_ENDPOINT=hub.url.
`hub.requests` lists the paths asked for."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

SHA = "0123456789abcdef0123456789abcdef01234567"  # the one commit of every repo


@dataclass
class FakeHub:
    repos: dict[str, Path]
    url: str = ""
    requests: list[str] = field(default_factory=list)

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, value: object) -> None:
            self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

        def _route(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append(f"{self.command} {path}")
            for repo in hub.repos:
                files = hub.files(repo)
                if path in (f"/api/models/{repo}", f"/api/models/{repo}/revision/main",
                            f"/api/models/{repo}/revision/{SHA}"):
                    return self._json({"id": repo, "modelId": repo, "sha": SHA, "private": False,
                                       "siblings": [{"rfilename": f} for f in files]})
                if path.startswith(f"/api/models/{repo}/tree/"):
                    return self._json([{"type": "file", "path": f, "size": p.stat().st_size,
                                        "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for f, p in files.items()])
                for rev in ("main", SHA):
                    prefix = f"/{repo}/resolve/{rev}/"
                    if path.startswith(prefix) and path[len(prefix):] in files:
                        body = files[path[len(prefix):]].read_bytes()
                        etag = hashlib.sha256(body).hexdigest()
                        return self._send(200, body, {"X-Repo-Commit": SHA, "ETag": f'"{etag}"',
                                                      "Content-Type": "application/octet-stream"}, head)
            self._send(404, b'{"error": "Repository not found"}',
                       {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"}, head)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._route(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._route(head=True)

    return Handler


@contextmanager
def fake_hub(repos: dict[str, Path]) -> Iterator[FakeHub]:
    hub = FakeHub(repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
