"""A Hugging Face hub on 127.0.0.1 serving folders as model repos: what huggingface_hub's snapshot_download asks
for (the repo's revision, its file tree, each file's metadata and bytes), so tests download a hub id with the real
client and never touch the network. `with fake_hub({"org/name": folder}) as hub:` then HF_ENDPOINT=hub.url.
`hub.requests` lists the paths asked for, `hub.sent` the file bytes sent.

Misbehaviour, to test the client's bounds (backends/hub.py): `ranges` (serve `Range` requests with 206, as the hub
does; off: every GET sends the whole file from its start), `drop_after` (close the connection after that many bytes
of each file response), `stall` (a path prefix whose requests are never answered), `trickle` (send file bytes in
chunks of that size, 0.1 s apart)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
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
    ranges: bool = True
    drop_after: int | None = None
    stall: str | None = None
    trickle: int | None = None
    sent: int = 0
    closing: threading.Event = field(default_factory=threading.Event)

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
            hub.requests.append(f"{self.command} {path}" + (f" {self.headers['Range']}" if self.headers["Range"] else ""))
            if hub.stall is not None and path.startswith(hub.stall):
                hub.closing.wait()  # never answered (until the hub shuts down)
                return
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
                        headers = {"X-Repo-Commit": SHA, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
                        if head:
                            return self._send(200, body, headers, head)
                        return self._file(body, headers)
            self._send(404, b'{"error": "Repository not found"}',
                       {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"}, head)

        def _file(self, body: bytes, headers: dict[str, str]) -> None:
            start = 0
            m = re.fullmatch(r"bytes=(\d+)-", self.headers["Range"] or "")
            if hub.ranges and m and int(m[1]) < len(body):
                start = int(m[1])
                headers = {**headers, "Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"}
            self.send_response(206 if start else 200)
            for k, v in {"Content-Length": str(len(body) - start), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            part = body[start:]
            if hub.drop_after is not None:
                part = part[: hub.drop_after]
            step = hub.trickle or len(part) or 1
            for i in range(0, len(part), step):
                if hub.closing.is_set():
                    break
                self.wfile.write(part[i : i + step])
                self.wfile.flush()
                hub.sent += len(part[i : i + step])
                if hub.trickle:
                    time.sleep(0.1)
            if len(part) < len(body) - start:
                self.close_connection = True  # dropped: fewer bytes than Content-Length

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._route(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._route(head=True)

    return Handler


@contextmanager
def fake_hub(repos: dict[str, Path], **misbehave: object) -> Iterator[FakeHub]:
    hub = FakeHub(repos, **misbehave)  # pyright: ignore[reportArgumentType]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        hub.closing.set()
        server.shutdown()
        server.server_close()
