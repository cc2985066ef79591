"""One ordered worker thread per client: the local stand-in for Tinker's per-model request sequence.

Jobs run strictly in submission order. A failing job fails only its own future (a failed Tinker
request does not poison the client). A sampling worker's thread exits after a short idle spell and restarts
on the next submit, so a client the caller has dropped (and the model copy it holds) can be garbage-collected:
an RL loop makes a new sampling client every step. A training worker (persistent=True) keeps its thread while
the worker lives: a new thread may get another malloc arena than the last one (glibc fixes the arena count at
the first thread's first malloc, so backends/local/alloc.py's limit of one often comes too late), and then
re-faults every activation of the next step: measured on bench_train's 25M model, a step after a pause took
4.0 s instead of 1.8 s (2.1 s of system time, 190,000 page faults) and the process kept both arenas' memory.
The thread holds the worker only weakly between jobs, so a dropped client is still collected (its thread then
exits).

A batching (drain) worker also coalesces: requests from concurrent RL episodes reach it a little apart
(each episode awaits its previous sample, runs its env, then submits), and without a pause the first
arrival would start a batch alone while the rest queue behind it. See Worker._gather.
"""

from __future__ import annotations

import concurrent.futures
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from backends.base import BackendError, Future
from backends.errors import UserError

IDLE_EXIT_S = 2.0

# Coalescing (coalesce=True), measured on RL rollouts of the tiny model (bench/bench_sampling_clients.py):
# after a batch returns, its callers resubmit 1-10 ms apart; after an idle spell a burst of new episodes
# arrives ~0.3 ms apart. A batch costs nearly the same for 1 row as for 20 on CPU, so waiting a few ms for
# the rest is cheap next to running them as a second batch.
WARM_GAP_S = 0.02  # while callers of the last batch are still coming back: the longest pause between two
WAIT_FRACTION = 0.25  # ... and the whole wait, as a fraction of the last batch's run time
MAX_WAIT_S = 0.1  # ... capped at this
COLD_GAP_S = 0.002  # otherwise: a lone request waits this long for company (a burst keeps extending it)
COLD_MAX_S = 0.02


# A job's payload: what its worker's handler takes (a training worker's: a callable that runs the request; a
# sampling worker's: a request record, backends/local/backend.py LocalSamplingClient).
P = TypeVar("P")
Call = Callable[[], object]


@dataclass
class Job(Generic[P]):
    request: str  # e.g. "forward_backward #3", named in errors
    payload: P
    future: concurrent.futures.Future[Any]  # of each request's own result type (the caller's Future says which)
    owner: Worker[P] | None = None  # a queued job keeps its worker alive, so a dropped client still runs what it was sent


# What a request that ran out of memory can change (the error's message says so in one line; torch's own is a
# paragraph).
OOM_HINT = ("lower the tokens in flight (batch_size, group_size x groups_per_batch, max_length, max_tokens), "
            "lora.rank, or use a smaller model; the client is as it was before this request")


def out_of_memory(exc: BaseException) -> str | None:
    """The first line of an out-of-memory error's message (torch.OutOfMemoryError on CUDA; the CPU allocator's
    RuntimeError), else None. The allocator's cached blocks are released, so the next request starts clean."""
    text = str(exc).strip()
    if type(exc).__name__ != "OutOfMemoryError" and not (
            isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text)):
        return None
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from backends.local.static_decode import CAPTURE_LOCK

        with CAPTURE_LOCK:  # torch asserts that no CUDA graph capture is underway (a sampler thread may capture)
            torch.cuda.empty_cache()
    # torch's CUDA message is one long line: what was asked and what is free, then allocator advice.
    first = (text.splitlines()[0] if text else type(exc).__name__).split(" Including non-PyTorch memory")[0]
    return first if len(first) <= 240 else first[:237] + "..."


def fail(job: Job[P], exc: BaseException) -> None:
    """Fail one job's future with a BackendError that names its request."""
    oom = None if isinstance(exc, (BackendError, UserError)) else out_of_memory(exc)
    if isinstance(exc, BackendError):
        err = exc if exc.request else BackendError(f"{job.request}: {exc}", job.request, exc.user_error)
    elif isinstance(exc, UserError):
        err = BackendError(f"{job.request}: {exc}", job.request, user_error=True)
    elif oom is not None:
        err = BackendError(f"{job.request} ran out of memory ({oom}): {OOM_HINT}", job.request)
    else:
        err = BackendError(f"{job.request} failed: {type(exc).__name__}: {exc}", job.request)
    if err is not exc:
        err.__cause__ = exc
    job.future.set_exception(err)


def run_each(jobs: list[Job[Call]]) -> None:
    """The training handler: each payload is a callable; its return value is the result."""
    for job in jobs:
        try:
            job.future.set_result(job.payload())
        except BaseException as exc:  # noqa: BLE001 - any failure belongs to this job alone
            fail(job, exc)


