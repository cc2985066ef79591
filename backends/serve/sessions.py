"""Served models, sessions, and training runs with their FIFO: a run's requests execute in seq_id order,
whatever order they arrive in (the SDK sends a forward_backward's chunks concurrently, chunk 0 last), and a
refused request still spends its seq_id, so later ones never wait for it."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from backends.base import Future
from backends.serve.replies import ApiError, Promise, Reply, deliver, error_reply
from backends.types import LoraSpec

if TYPE_CHECKING:
    from pathlib import Path

    from backends.local.backend import LocalBackend

# An op gets the run's training client and returns the engine future plus how to turn its result into a reply.
Op = Callable[[Any], tuple[Future[Any], Callable[[Any], Reply]]]


@dataclass
class ServedModel:
    """A base model under the name clients ask for (`--model NAME=PATH`)."""

    name: str
    path: str  # "tiny", a HF folder, or a cached hub id (backends/local/model.py)
    make_backend: Callable[[], LocalBackend]
    backend: LocalBackend | None = None
    tokenizer_dir: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def engine(self) -> LocalBackend:
        with self.lock:
            if self.backend is None:
                self.backend = self.make_backend()
            return self.backend


@dataclass
class Session:
    session_id: str
    last_seen: float = field(default_factory=time.monotonic)
    runs: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass
class Run:
    """A training client. `tc` may be replaced by a job in the FIFO (the legacy load_state): every later
    job waits for the new one."""

    run_id: str
    model: ServedModel
    spec: LoraSpec
    tc: Future[Any]
    session_id: str
    next_seq: int = 1
    pending: dict[int, Callable[[], None]] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)
    last: concurrent.futures.Future[Any] | None = None  # the engine future of the latest job handed over  # sampler ids of kind="inflight" clients (shared weights)
    lock: threading.RLock = field(default_factory=threading.RLock)

    def enqueue(self, seq_id: int, promise: Promise, op: Op) -> None:
        """Run op(training client) once every earlier seq_id of the run has been handed to it (its worker then
        executes them in that order)."""

        def go() -> None:
            if promise.done():  # refused already: the seq_id is spent, nothing runs
                return
            try:
                fut, to_reply = op(self.tc.result())
            except BaseException as exc:  # noqa: BLE001 - reported to the client as a failed request
                promise.resolve(error_reply(exc))
                return
            self.last = fut.future()
            deliver(promise, fut, to_reply)

        with self.lock:
            if seq_id < self.next_seq or seq_id in self.pending:
                raise ApiError(400, f"seq_id {seq_id} was already used for {self.run_id}")
            self.pending[seq_id] = go
        self.drain()

    def spend(self, seq_id: object) -> None:
        """A request with this seq_id was refused: let later requests go past it."""
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            return
        with self.lock:
            if seq_id < self.next_seq or seq_id in self.pending:
                return
            self.pending[seq_id] = lambda: None
        self.drain()

    def drain(self) -> None:
        # Under the run's lock: two threads draining at once must not hand over seq 2 before seq 1.
        with self.lock:
            while self.next_seq in self.pending:
                tc = self.tc
                if not tc.done():  # being created (or replaced by a load): come back when it is
                    tc.future().add_done_callback(lambda _: self.drain())
                    return
                job = self.pending.pop(self.next_seq)
                self.next_seq += 1
                job()
