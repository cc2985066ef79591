"""What `runner serve` accepts: size caps, typed request fields, and the sampling budget.

A request that breaks a rule is an ApiError (a 4xx with a one-line reason), never a server error: the SDK
retries 408/409/429/5xx for minutes, and raises at once on other 4xx.
"""

from __future__ import annotations

import builtins
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, overload

from backends.serve.memory import Memory, fmt_bytes
from backends.serve.replies import ApiError

if TYPE_CHECKING:
    from backends.types import Json


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 64 << 20  # one request's body (a forward_backward's protobuf is the big one)
    max_json_depth: int = 32  # nesting of a JSON body
    max_metadata_bytes: int = 16 << 10  # user_metadata, as JSON (stored and returned by every listing)
    max_id_chars: int = 128  # session, model, sampler, request ids and checkpoint names
    max_num_samples: int = 4096
    # num_samples x (prompt + max_tokens): one request's tokens, and all in-flight requests' together (the
    # sampler's memory grows with them). A request over the first is refused; one over the second waits.
    max_request_tokens: int = 1 << 20
    max_live_tokens: int = 4 << 20
    # Prompts in one /v1/completions request (its `prompt` list), checked before any is tokenized.
    max_prompts: int = 2048
    # What live sessions hold (backends/serve/memory.py): training runs at once, and bytes of base models,
    # runs' adapters + gradients + optimizer moments, and in-flight sampling (None: half the machine's memory).
    max_models: int = 32
    max_bytes: int | None = None
    # A sampling request that does not fit while nothing else samples (live runs hold the bytes) fails after
    # waiting this long.
    max_sample_wait_s: float = 30.0


_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")
D = TypeVar("D")  # a field's default: what a Fields getter returns when the field is absent or null


class _Missing:
    """No default: the field is required."""


_MISSING = _Missing()


