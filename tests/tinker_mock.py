"""Faults for offline tests of the real `tinker` SDK, injected in front of the one Tinker emulator we have:
backends/serve, the app `runner serve` runs, over the local backend on the embedded tiny model.

`shared_service(dir)` builds that service (the models `tiny` and `Qwen/Qwen3-8B`, both the tiny model); `serve(service)`
puts it behind the real HTTP server of backends/serve/aio.py on a free port of 127.0.0.1, with a `MockTinker` as
the HTTP layer in between. The SDK talks to it over real sockets with its own (pyqwest) transport. `MockTinker`

- records every request (route, seq_id, loss_fn, body, ...) and what it answered, for tests to assert on;
- injects the faults in `mock.faults`, each consumed by the requests it hits: HTTP statuses the SDK rides out
  (5xx, 429 with retry-after) or fails on (4xx), a failed future (`{"error", "category"}`), a dropped connection;
- answers `try_again` on the first poll of every other future, and can hold every result back until a number of
  training submits have arrived (`hold_until_submits`: proves pipelining);
- passes everything else to the service unchanged: the numbers, the seq_id order, checkpoints, samples are all
  the service's own.

`respx_mounted(mock)` serves the same app without sockets: respx routes every httpx request of the process for its
base URL to `mock.handle`, and its client/config turns the SDK's pyqwest transport off, so the SDK's other (httpx)
transport runs, as it does for a service whose client/config says so.

An injected failed future never reaches the engine: the wrapper sends the service a request it refuses, which
spends the seq_id as any refused request does (backends/serve/sessions.py), so later requests do not wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import respx

from backends.serve.http import ServeConfig, build_service, running
from backends.serve.replies import Reply
from backends.serve.service import Service
from backends.serve.wire import decode_forward_backward

MODELS = ("tiny", "Qwen/Qwen3-8B=tiny")  # a service model name, served by the tiny model
# How long a held retrieve_future is kept open before it says try_again (the SDK polls again at once).
LONG_POLL_S = 0.1
# Routes that answer with a promise (a request_id to poll).
SUBMITS = frozenset({"create_model", "load_weights", "forward_backward", "optim_step", "save_weights",
                     "save_weights_for_sampler", "asample"})
UNKEYED = frozenset({"client/config", "client/dynamic_config", "telemetry"})  # the SDK sends these without a key


@dataclass
class Record:
    route: str  # the path after /api/v1/, e.g. "forward_backward", "retrieve_future"; "finish", "samplers"
    t: float  # time.monotonic() at arrival
    status: int = 200  # what the client got (0: connection dropped)
    seq_id: int | None = None
    model_id: str | None = None
    loss_fn: str | None = None
    n_datums: int | None = None
    forward_only: bool | None = None
    request_id: str | None = None
    body: Any = None  # the decoded JSON body


@dataclass
class Faults:
    """Switches, each consumed by the requests it hits. Route names as in Record.route."""

    # route -> HTTP statuses to answer its next requests with, one each (e.g. {"optim_step": [503]}).
    status: dict[str, list[int]] = field(default_factory=dict)
    # route -> (category, message): the next future of that route fails ("user" | "server" | "unknown").
    # forward_backward requests with forward_only count as route "forward" here.
    fail_future: dict[str, tuple[str, str]] = field(default_factory=dict)
    # route -> (n, category, message): let n more futures of that route through, then fail one.
    fail_after: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    # routes whose requests fail with a dropped connection; "*" drops everything. Not consumed.
    drop: set[str] = field(default_factory=set)
    # extra headers on injected statuses; a small retry-after-ms keeps the SDK's inner retries fast.
    retry_headers: dict[str, str] = field(default_factory=lambda: {"retry-after-ms": "20"})


class Dropped(ConnectionAbortedError):
    """The connection is dropped: backends/serve/aio.py's handler takes it for a client that went away and closes
    the socket without an answer, so the client sees a connection error."""


@dataclass
class _Slot:
    """A promise this wrapper has seen handed out."""

    route: str
    n: int  # the order it was handed out in (every try_again_every-th one says try_again first)
    seq_id: int | None = None
    injected: Reply | None = None  # a failure injected in place of the service's result
    polls: int = 0


class MockTinker:
    """The HTTP app in front of `service` (what backends/serve/aio.py calls): records, faults, and the service."""

    def __init__(self, service: Service, try_again_every: int = 2):
        self.service = service
        self.try_again_every = try_again_every
        self.faults = Faults()
        self.records: list[Record] = []
        self.api_keys: set[str] = set()
        self.finished: list[dict[str, Any]] = []  # bodies of sessions/{id}/finish
        # Results stay unready until this many training submits have arrived (proves pipelining).
        self.hold_until_submits = 0
        self.url = ""  # set by serve()
        self._lock = threading.RLock()
        self._n = itertools.count(1)
        self._slots: dict[str, _Slot] = {}

    @property
    def limits(self) -> Any:
        return self.service.limits

    # ------------------------------------------------------------ for tests

    def submits(self, *routes: str) -> list[Record]:
        """Recorded requests on these routes that were accepted (status 200), in arrival order."""
        with self._lock:
            return [r for r in self.records if r.route in routes and r.status == 200]

    def training_client(self, model_id: str) -> Any:
        """The engine's training client behind a model id (a live session's): its torch model, say."""
        return self.service._runs[model_id].tc.result()

    # ------------------------------------------------------------ the HTTP app

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, base_url: str = "",
               gone: object = None) -> Reply:  # gone: the server's hang-up check (the mock answers at once)
        route = path.split("?", 1)[0].removeprefix("/api/v1/").strip("/")
        if route.startswith("sessions/") and route.endswith("/finish"):
            route = "finish"
        elif route.startswith("samplers/"):
            route = "samplers"
        rec = Record(route=route, t=time.monotonic())
        with self._lock:
            self.records.append(rec)
            if route in self.faults.drop or "*" in self.faults.drop:
                rec.status = 0
                raise Dropped(route)
            statuses = self.faults.status.get(route)
            if statuses:
                rec.status = statuses.pop(0)
                reply = Reply.error(rec.status, f"injected HTTP {rec.status}")
                reply.headers.update(self.faults.retry_headers)
                return reply
        if route not in UNKEYED:
            self.api_keys.add(headers.get("x-api-key", ""))
        self._describe(rec, headers, body)
        if route == "retrieve_future":
            reply = self._retrieve(rec, method, path, headers, body, base_url)
        else:
            reply = self._inject_failure(rec, headers, body, base_url)
            if reply is None:
                reply = self.service.handle(method, path, headers, body, base_url)
            if route == "finish":
                self.finished.append(rec.body)
            rid = json.loads(reply.body).get("request_id") if route in SUBMITS and reply.status == 200 else None
            if isinstance(rid, str):
                rec.request_id = rid
                with self._lock:
                    self._slots.setdefault(rid, _Slot(route, next(self._n), rec.seq_id))
        rec.status = reply.status
        return reply

    def _describe(self, rec: Record, headers: dict[str, str], body: bytes) -> None:
        if rec.route == "forward_backward":
            with contextlib.suppress(Exception):  # a malformed body: the service says what is wrong with it
                msg = decode_forward_backward(body, headers.get("content-encoding"))
                rec.model_id, rec.seq_id, rec.loss_fn = msg.model_id, msg.seq_id, msg.loss_fn
                rec.n_datums, rec.forward_only = len(msg.data), msg.forward_only
            return
        with contextlib.suppress(ValueError):
            rec.body = json.loads(body) if body else {}
        if isinstance(rec.body, dict):
            rec.model_id, rec.seq_id = rec.body.get("model_id"), rec.body.get("seq_id")

    # ------------------------------------------------------------ injected failed futures

    def _failure_for(self, route: str) -> tuple[str, str] | None:
        with self._lock:
            failure = self.faults.fail_future.pop(route, None)
            if route in self.faults.fail_after:
                n, category, message = self.faults.fail_after[route]
                if n == 0:
                    failure = (category, message)
                    del self.faults.fail_after[route]
                else:
                    self.faults.fail_after[route] = (n - 1, category, message)
        return failure

    def _inject_failure(self, rec: Record, headers: dict[str, str], body: bytes, base_url: str) -> Reply | None:
        """A promise whose future fails, in place of the service's, for a submit a fault names; None otherwise."""
        if rec.route not in SUBMITS:
            return None
        failure = self._failure_for("forward" if rec.forward_only else rec.route)
        if failure is None:
            return None
        if rec.seq_id is not None:  # the service refuses a request it cannot run, and spends its seq_id
            if rec.route == "forward_backward":
                msg = decode_forward_backward(body, headers.get("content-encoding"))
                msg.loss_fn = "injected failure"
                spoiled, spoiled_headers = msg.SerializeToString(), {"content-type": "application/x-protobuf"}
            else:
                spoiled = json.dumps({"model_id": rec.model_id, "seq_id": rec.seq_id}).encode()
                spoiled_headers = {"content-type": "application/json"}
            self.service.handle("POST", f"/api/v1/{rec.route}", spoiled_headers, spoiled, base_url)
        rid = f"injected-{next(self._n)}"
        with self._lock:
            self._slots[rid] = _Slot(rec.route, next(self._n), rec.seq_id,
                                     Reply.json({"error": failure[1], "category": failure[0]}))
        return Reply.json({"request_id": rid})

    # ------------------------------------------------------------ polls

    def _held(self) -> bool:
        return len(self.submits("forward_backward", "optim_step")) < self.hold_until_submits

    def _retrieve(self, rec: Record, method: str, path: str, headers: dict[str, str], body: bytes,
                  base_url: str) -> Reply:
        rid = rec.body.get("request_id") if isinstance(rec.body, dict) else None
        with self._lock:
            slot = self._slots.get(rid) if isinstance(rid, str) else None
            if slot is not None:
                slot.polls += 1
                rec.request_id, rec.seq_id = rid, slot.seq_id
        if slot is None:  # not one of ours: the service says what it is
            return self.service.handle(method, path, headers, body, base_url)
        deadline = time.monotonic() + LONG_POLL_S
        while self._held() and time.monotonic() < deadline:
            time.sleep(0.005)
        first_try_again = slot.polls == 1 and self.try_again_every and slot.n % self.try_again_every == 0
        if first_try_again or self._held():
            return Reply.json({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if slot.injected is not None:
            return slot.injected
        return self.service.handle(method, path, headers, body, base_url)


# ---------------------------------------------------------------- the service and its server


@contextlib.contextmanager
def shared_service(storage: Path) -> Iterator[Service]:
    """backends/serve's service as `runner serve --model tiny --model Qwen/Qwen3-8B=tiny --device cpu` builds it.
    One per test session: each test's clients get their own sessions, runs and checkpoints on it."""
    service = build_service(ServeConfig(models=MODELS, storage=storage, device="cpu"))
    try:
        yield service
    finally:
        service.close()


@contextlib.contextmanager
def serve(service: Service, try_again_every: int = 2) -> Iterator[MockTinker]:
    """A fresh MockTinker over `service`, served by backends/serve/aio.py's server on a free
    port of 127.0.0.1 (its base URL: mock.url). A port per test: a previous test's clients never reach this one."""
    mock = MockTinker(service, try_again_every)
    with running(mock) as srv:
        mock.url = srv.url
        yield mock


RESPX_URL = "http://tinker.respx"


@contextlib.contextmanager
def respx_mounted(service: Service, base_url: str = RESPX_URL, try_again_every: int = 2
                  ) -> Iterator[tuple[MockTinker, respx.MockRouter]]:
    """A fresh MockTinker over `service`, mounted under respx at base_url (no socket, no server thread). Handlers
    that block (a long-polled retrieve_future) run in a worker thread, off the SDK's event loop."""
    mock = MockTinker(service, try_again_every)
    mock.url = base_url

    async def side_effect(request: httpx.Request) -> httpx.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        path = request.url.raw_path.decode()
        try:
            reply = await asyncio.to_thread(mock.handle, request.method, path, headers, request.content, base_url)
        except Dropped as exc:
            raise httpx.ConnectError(f"connection dropped ({exc})", request=request) from None
        body = reply.body
        if path.split("?")[0].endswith("/client/config") and reply.status == 200:
            body = json.dumps({**json.loads(body), "use_pyqwest_transport": False}).encode()
        return httpx.Response(reply.status, content=body, headers=reply.headers)

    with respx.mock(base_url=base_url, assert_all_called=False, using="httpx") as router:
        router.route().mock(side_effect=side_effect)
        yield mock, router
