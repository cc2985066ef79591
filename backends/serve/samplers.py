"""The sampler pool: sampling sessions and the models behind them.

Memory is bounded: a sampling session keeps only its weights' source (a checkpoint folder, or a spilled
snapshot) and at most max_live sessions hold a loaded model, each freed after idle_s idle. Requests for one
session that arrive together reach the sampler together (Gather), so it decodes them as one batch.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from backends.base import Future
from backends.serve.replies import NOT_LOADED, ApiError
from backends.serve.sessions import ServedModel

if TYPE_CHECKING:
    import torch

    from backends.local.backend import LocalSamplingClient
    from backends.local.model import TrainSetup

log = logging.getLogger("runner.serve")

SAMPLER_IDLE_S = 30.0
MAX_LIVE_SAMPLERS = 4


@dataclass
class SamplerSession:
    """A sampling session. `source` (a checkpoint or spilled-snapshot folder; None = the base model) or
    `weights` (a snapshot still in memory) is what rebuilds its model after it was freed."""

    sampler_id: str
    model: ServedModel
    session_id: str
    model_path: str | None
    source: Path | None = None
    weights: tuple[dict[str, torch.Tensor], TrainSetup, int] | None = None  # (trainable tensors, their setup, step)
    client: Future[LocalSamplingClient] | None = None
    last_used: float = field(default_factory=time.monotonic)
    run_id: str | None = None  # the training run of an inflight client (it follows that run's inflight saves)

    def adopt(self, other: SamplerSession) -> None:
        """Take `other`'s weights (an inflight save): later requests sample from them."""
        self.client, self.weights, self.last_used = other.client, other.weights, time.monotonic()
        self.source = other.source


class SamplerPool:
    def __init__(self, ephemeral_dir: Path, idle_s: float = SAMPLER_IDLE_S, max_live: int = MAX_LIVE_SAMPLERS):
        self.ephemeral_dir = ephemeral_dir
        self.idle_s = idle_s
        self.max_live = max_live
        self._lock = threading.RLock()
        self._by_id: dict[str, SamplerSession] = {}

    def add(self, sess: SamplerSession) -> None:
        with self._lock:
            self._by_id[sess.sampler_id] = sess
        self.evict(keep=sess.sampler_id)

    def get(self, sid: str) -> SamplerSession:
        with self._lock:
            s = self._by_id.get(sid)
        if s is None:
            raise ApiError(404, f"unknown sampling session {sid} (its session ended, or the server restarted: "
                                f"create a new sampling client)", code=NOT_LOADED)
        return s

    def find(self, sids: Iterable[str]) -> list[SamplerSession]:
        with self._lock:
            return [self._by_id[s] for s in sids if s in self._by_id]

    def remove(self, sids: Iterable[str]) -> int:
        with self._lock:
            gone = [self._by_id.pop(x) for x in list(sids) if x in self._by_id]
        for sampler in gone:
            if sampler.source is not None and sampler.source.is_relative_to(self.ephemeral_dir):
                shutil.rmtree(sampler.source, ignore_errors=True)
        return len(gone)

    def loaded(self, sess: SamplerSession) -> bool:
        """Whether `client(sess)` returns at once: its client exists (loading or loaded) and has not failed."""
        c = sess.client
        return c is not None and not (c.done() and c.future().exception() is not None)

    def client(self, sess: SamplerSession) -> Future[LocalSamplingClient]:
        """The session's loaded sampling client, rebuilding it if it was freed."""
        with self._lock:
            sess.last_used = time.monotonic()
            if sess.client is not None and not (sess.client.done() and sess.client.future().exception()):
                return sess.client
            if sess.source is None and sess.weights is not None:
                self._spill(sess)
            if sess.source is not None:
                client = sess.model.new_sampler(model_path=str(sess.source))
            else:
                client = sess.model.new_sampler(base_model=sess.model.path)
            sess.client = client
        self.evict(keep=sess.sampler_id)
        return client

    def _spill(self, sess: SamplerSession) -> None:
        """Write an in-memory snapshot to disk, so its model can be freed and rebuilt later."""
        from backends.local import model as M

        assert sess.weights is not None
        weights, setup, step = sess.weights
        dest = self.ephemeral_dir / sess.sampler_id
        if dest.exists():  # an inflight client spilled earlier weights here
            shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True, exist_ok=True)
        M.write_weights_only(dest, weights, setup, sess.model.engine().model_name, step)
        sess.source, sess.weights = dest, None

    def evict(self, keep: str | None = None) -> None:
        """Free loaded samplers idle longer than idle_s, and the least recently used ones beyond max_live."""
        t = time.monotonic()
        with self._lock:
            live = sorted((s for s in self._by_id.values() if s.client is not None), key=lambda s: s.last_used)
            excess = len(live) - self.max_live
            victims = []
            for s in live:
                if s.sampler_id == keep or (s.client is not None and not s.client.done()):
                    continue
                if excess > 0 or t - s.last_used > self.idle_s:
                    victims.append(s)
                    excess -= 1
        for s in victims:
            with self._lock:
                if s.source is None and s.weights is None:
                    continue  # its snapshot is not in memory yet: keep the model
                if s.source is None:
                    self._spill(s)
                s.client = None
            log.debug("freed sampler %s", s.sampler_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"samplers": len(self._by_id), "live_samplers": sum(s.client is not None for s in self._by_id.values())}

    def __contains__(self, sid: str) -> bool:
        return sid in self._by_id

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._by_id)


