"""env_timeout_s for an env that blocks the event loop's thread in a synchronous call (time.sleep, a blocking
socket read) inside its async method, where asyncio's own timeout cannot fire.

While rollouts with a timeout run on the main thread, a watcher thread posts a heartbeat to the event loop. When
the loop has not run it for `timeout_s` and the main thread is inside an episode (runner.rl.rollouts.run_episode
is on its stack), the watcher sends SIGUSR1 to the main thread; the handler raises EnvTimeout there, in the env's
call, if the loop is still stuck in that same stretch. The episode fails, its group is dropped and counted like any
group past env_timeout_s. A blocking system call is interrupted (the handler runs on EINTR); a long computation
in C that never returns to Python is not, until it does.

A stuck loop also stalls every other group in flight, through no fault of theirs: their deadlines
(`keep_deadline`) are moved back by the time the loop spent stuck, so only the blocking group is dropped.

Only on the main thread (Python runs signal handlers there); elsewhere the asyncio timeout alone applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import CodeType, FrameType


class LoopWatch:
    """One watcher for all the rollouts in flight (ref-counted by `guard`)."""

    active: LoopWatch | None = None

    def __init__(self, timeout_s: float, episode_code: CodeType, make_error: Callable[[str], BaseException]):
        self.timeout_s = timeout_s
        self.episode_code = episode_code
        self.make_error = make_error
        self.loop = asyncio.get_running_loop()
        self.main: int = threading.main_thread().ident or 0
        self.users = 0
        self.ticks = 0  # heartbeats the loop ran
        self.stalled = 0.0  # seconds the loop was stuck (heartbeats that ran late), for keep_deadline
        self.armed_at: int | None = None  # ticks when the watcher fired (the stuck stretch it is about)
        self.closed = threading.Event()
        self.previous = signal.signal(signal.SIGUSR1, self._on_signal)
        self.thread = threading.Thread(target=self._watch, name="runner-env-watch", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.closed.set()
        signal.signal(signal.SIGUSR1, self.previous)

    def _tick(self, beat: threading.Event, posted: float) -> None:
        self.ticks += 1
        late = time.monotonic() - posted
        if late > 0.05:
            self.stalled += late
        beat.set()

    def _watch(self) -> None:
        while not self.closed.is_set():
            beat = threading.Event()
            try:
                self.loop.call_soon_threadsafe(self._tick, beat, time.monotonic())
            except RuntimeError:  # the loop closed
                return
            while not beat.wait(self.timeout_s):  # the loop has not run for timeout_s (again, after a firing)
                if self.closed.is_set():
                    return
                frame = sys._current_frames().get(self.main)  # noqa: SLF001 - the way to see another thread's stack
                if frame is not None and self._in_episode(frame):
                    self.armed_at = self.ticks
                    signal.pthread_kill(self.main, signal.SIGUSR1)
            self.closed.wait(min(0.2, self.timeout_s / 4))

    def _in_episode(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code is self.episode_code:
                return True
            frame = frame.f_back
        return False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Main thread. Raise only while the loop is still in the stretch the watcher saw stuck, inside an episode.
        if self.armed_at is not None and self.armed_at == self.ticks and self._in_episode(frame):
            self.armed_at = None
            raise self.make_error(f"an env blocked the event loop in a synchronous call for over "
                                  f"env_timeout_s = {self.timeout_s:g} s")


@contextlib.contextmanager
def guard(timeout_s: float | None, episode_code: CodeType,
          make_error: Callable[[str], BaseException]) -> Iterator[LoopWatch | None]:
    """Watch the event loop while the body runs (see the module docstring); a no-op (None) without a timeout or
    off the main thread. Nested and concurrent uses share one watcher (the first one's timeout)."""
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        yield None
        return
    watch = LoopWatch.active
    if watch is None or watch.closed.is_set():
        watch = LoopWatch.active = LoopWatch(timeout_s, episode_code, make_error)
    watch.users += 1
    try:
        yield watch
    finally:
        watch.users -= 1
        if watch.users == 0:
            watch.close()
            if LoopWatch.active is watch:
                LoopWatch.active = None


def keep_deadline(deadline: asyncio.Timeout, timeout_s: float | None, watch: LoopWatch | None) -> Callable[[], None]:
    """Expire `deadline` (an asyncio.timeout(None)) once the body has had `timeout_s` seconds of a running loop:
    time the loop spent stuck (in another group's env) is added back. Returns the canceller of the check."""
    if timeout_s is None:
        return lambda: None
    loop = asyncio.get_running_loop()
    start = loop.time()
    stalled0 = watch.stalled if watch is not None else 0.0
    handle: asyncio.TimerHandle | None = None

    def check() -> None:
        nonlocal handle
        due = start + timeout_s + ((watch.stalled - stalled0) if watch is not None else 0.0)
        if loop.time() >= due:
            deadline.reschedule(loop.time())  # expires now: the body is cancelled
        else:
            handle = loop.call_at(due, check)

    handle = loop.call_at(start + timeout_s, check)
    return lambda: handle.cancel() if handle is not None else None
