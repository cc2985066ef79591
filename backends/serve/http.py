"""`runner serve`'s HTTP server: backends/serve/service.py behind a ThreadingHTTPServer (one thread per
connection, HTTP/1.1 keep-alive as the SDK's pooled clients expect; a long-polled retrieve_future holds only
its own connection's thread).

Logging: one INFO line per session, run, checkpoint event; requests at DEBUG. A client that hangs up mid-reply
is one DEBUG line, not a traceback. The API key is never logged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import select
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from backends.errors import UserError
from backends.serve.limits import Limits
from backends.serve.memory import default_max_bytes, fmt_bytes
from backends.serve.openai_api import OpenAIHooks
from backends.serve.replies import Reply
from backends.serve.service import Service
from backends.serve.sessions import ServedModel
from backends.serve.store import Store

log = logging.getLogger("runner.serve")
DISCONNECTS = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, TimeoutError)


def _handler_class(service: Service) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "runner-serve"
        disable_nagle_algorithm = True  # headers and body are two writes: without this, 40 ms delayed-ACK stalls

        def _body(self) -> bytes | None:
            """The request body, or None after answering a bad Content-Length (and closing: the stream's
            framing is lost)."""
            if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
                self._refuse(411, "chunked bodies are not accepted: send Content-Length")
                return None
            raw = self.headers.get_all("content-length") or []
            if not raw:
                return b""
            if len(set(raw)) != 1 or not raw[0].strip().isdigit():
                self._refuse(400, f"bad Content-Length {', '.join(raw)[:40]!r}")
                return None
            length = int(raw[0])
            if length > service.limits.max_body_bytes:
                self._refuse(413, f"request body of {length} bytes; at most {service.limits.max_body_bytes}")
                return None
            body = self.rfile.read(length) if length else b""
            if len(body) != length:  # the client hung up mid-body
                self.close_connection = True
                return None
            return body

        def _refuse(self, status: int, detail: str) -> None:
            self.close_connection = True
            self._send(Reply.error(status, detail), close=True)

        def _serve(self) -> None:
            body = self._body()
            if body is None:
                return
            headers = {k.lower(): v for k, v in self.headers.items()}
            base_url = f"http://{headers.get('host') or '127.0.0.1'}"
            reply = service.handle(self.command, self.path, headers, body, base_url, lambda: _hung_up(self.connection))
            log.debug("%s %s -> %d", self.command, self.path.split("?", 1)[0][:200], reply.status)
            if reply.status == Reply.GONE:  # the client hung up: its work was stopped, nobody reads a reply
                self.close_connection = True
                return
            self._send(reply)

        def _send(self, reply: Reply, close: bool = False) -> None:
            # No Server / Date headers: the SDK's httpx walks every header of every reply (its main CPU cost
            # per request, with ~64 sample requests per RL step).
            self.send_response_only(reply.status)
            for k, v in reply.headers.items():
                self.send_header(k, v)
            if close:
                self.send_header("connection", "close")
            if reply.stream is not None:  # chunked: each piece leaves as it is made
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                try:
                    for piece in reply.stream:
                        if piece:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.write(b"0\r\n\r\n")
                finally:
                    end = getattr(reply.stream, "close", None)
                    if end is not None:
                        end()  # a client gone mid-stream: its sampling stops (backends/serve/streaming.py)
                return
            if reply.file is not None:
                self.send_header("content-length", str(reply.file.stat().st_size))
                self.end_headers()
                with reply.file.open("rb") as f:
                    shutil.copyfileobj(f, self.wfile)
                return
            self.send_header("content-length", str(len(reply.body)))
            self.end_headers()
            self.wfile.write(reply.body)

        def handle_one_request(self) -> None:
            try:
                super().handle_one_request()
            except DISCONNECTS as exc:
                log.debug("client %s disconnected: %s", self.client_address[0], type(exc).__name__)
                self.close_connection = True

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def __getattr__(self, name: str) -> Any:
            if name.startswith("do_"):  # any other method: a JSON 405, not http.server's HTML 501
                return lambda: self._refuse(405, f"method {name[3:][:20]} is not served")
            raise AttributeError(name)

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own refusals (a bad request line, over-long headers) as JSON, like ours."""
            self.close_connection = True
            self.request_version = "HTTP/1.1"  # never HTTP/0.9's bare body: the client gets a status line
            with contextlib.suppress(*DISCONNECTS):
                self._send(Reply.error(code, message or explain or "bad request"), close=True)

        def log_message(self, format: str, *args: object) -> None:  # requests are logged at DEBUG above
            pass

    return Handler


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer closed the connection (readable with nothing to read) or reset it; a pipelined next
    request (readable, with bytes) is not a hang-up."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):
        return True


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # The listen backlog (socketserver's default is 5): while the process is busy (a checkpoint loading for a
    # sampler, the GIL held), a burst of clients fills it and the kernel drops or resets the rest (measured: 8 of 24
    # concurrent /v1 requests reset while a run dir's sampler loaded; 18 of 100 connects timed out over an 8 s stall,
    # none with 128). The kernel caps it at net.core.somaxconn.
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, DISCONNECTS):
            log.debug("client %s disconnected: %s", client_address, type(exc).__name__)
        else:
            log.exception("error while serving %s", client_address)


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    port_file: Path | None = None
    models: tuple[str, ...] = ()  # "NAME=PATH" or "PATH" (served under its own name)
    storage: Path = Path("serve-storage")
    device: str = "auto"
    dtype: str = "auto"  # backends/local/local_config.py Local.dtype
    sampler_weights: str = "auto"  # backends/local/local_config.py Local.sampler_weights
    api_key_env: str | None = None
    sampler_idle_s: float | None = None
    max_live_samplers: int | None = None
    limits: Limits = field(default_factory=Limits)  # caps (backends/serve/limits.py)
    openai: OpenAIHooks | None = None  # chat formats for /v1/chat/completions (runner/rl/openai_chat.py)