class Fields:
    """Typed access to a JSON request's fields: a wrong type or value is a 400 naming the field. A getter without a
    default says the field is required; with one, an absent or null field is that default (its type joins the
    getter's)."""

    def __init__(self, req: Mapping[builtins.str, object], limits: Limits):
        self.req = req
        self.limits = limits

    def _default(self, key: builtins.str, default: D | _Missing) -> D:
        if isinstance(default, _Missing):
            raise ApiError(400, f"{key} is required")
        return default

    @overload
    def str(self, key: builtins.str, *, max_chars: builtins.int | None = None) -> builtins.str: ...
    @overload
    def str(self, key: builtins.str, default: D, max_chars: builtins.int | None = None) -> builtins.str | D: ...
    def str(self, key: builtins.str, default: D | _Missing = _MISSING, max_chars: builtins.int | None = None
            ) -> builtins.str | D:
        v = self.req.get(key)
        if v is None:
            return self._default(key, default)
        if not isinstance(v, builtins.str):
            raise ApiError(400, f"{key} must be a string, not {type(v).__name__}")
        limit = max_chars or self.limits.max_id_chars * 8
        if len(v) > limit:
            raise ApiError(413, f"{key} is {len(v)} characters; at most {limit}")
        return v

    @overload
    def id(self, key: builtins.str) -> builtins.str: ...
    @overload
    def id(self, key: builtins.str, default: D) -> builtins.str | D: ...
    def id(self, key: builtins.str, default: D | _Missing = _MISSING) -> builtins.str | D:
        """A session, model or sampler id: letters, digits, '_', '.', ':', '-', at most max_id_chars."""
        if self.req.get(key) is None:
            return self._default(key, default)
        v = self.str(key, max_chars=self.limits.max_id_chars)
        check_id(key, v, self.limits)
        return v

    @overload
    def int(self, key: builtins.str, *, lo: builtins.int | None = None, hi: builtins.int | None = None
            ) -> builtins.int: ...
    @overload
    def int(self, key: builtins.str, default: D, lo: builtins.int | None = None, hi: builtins.int | None = None
            ) -> builtins.int | D: ...
    def int(self, key: builtins.str, default: D | _Missing = _MISSING, lo: builtins.int | None = None,
            hi: builtins.int | None = None) -> builtins.int | D:
        v = self.req.get(key)
        if v is None:
            return self._default(key, default)
        return to_int(key, v, lo, hi)

    @overload
    def float(self, key: builtins.str, *, lo: builtins.float | None = None, hi: builtins.float | None = None
              ) -> builtins.float: ...
    @overload
    def float(self, key: builtins.str, default: D, lo: builtins.float | None = None, hi: builtins.float | None = None
              ) -> builtins.float | D: ...
    def float(self, key: builtins.str, default: D | _Missing = _MISSING, lo: builtins.float | None = None,
              hi: builtins.float | None = None) -> builtins.float | D:
        v = self.req.get(key)
        if v is None:
            return self._default(key, default)
        return to_float(key, v, lo, hi)

    def bool(self, key: builtins.str, default: builtins.bool = False) -> builtins.bool:
        v = self.req.get(key)
        if v is None:
            return default
        if not isinstance(v, builtins.bool):
            raise ApiError(400, f"{key} must be true or false, not {type(v).__name__}")
        return v

    @overload
    def dict(self, key: builtins.str) -> builtins.dict[builtins.str, object]: ...
    @overload
    def dict(self, key: builtins.str, default: D) -> builtins.dict[builtins.str, object] | D: ...
    def dict(self, key: builtins.str, default: D | _Missing = _MISSING) -> builtins.dict[builtins.str, object] | D:
        v = self.req.get(key)
        if v is None:
            return self._default(key, default)
        if not isinstance(v, builtins.dict):
            raise ApiError(400, f"{key} must be an object, not {type(v).__name__}")
        return v

    def sub(self, key: builtins.str) -> Fields:
        return Fields(self.dict(key, {}), self.limits)

    def metadata(self, key: builtins.str = "user_metadata") -> Json | None:
        v = self.dict(key, None)
        if v is not None and len(json.dumps(v)) > self.limits.max_metadata_bytes:
            raise ApiError(413, f"{key} is over {self.limits.max_metadata_bytes} bytes as JSON")
        return v or None


def check_id(what: str, v: str, limits: Limits) -> None:
    if len(v) > limits.max_id_chars:
        raise ApiError(413, f"{what} is {len(v)} characters; at most {limits.max_id_chars}")
    if not _ID.fullmatch(v):
        raise ApiError(400, f"{what} {v[:40]!r} has characters other than letters, digits, '_', '.', ':', '-'")


