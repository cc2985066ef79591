"""What a request gets back: HTTP error replies (ApiError), immediate replies (Reply), and promises, the
futures `retrieve_future` long-polls (a failed one carries the error's category: "user" or "server")."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from backends.base import BackendError, Future
from backends.errors import UserError

if TYPE_CHECKING:
    from backends.types import Json

log = logging.getLogger("runner.serve")

NOT_LOADED = "training_run_not_loaded"  # the code of a reply about a run this server does not hold (docs/serve.md)
PROMISE_KEEP_S = 900.0  # a result stays retrievable this long after it is ready
R = TypeVar("R")


class ApiError(Exception):
    """An HTTP error reply: {"detail": ...} with this status. Never 408/409/429/5xx for the client's mistakes:
    the SDK retries those for up to 5 minutes."""

    def __init__(self, status: int, detail: str, code: str | None = None, param: str | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.code = code  # machine-readable, for clients that act on it (e.g. "training_run_not_loaded")
        self.param = param  # the request field at fault (OpenAI's error `param`)

    def reply(self) -> Reply:
        return Reply.json({"detail": self.detail, **({"code": self.code} if self.code else {})}, self.status)


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    file: Path | None = None  # stream this file as the body (downloads)
    stream: Iterator[bytes] | None = None  # send these pieces as they come, chunked (/v1 streaming); closed after

    @classmethod
    def json(cls, obj: object, status: int = 200) -> Reply:
        return cls(status, json_bytes(obj), {"content-type": "application/json"})

    GONE = 499  # the client hung up: nothing is sent (nginx's code for it)

    @classmethod
    def error(cls, status: int, detail: str) -> Reply:
        return cls.json({"detail": detail}, status)


def _finite(obj: object) -> object:
    """obj with each non-finite float as the string "NaN", "Infinity" or "-Infinity", which the SDKs' pydantic
    models read back as that float."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else "NaN" if math.isnan(obj) else "Infinity" if obj > 0 else "-Infinity"
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def json_bytes(obj: object) -> bytes:
    """obj as strict JSON. json.dumps writes a NaN or infinite float as the bare word NaN / Infinity, which is not
    JSON: the tinker SDK (orjson) then fails on the reply (an optim_step whose grad_norm is NaN after a diverged
    step, say). Such floats are sent as strings instead."""
    try:
        return json.dumps(obj, allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(obj), allow_nan=False).encode()


def failed(message: str, category: str = "user") -> Reply:
    return Reply.json({"error": message, "category": category})


def error_reply(exc: BaseException) -> Reply:
    """An engine failure as a failed future: the user's fault when the backend says so."""
    if isinstance(exc, BackendError):
        return failed(exc.detail, "user" if exc.user_error else "server")
    if isinstance(exc, ApiError):
        return failed(exc.detail, "user")
    if isinstance(exc, (UserError, ValueError, KeyError)):
        return failed(str(exc), "user")
    log.warning("request failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
    return failed(f"{type(exc).__name__}: {exc}", "server")


class Promise:
    def __init__(self, route: str):
        self.route = route
        self.future: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        self.done_at: float | None = None
        self.future.add_done_callback(self._stamp)

    def _stamp(self, _: object) -> None:
        self.done_at = time.monotonic()

    def resolve(self, reply: Reply) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.future.set_result(reply)

    def done(self) -> bool:
        return self.future.done()


def deliver(promise: Promise, fut: Future[R], to_reply: Callable[[R], Reply]) -> None:
    """Resolve `promise` from an engine future: to_reply(result), or the error as a failed request."""

    def done(_: object) -> None:  # the future is done: its result() returns (or raises) at once
        try:
            reply = to_reply(fut.result())
        except BaseException as exc:  # noqa: BLE001 - reported to the client as a failed request
            reply = error_reply(exc)
        promise.resolve(reply)

    fut.future().add_done_callback(done)


class Promises:
    """Every promise handed out, by request id, until PROMISE_KEEP_S after it resolved."""

    def __init__(self, long_poll_s: float):
        self.long_poll_s = long_poll_s
        # In every request id: a request of an earlier server process (a restart) is told apart from an expired one.
        self.boot = secrets.token_hex(4)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_id: dict[str, Promise] = {}

    def new(self, route: str, extra: Json | None = None) -> tuple[Promise, Reply]:
        rid = f"req-{self.boot}-{next(self._ids)}-{secrets.token_hex(3)}"
        p = Promise(route)
        with self._lock:
            self._by_id[rid] = p
        return p, Reply.json({"request_id": rid, **(extra or {})})

    def next_id(self) -> int:
        return next(self._ids)

    def find(self, rid: str) -> Promise | None:
        with self._lock:
            return self._by_id.get(rid)

    @staticmethod
    def try_again(rid: str) -> Reply:
        return Reply.json({"type": "try_again", "request_id": rid, "queue_state": "active"})

    def retrieve(self, rid: str) -> Reply:
        """The result, waiting for it up to long_poll_s (then try_again, which the SDK polls again at once)."""
        p = self.find(rid)
        if p is None:
            if re.fullmatch(r"req-[0-9a-f]{8}-[0-9]+-[0-9a-f]{6}", rid) and not rid.startswith(f"req-{self.boot}-"):
                # Made before a restart: resubmitting it would only hit a run or sampler this process never
                # held, so the client is told what happened (backends/tinker/backend.py reloads on this code).
                return failed(f"request {rid} was made before runner serve restarted ({NOT_LOADED}): the training "
                              "run or sampler it was for is not loaded; load the run's last checkpoint "
                              "(create_training_client_from_state_with_optimizer) and carry on from there")
            raise ApiError(410, f"request {rid} is unknown or expired")  # the SDK resubmits on 410
        try:
            return p.future.result(timeout=self.long_poll_s)
        except concurrent.futures.TimeoutError:
            return self.try_again(rid)
        except concurrent.futures.CancelledError:
            return failed("cancelled", "user")

    def cancel(self, rids: list[str]) -> None:
        for rid in rids:
            with self._lock:
                p = self._by_id.get(rid)
            if p is not None and p.route == "asample":  # training requests hold seq ids: never cancelled
                p.resolve(failed("cancelled by the client", "user"))

    def forget_old(self, t: float) -> None:
        with self._lock:
            for rid in [r for r, p in self._by_id.items() if p.done_at is not None and t - p.done_at > PROMISE_KEEP_S]:
                del self._by_id[rid]

    def __len__(self) -> int:
        return len(self._by_id)