def parse_models(specs: tuple[str, ...]) -> dict[str, str]:
    """NAME=PATH pairs; a bare PATH serves under its own name; nothing given serves `tiny`."""
    out: dict[str, str] = {}
    for spec in specs or ("tiny",):
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = spec, spec
        if not name or not path:
            raise UserError(f"--model {spec!r}: expected NAME=PATH (e.g. Qwen/Qwen3-0.6B=/models/qwen3-0.6b) or a PATH")
        if name in out:
            raise UserError(f"--model {name!r} is given twice")
        out[name] = path
    return out


def serve_device(devices: list[Any]) -> Any:
    """The device whose memory --max-bytes defaults to: cuda when any served model is placed there (its memory is
    what the big models fill; the ledger cannot tell the devices apart), else the CPU (every model small, or no
    CUDA): half the machine's memory, not 90% of a GPU that holds nothing."""
    return next((d for d in devices if getattr(d, "type", None) == "cuda"), None)


def build_service(cfg: ServeConfig) -> Service:
    from backends.local import model as M
    from backends.local.backend import LocalBackend, _user_error
    from backends.local.device import place
    from backends.local.local_config import Local

    api_key = None
    if cfg.api_key_env:
        api_key = os.environ.get(cfg.api_key_env, "").strip()
        if not api_key:
            raise UserError(f"--api-key-env {cfg.api_key_env}: that environment variable is empty or unset")
    served = parse_models(cfg.models)
    model_dirs = [M.resolve_model_dir(path) for path in served.values()]  # a missing folder fails now
    local = Local(device=cfg.device, dtype=cfg.dtype, sampler_weights=cfg.sampler_weights)  # type: ignore[arg-type]
    try:
        # Where each served model's runs and samplers will live: the placement LocalBackend itself takes (with
        # --device auto, `tiny` stays on the CPU of a GPU box). --device cuda without CUDA fails here.
        devices = [place(local, d).device for d in model_dirs]
    except UserError:
        raise UserError(f"--device {cfg.device}: torch sees no CUDA device; use --device auto or cpu") from None
    limits = cfg.limits
    if limits.max_bytes is None:  # what the device holds (backends/serve/memory.py)
        limits = dataclasses.replace(limits, max_bytes=default_max_bytes(serve_device(devices)))
    store = Store(cfg.storage)

    class ServeBackend(LocalBackend):
        """Checkpoints go where the store keeps them: the service names them <run_id>/<kind>/<name>."""

        def new_checkpoint_dir(self, kind: str, name: str) -> Path:
            run_id, real_kind, ckpt = name.split("/")
            path = store.checkpoint_dir(run_id, real_kind, ckpt)
            if path.exists():
                raise _user_error(f"checkpoint tinker://{name} already exists")
            return path

    models = {}
    for name, path in served.items():
        log.info("model %s: %s", name, local.describe(path))
        models[name] = ServedModel(name, path, lambda p=path: ServeBackend(local, p, None, store.root / "runs"))
    kwargs = {}
    if cfg.sampler_idle_s is not None:
        kwargs["sampler_idle_s"] = cfg.sampler_idle_s
    if cfg.max_live_samplers is not None:
        kwargs["max_live_samplers"] = cfg.max_live_samplers
    service = Service(store, models, api_key=api_key, limits=limits, **kwargs)
    service.openai.hooks = cfg.openai
    return service


@contextlib.contextmanager
def running(service: Service, host: str = "127.0.0.1", port: int = 0) -> Iterator[Server]:
    """Serve in a background thread (tests, benchmarks); yields the bound server."""
    server = Server((host, port), _handler_class(service))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def serve_forever(cfg: ServeConfig) -> None:
    service = build_service(cfg)
    try:
        server = Server((cfg.host, cfg.port), _handler_class(service))
    except OSError as exc:
        raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}"
    if cfg.port_file is not None:  # written once the socket listens, atomically: a reader never sees half
        cfg.port_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{cfg.port_file.name}.", dir=cfg.port_file.parent)
        with os.fdopen(fd, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, cfg.port_file)
    if host not in ("127.0.0.1", "localhost", "::1") and service.api_key is None:
        log.warning("listening on %s without --api-key-env: anyone who can reach this address can use it", host)
    models = ", ".join(f"{m.name}={m.path}" if m.name != m.path else m.name for m in service.models.values())
    log.info("runner serve: %s (models: %s; storage: %s)", url, models, service.store.root)
    log.info("caps: %d live training runs (--max-models), %s held (--max-bytes)", service.memory.max_models,
             fmt_bytes(service.memory.max_bytes))
    log.info("use it: TINKER_BASE_URL=%s TINKER_API_KEY=%s python your_script.py", url,
             f"${cfg.api_key_env}" if cfg.api_key_env else "tml-local")
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        server.server_close()
        service.close()