class Worker(Generic[P]):
    """drain=False hands `handle` one job at a time; drain=True hands it everything queued (batching), and
    with coalesce=True waits briefly for requests that are likely on their way (_gather). on_start runs
    first thing in each new worker thread (the backend sets its torch thread count there)."""

    def __init__(
        self,
        name: str,
        handle: Callable[[list[Job[P]]], None] = run_each,
        drain: bool = False,
        coalesce: bool = False,
        on_start: Callable[[], None] | None = None,
        persistent: bool = False,
    ):
        self._name = name
        self._idle_exit_s = None if persistent else IDLE_EXIT_S
        self._handle = handle
        self._drain = drain
        self._coalesce = coalesce
        self._on_start = on_start
        self._queue: queue.Queue[Job[P] | None] = queue.Queue()
        weakref.finalize(self, self._queue.put, None)  # wakes a persistent thread to exit when this goes
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        # For _gather: the next batch's likely size (the callers the last batch released, plus the requests
        # that queued while it ran), when the last batch ended and how long it ran.
        self._expected = 0
        self._last_end = -math.inf
        self._last_run = 0.0

    def submit(self, request: str, payload: P) -> Future[Any]:
        job = Job(request, payload, concurrent.futures.Future(), self)
        with self._lock:
            if self._closed:
                fail(job, BackendError(f"{request}: the backend is closed", request))
                return Future(job.future)
            self._queue.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._queue, self._idle_exit_s),
                                                name=self._name, daemon=True)
                self._thread.start()
        return Future(job.future)

    def close(self) -> None:
        """Refuse new jobs and wait for the queued ones to finish."""
        with self._lock:
            self._closed = True
            thread = self._thread
            self._queue.put(None)  # wake an idle thread so it sees _closed at once
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _step(self, item: Job[P] | None) -> bool:
        """Run `item` (and what the drain takes with it); False when the thread should exit: idle or closed, and
        nothing queued."""
        jobs = [] if item is None else [item]
        if self._drain and self._take_queued(jobs) and self._coalesce and jobs:
            self._gather(jobs)
        if jobs:
            self._run(jobs)
            if not self._closed:
                return True
        with self._lock:  # idle, or closed: exit unless a submit slipped in meanwhile
            if self._queue.empty():
                self._thread = None
                return False
        return True

    def poll(self, jobs: list[Job[P]]) -> list[Job[P]]:
        """For a drain handler that admits work while it runs (the sampler's continuous batching): the jobs
        queued now, without waiting, appended to `jobs` (the list the handler was given, so that a handler
        failure fails them too and the next coalescing wait counts them) and returned."""
        start = len(jobs)
        self._take_queued(jobs)  # a close() seen here: _step sees _closed once the handler returns
        return jobs[start:]

    def _take_queued(self, jobs: list[Job[P]]) -> bool:
        """Move everything queued now into `jobs`; False if close() was seen (stop waiting for more)."""
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                return True
            if more is None:
                return False
            jobs.append(more)

    def _gather(self, jobs: list[Job[P]]) -> None:
        """Wait a little for more jobs before a batch runs. Right after a batch, its callers are likely to
        resubmit (multi-turn episodes): wait until they are all back (with the requests that queued while it
        ran: a batch that got split once merges again), while they keep coming (at most WARM_GAP_S apart) and
        for at most WAIT_FRACTION of its run time. Otherwise wait only while a burst goes on (COLD_GAP_S
        apart), so a lone request is delayed by COLD_GAP_S at most."""
        now = time.monotonic()
        # At least COLD_GAP_S: a caller that is back sooner than that never pays the cold wait.
        deadline = self._last_end + max(COLD_GAP_S, min(MAX_WAIT_S, WAIT_FRACTION * self._last_run))
        if now < deadline:
            if len(jobs) >= self._expected:
                return  # everyone is back (a lone sequential caller never waits)
            want, gap = self._expected, WARM_GAP_S
        else:
            want, gap, deadline = math.inf, COLD_GAP_S, now + COLD_MAX_S
        while len(jobs) < want:
            timeout = min(gap, deadline - time.monotonic())
            if timeout <= 0:
                return
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                return
            if item is None:
                return  # closing: run what is here
            jobs.append(item)
            if not self._take_queued(jobs):
                return

    def _run(self, jobs: list[Job[P]]) -> None:
        start = time.monotonic()
        try:
            self._handle(jobs)
        except BaseException as exc:  # noqa: BLE001 - a handler bug must not leave futures pending forever
            for job in jobs:
                if not job.future.done():
                    fail(job, exc)
        self._last_end = time.monotonic()
        self._expected, self._last_run = len(jobs) + self._queue.qsize(), self._last_end - start


def _serve(ref: weakref.ref[Worker[P]], jobs: queue.Queue[Job[P] | None], idle_exit_s: float | None) -> None:
    """A worker's thread. It holds the worker only while it runs jobs, so a dropped worker is collected even
    while a persistent thread waits (its finalizer puts None on the queue: the thread wakes and exits)."""
    worker = ref()
    if worker is None:
        return
    if worker._on_start is not None:
        worker._on_start()
    del worker
    while True:
        try:
            item = jobs.get(timeout=idle_exit_s)
        except queue.Empty:
            item = None  # idle
        worker = ref()
        if worker is None:
            return
        if not worker._step(item):
            return
        del worker, item  # drop payload references before waiting
