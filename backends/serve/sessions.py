"""Served models, sessions, and training runs with their FIFO: a run's requests execute in seq_id order,
whatever order they arrive in (the SDK sends a forward_backward's chunks concurrently, chunk 0 last), and a
refused request still spends its seq_id, so later ones never wait for it."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from backends.base import Future, SamplingClient, TrainingClient
from backends.serve.replies import ApiError, Promise, Reply, deliver, error_reply
from backends.types import LoraSpec

if TYPE_CHECKING:
    from pathlib import Path

    from backends.local.backend import LocalBackend, LocalSamplingClient, LocalTrainingClient

R = TypeVar("R")  # what an op's engine future yields
# An op gets the run's training client and returns the engine future plus how to turn its result into a reply.
Op = Callable[["LocalTrainingClient"], tuple[Future[R], Callable[[R], Reply]]]


def local_trainer(tc: TrainingClient) -> LocalTrainingClient:
    """The training client a served model's LocalBackend made, as the class it is (runner serve also reads its
    `setup`, `step` and `trained_weights`, which the TrainingClient protocol does not offer)."""
    from backends.local.backend import LocalTrainingClient

    if not isinstance(tc, LocalTrainingClient):
        raise TypeError(f"runner serve trains with LocalBackend's clients, not {type(tc).__name__}")
    return tc


def local_sampler(sc: SamplingClient) -> LocalSamplingClient:
    """The sampling client a served model's LocalBackend made, as the class it is (the top-k pass reads its `model`)."""
    from backends.local.backend import LocalSamplingClient

    if not isinstance(sc, LocalSamplingClient):
        raise TypeError(f"runner serve samples with LocalBackend's clients, not {type(sc).__name__}")
    return sc


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

    def new_trainer(self, spec: LoraSpec) -> Future[LocalTrainingClient]:
        return self.engine().create_training_client(spec).map(local_trainer)

    def trainer_from_state(self, folder: str, spec: LoraSpec, with_optimizer: bool) -> Future[LocalTrainingClient]:
        return self.engine().create_training_client_from_state(folder, spec, with_optimizer=with_optimizer
                                                               ).map(local_trainer)

    def new_sampler(self, model_path: str | None = None, base_model: str | None = None
                    ) -> Future[LocalSamplingClient]:
        return self.engine().create_sampling_client(model_path=model_path, base_model=base_model).map(local_sampler)


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
    tc: Future[LocalTrainingClient]
    session_id: str
    next_seq: int = 1
    pending: dict[int, Callable[[], None]] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)  # sampler ids of kind="inflight" clients (shared weights)
    last: concurrent.futures.Future[object] | None = None  # the engine future of the latest job handed over
    lock: threading.RLock = field(default_factory=threading.RLock)

    def enqueue(self, seq_id: int, promise: Promise, op: Op[R]) -> None:
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
