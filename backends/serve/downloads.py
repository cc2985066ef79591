"""Signed download URLs for external_weights checkpoints: `GET .../external_weights_urls` hands out one URL
per file, HMAC-signed with a per-process secret and valid DOWNLOAD_URL_TTL_S; `GET /api/v1/files/...` serves
a file for a valid, unexpired signature (no API key: the URL is the authorisation)."""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import hmac
import secrets
import time
import urllib.parse

from backends.serve.replies import Reply
from backends.serve.store import Store, iso

DOWNLOAD_URL_TTL_S = 3600


class Downloads:
    def __init__(self, store: Store):
        self.store = store
        self._secret = secrets.token_bytes(32)

    def urls(self, run_id: str, kind: str, name: str, base_url: str) -> Reply:
        root = self.store.checkpoint_dir(run_id, kind, name)
        expires = int(time.time()) + DOWNLOAD_URL_TTL_S
        urls = {}
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = f.relative_to(root).as_posix()
            target = f"{run_id}/{kind}/{name}/{rel}"
            sig = self._sign(target, expires)
            urls[rel] = f"{base_url}/api/v1/files/{urllib.parse.quote(target)}?expires={expires}&sig={sig}"
        return Reply.json({"urls": urls, "expires": iso(dt.datetime.fromtimestamp(expires, dt.UTC))})

    def _sign(self, target: str, expires: int) -> str:
        mac = hmac.new(self._secret, f"{target}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def serve(self, route: str, path: str) -> Reply:
        target = urllib.parse.unquote(route.removeprefix("files/"))
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        try:
            expires = int(query["expires"][0])
            sig = query["sig"][0]
        except (KeyError, ValueError):
            return Reply.error(403, "unsigned download URL")
        if expires < time.time() or not hmac.compare_digest(sig.encode(), self._sign(target, expires).encode()):
            return Reply.error(403, "download URL expired or invalid")
        parts = target.split("/", 3)
        if len(parts) != 4 or self.store.checkpoint_meta(parts[0], parts[1], parts[2]) is None:
            return Reply.error(404, "not found (deleted or expired)")
        root = self.store.checkpoint_dir(parts[0], parts[1], parts[2])
        f = (root / parts[3]).resolve()
        if not f.is_relative_to(root) or not f.is_file():
            return Reply.error(404, "not found")
        return Reply(200, b"", {"content-type": "application/octet-stream"}, file=f)