_libc: list[Callable[[int], object] | None] = []  # glibc's malloc_trim, or None where there is none


def trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise, so RSS would not show models freed)."""
    if not _libc:
        import ctypes
        import ctypes.util

        try:
            _libc.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _libc.append(None)
    if _libc[0] is not None:
        _libc[0](0)


class Gather:
    """Holds a sampling session's requests while more keep arriving, then submits them back to back, so the
    sampler decodes them as one batch. A program's concurrent sample calls (an RL step's 64 rollouts) reach the
    server spread over tens of ms over HTTP (each is an SDK call and a POST), while the local sampler batches
    only what is queued when it starts (backends/local/worker.py): submitted as they came, they ran as 3-4
    batches of about the same cost each instead of one (rl_basic: sampling 3.6x as long as in process).

    A sampler's first burst is due when it has had as many requests as the client's previous sampler had in all
    (`group` is the client session; an RL step samples from a new sampler each step, the same number of times),
    or when none came for GAP_S, or MAX_S after its first request; a later burst as soon as it is as large as
    the sampler's largest so far (so a lone sequential caller waits GAP_S once). Measured
    on rl_basic over HTTP on 2 busy cores: an RL step's 64 requests arrive over 70-190 ms, with 0-3 gaps over
    12 ms and none over 40 ms.
    """

    GAP_S = 0.04
    MAX_S = 0.3

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[float, float, list[Callable[[], None]]]] = {}  # key -> (first, last, jobs)
        self._count: dict[str, int] = {}  # key -> requests so far
        self._group: dict[str, str] = {}  # key -> its group
        self._latest: dict[str, str] = {}  # group -> its latest key
        self._expected: dict[str, int] = {}  # group -> requests of its previous key
        self._sent: dict[str, int] = {}  # key -> requests dispatched so far
        self._burst: dict[str, int] = {}  # key -> its largest burst dispatched
        self._closed = False
        threading.Thread(target=self._loop, name="serve-gather", daemon=True).start()

    def add(self, key: str, job: Callable[[], None], group: str | None = None) -> None:
        t = time.monotonic()
        with self._cond:
            if key not in self._count:
                g = self._group[key] = group or key
                prev = self._latest.get(g)
                if prev is not None:
                    self._expected[g] = self._count.get(prev, 0)
                self._latest[g] = key
                self._count[key] = 0
                if len(self._count) > 10_000:  # keys of ended sessions
                    self._forget()
            self._count[key] += 1
            first, _, jobs = self._pending.get(key, (t, t, []))
            jobs.append(job)
            self._pending[key] = (first, t, jobs)
            self._cond.notify()

    def _forget(self) -> None:
        for key in list(self._count)[:5_000]:
            if key not in self._pending:
                g = self._group.pop(key, None)
                del self._count[key]
                self._sent.pop(key, None)
                self._burst.pop(key, None)
                if g is not None and self._latest.get(g) == key:
                    del self._latest[g]
                    self._expected.pop(g, None)

    def _due(self, key: str, first: float, last: float, n: int) -> float:
        expected = self._expected.get(self._group.get(key, key), 1 << 30)
        if self._sent.get(key, 0) < expected <= self._count.get(key, 0):  # its first burst is complete
            return 0.0
        if n >= self._burst.get(key, 1 << 30):  # as many as its largest burst so far
            return 0.0
        return min(first + self.MAX_S, last + self.GAP_S)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    t = time.monotonic()
                    due = {k: self._due(k, first, last, len(jobs)) for k, (first, last, jobs) in self._pending.items()}
                    ready = [k for k, d in due.items() if d <= t]
                    if ready:
                        batches = [self._pending.pop(k)[2] for k in ready]
                        for k, jobs in zip(ready, batches, strict=True):
                            self._sent[k] = self._count.get(k, 0)
                            self._burst[k] = max(self._burst.get(k, 0), len(jobs))
                        break
                    self._cond.wait(min(due.values()) - t if due else None)
            for jobs in batches:
                for job in jobs:
                    try:
                        job()
                    except Exception:  # a job reports its own errors; this thread must live
                        log.exception("sampling dispatch failed")