def to_int(key: str, v: object, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer, not {type(v).__name__} {str(v)[:40]!r}", param=key)
    if lo is not None and v < lo:
        raise ApiError(400, f"{key} must be >= {lo}, not {v}", param=key)
    if hi is not None and v > hi:
        raise ApiError(413 if hi >= 1 else 400, f"{key} must be <= {hi}, not {v}", param=key)
    return v


def to_float(key: str, v: object, lo: float | None = None, hi: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{key} must be a number, not {type(v).__name__} {str(v)[:40]!r}", param=key)
    f = float(v)
    if f != f or f in (float("inf"), float("-inf")):
        raise ApiError(400, f"{key} must be finite, not {f}", param=key)
    if (lo is not None and f < lo) or (hi is not None and f > hi):
        raise ApiError(400, f"{key} must be in [{lo}, {hi}], not {f}", param=key)
    return f


def json_depth_ok(body: bytes, limit: int) -> bool:
    """Whether no JSON container in `body` nests deeper than `limit` (strings skipped): checked before parsing,
    as json.loads would recurse to the interpreter's limit."""
    if body.count(b"[") + body.count(b"{") <= limit:  # the usual case: too few containers to nest that deep
        return True
    depth = 0
    in_str = esc = False
    for b in body:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


class Budget:
    """Sampling work in flight: tokens (Limits.max_live_tokens) and, with a `memory` ledger, bytes (its
    max_bytes, shared with the live training runs). A request runs when it fits (a lone request always fits the
    tokens), else waits in arrival order for finished requests to return theirs. A request that does not fit
    while nothing is in flight waits on memory that only ending sessions free: after `max_wait_s` of that it
    fails (`fail(reason)`), and the ones behind it get their turn."""

    def __init__(self, limit: int, memory: Memory | None = None, max_wait_s: float = 30.0):
        self.limit = limit
        self.memory = memory
        self.max_wait_s = max_wait_s
        self.used = 0
        self._lock = threading.Lock()
        self._waiting: list[_Waiter] = []
        self._stalled: float | None = None  # since when the head waits with nothing in flight

    def acquire(self, n: int, start: Callable[[], None], nbytes: int = 0,
                fail: Callable[[str], None] | None = None) -> None:
        with self._lock:
            self._waiting.append(_Waiter(n, nbytes, start, fail))
            ready = self._admit()
        for w in ready:
            w.start()

    def withdraw(self, start: Callable[[], None]) -> bool:
        """Take back a request still waiting (its client hung up): True when it was waiting and now is not; False
        when it has started (it then holds its share until it releases it)."""
        with self._lock:
            w = next((w for w in self._waiting if w.start is start), None)
            if w is None:
                return False
            self._waiting.remove(w)
            ready = self._admit()
        for r in ready:
            r.start()
        return True

    def release(self, n: int, nbytes: int = 0) -> None:
        with self._lock:
            self.used -= n
            if self.memory is not None and nbytes:
                self.memory.give_sampling(nbytes)
            ready = self._admit()
        for w in ready:
            w.start()

    def pump(self) -> None:
        """Memory was freed elsewhere (a session ended): start what fits now."""
        self.release(0)

    def expire(self, now: float | None = None) -> None:
        """Fail the head of the queue once it has waited max_wait_s with nothing in flight (the reaper calls this)."""
        t = time.monotonic() if now is None else now
        failed: list[tuple[_Waiter, str]] = []
        with self._lock:
            while self._waiting and self._stalled is not None and t - self._stalled >= self.max_wait_s:
                w = self._waiting.pop(0)
                failed.append((w, self._why(w)))
                self._stalled = None
                ready = self._admit()
                if ready:
                    break
            else:
                ready = []
        for w, why in failed:
            if w.fail is not None:
                w.fail(why)
        for w in ready:
            w.start()

    def _why(self, w: _Waiter) -> str:
        m = self.memory
        assert m is not None or w.nbytes == 0
        held = m.used if m is not None else 0
        cap = m.max_bytes if m is not None else 0
        return (f"this sample request needs {fmt_bytes(w.nbytes)} and live training runs and base models hold "
                f"{fmt_bytes(held)} of runner serve's --max-bytes {fmt_bytes(cap)}; waited {self.max_wait_s:g} s for "
                f"them to end: end other sessions, ask for fewer samples or tokens, or restart runner serve with a "
                f"higher --max-bytes")

    def _admit(self) -> list[_Waiter]:
        """Under the lock: take the waiting requests that fit now, in order."""
        ready = []
        while self._waiting:
            w = self._waiting[0]
            if self.used and self.used + w.n > self.limit:
                break
            if self.memory is not None and w.nbytes and not self.memory.take_sampling(w.nbytes):
                break
            self._waiting.pop(0)
            self.used += w.n
            ready.append(w)
        if self._waiting and not self.used and not ready:
            self._stalled = self._stalled or time.monotonic()
        else:
            self._stalled = None
        return ready

    def waiting(self) -> int:
        return len(self._waiting)


@dataclass
class _Waiter:
    n: int
    nbytes: int
    start: Callable[[], None]
    fail: Callable[[str], None] | None
