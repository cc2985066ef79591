"""Ctrl-C while a run trains (runner/engine/loop.py): the first stops it after the submitted steps and a checkpoint,
the second quits at once; either way the run dir resumes (docs/reliability.md).

`StopFlag` reads SIGINT on a thread of its own, through a watchdog process where one starts
(runner/engine/watchdog.py), and also carries the recipe's budget stop (runner/engine/cost.py); `until_stopped` runs
a step's prepare unless the first Ctrl-C comes before any of it is submitted; `Interrupted` is what the loop raises
once the checkpoint is saved (exit 130, runner/cli.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Awaitable, Sized

from runner.engine.log import Progress
from runner.engine.watchdog import Watchdog


class Interrupted(Exception):
    """Ctrl-C: the steps already submitted finished and a checkpoint of the last one was saved (exit 130)."""


class StopFlag:
    """Ctrl-C while training: the first sets the flag (the loop stops submitting, finishes what it submitted and
    saves a checkpoint), the second exits at once (130).

    Signals are read on a thread of their own (signal.set_wakeup_fd: the C-level handler writes each signal's
    number to a pipe), so Ctrl-C is seen even while the event loop's thread is stuck in a synchronous call (an
    env's time.sleep inside its async step). After the first Ctrl-C a watcher thread checks that the event loop
    still runs: when it does not answer within `grace_s`, nothing graceful can happen, so the process says so and
    exits 130 at once; the run dir then resumes from its last checkpoint, as after a kill -9.

    Neither thread runs while C code holds the GIL (an env's sum(range(10**12))), so the pipe leads to a watchdog
    process (runner/engine/watchdog.py) that relays each SIGINT to the reader thread and kills the run when no
    heartbeat of the event loop came within grace_s + 1 s of the first Ctrl-C, or 1 s after the second. Where no
    such process starts, the pipe is a socketpair read in-process (as before). Main thread only."""

    STOP = b"\xff"  # written by __exit__ to the in-process socketpair: the reader thread ends

    def __init__(self, progress: Progress, grace_s: float = 3.0):
        self.set = False
        # Set (on the loop) with the flag, to wake a step's prepare waiting on an env (None: not installed).
        self.event: asyncio.Event | None = None
        self.progress = progress
        # Set with `set` when the stop is the recipe's budget (runner/engine/cost.py), not Ctrl-C: the one-line reason.
        self.budget: str | None = None
        self.grace_s = grace_s
        self.installed = False
        self._closed = threading.Event()
        self._guard: Watchdog | None = None
        self._count = 0  # SIGINTs seen
        self._relay_lost = False  # the watchdog ended early: count signals in the Python handler instead

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._loop = asyncio.get_running_loop()
        self.event = asyncio.Event()
        self._guard = Watchdog.start(first_s=self.grace_s + 1.0, second_s=1.0)
        if self._guard is not None:
            wake_fd, read_fd = self._guard.wake_fd, self._guard.relay_fd
        else:
            self._r, self._w = socket.socketpair()
            self._w.setblocking(False)
            wake_fd, read_fd = self._w.fileno(), self._r.detach()
        self._old_fd = signal.set_wakeup_fd(wake_fd, warn_on_full_buffer=False)
        # A Python-level handler that does nothing while the relay works: the C handler still writes the wakeup
        # byte, and no KeyboardInterrupt is raised into whatever the main thread runs.
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        self.installed = True
        threading.Thread(target=self._read_signals, args=(read_fd,), name="runner-sigint", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.installed:
            return
        self.installed = False
        signal.signal(signal.SIGINT, self._previous)
        signal.set_wakeup_fd(self._old_fd)
        self._closed.set()
        if self._guard is not None:
            self._guard.stop()  # the watchdog ends: the reader thread reads EOF
            return
        try:
            self._w.send(self.STOP)
        except OSError:
            pass
        self._w.close()

    def _read_signals(self, fd: int) -> None:
        try:
            while True:
                try:
                    data = os.read(fd, 64)
                except OSError:
                    data = b""
                if not data or self.STOP[0] in data:
                    # The watchdog gone while the run goes on (killed by someone): signals are then counted by the
                    # Python handler, on the main thread, as long as C code lets it run.
                    self._relay_lost = self._guard is not None and not self._closed.is_set()
                    return
                for b in data:
                    if b == signal.SIGINT:
                        self._signal()
        finally:
            os.close(fd)

    def _on_sigint(self, signum: int, frame: object) -> None:
        if self._relay_lost:
            signal.set_wakeup_fd(self._old_fd)  # nothing reads the pipe any more
            self._signal()

    def _signal(self) -> None:
        self._count += 1
        if self._count == 1:
            self._first()
        else:
            self._second()

    def _first(self) -> None:
        self.set = True
        try:
            self._loop.call_soon_threadsafe(self.progress.interrupt, "interrupted: finishing the submitted steps "
                                            "and saving a checkpoint (Ctrl-C again to quit now)")
            if self.event is not None:
                self._loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop already closed
            return
        threading.Thread(target=self._watch, name="runner-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """The event loop must keep running for the graceful stop to happen: quit when it is blocked; while it
        runs, tell the watchdog process so."""
        while not self._closed.is_set():
            beat = threading.Event()
            try:
                self._loop.call_soon_threadsafe(beat.set)
            except RuntimeError:  # the loop closed: the run is over
                return
            if not beat.wait(self.grace_s) and not self._closed.is_set():
                sys.stderr.write(f"\ninterrupted: the run is blocked (its event loop has not run for {self.grace_s:g} "
                                 "s: an env in a synchronous call?); quitting now. The same command resumes from the "
                                 "last checkpoint\n")
                sys.stderr.flush()
                os._exit(130)
            if self._guard is not None:
                self._guard.beat()
            self._closed.wait(0.2)

    def _second(self) -> None:
        sys.stderr.write("\ninterrupted again: quitting now, without a checkpoint of the last steps\n")
        sys.stderr.flush()
        os._exit(130)


async def until_stopped(prepare: Awaitable[None], stop: StopFlag, submitted: Sized) -> bool:
    """Run a step's prepare to the end (True), unless the first Ctrl-C comes while none of its parts has been
    submitted: then it is cancelled (False), so an env that never answers cannot hold the stop up. Once a part is
    submitted (RL stream mode) the step finishes whole, as a checkpoint must not hold half a step."""
    task = asyncio.ensure_future(prepare)
    try:
        if stop.event is None:
            await task
            return True
        waiter = asyncio.ensure_future(stop.event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not task.done() and not submitted:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return False
        await task
        return True
    finally:
        if not task.done():
            task.cancel()
