"""One ordered worker thread per client: the local stand-in for Tinker's per-model request sequence.

Jobs run strictly in submission order. A failing job fails only its own future (a failed Tinker
request does not poison the client). The thread exits after a short idle spell and restarts on the
next submit, so a client the caller has dropped (and the model copy it holds) can be garbage-collected:
an RL loop makes a new sampling client every step.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from backends.base import BackendError, Future
from runner.errors import UserError

IDLE_EXIT_S = 2.0


@dataclass
class Job:
    request: str  # e.g. "forward_backward #3", named in errors
    payload: Any
    future: concurrent.futures.Future[Any]


def fail(job: Job, exc: BaseException) -> None:
    """Fail one job's future with a BackendError that names its request."""
    if isinstance(exc, BackendError):
        err = exc if exc.request else BackendError(f"{job.request}: {exc}", job.request, exc.user_error)
    elif isinstance(exc, UserError):
        err = BackendError(f"{job.request}: {exc}", job.request, user_error=True)
    else:
        err = BackendError(f"{job.request} failed: {type(exc).__name__}: {exc}", job.request)
    if err is not exc:
        err.__cause__ = exc
    job.future.set_exception(err)


def run_each(jobs: list[Job]) -> None:
    """The training handler: each payload is a callable; its return value is the result."""
    for job in jobs:
        try:
            job.future.set_result(job.payload())
        except BaseException as exc:  # noqa: BLE001 - any failure belongs to this job alone
            fail(job, exc)


class Worker:
    """drain=False hands `handle` one job at a time; drain=True hands it everything queued (batching)."""

    def __init__(self, name: str, handle: Callable[[list[Job]], None] = run_each, drain: bool = False):
        self._name = name
        self._handle = handle
        self._drain = drain
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, request: str, payload: Any) -> Future[Any]:
        job = Job(request, payload, concurrent.futures.Future())
        with self._lock:
            if self._closed:
                fail(job, BackendError(f"{request}: the backend is closed", request))
                return Future(job.future)
            self._queue.put(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
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

    def _loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                item = None  # idle
            jobs = [] if item is None else [item]
            while self._drain:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is not None:
                    jobs.append(more)
            if jobs:
                self._run(jobs)
                jobs = item = None  # drop payload references before idling
                if not self._closed:
                    continue
            with self._lock:  # idle, or closed: exit unless a submit slipped in meanwhile
                if self._queue.empty():
                    self._thread = None
                    return

    def _run(self, jobs: list[Job]) -> None:
        try:
            self._handle(jobs)
        except BaseException as exc:  # noqa: BLE001 - a handler bug must not leave futures pending forever
            for job in jobs:
                if not job.future.done():
                    fail(job, exc)
