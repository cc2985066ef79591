"""Ctrl-C that works whatever the process is doing: a watchdog process that ends the run when it cannot end itself.

Python runs its signal handlers, and any thread, only between bytecodes of a thread holding the GIL; C code that
never lets it go (an env's `sum(range(10**12))`, a regex that backtracks for an hour) holds off both, so no
in-process mechanism can act on Ctrl-C then. What still runs is the C-level handler that Python installs for every
signal with a Python handler: with signal.set_wakeup_fd it writes the signal's number to a file descriptor. That
descriptor is a pipe to this watchdog, a small separate process (`python -I -S`, stdlib only, about 40 ms to start),
which relays each SIGINT back to the run (the loop's StopFlag reads the relay on a thread, as before) and times it:

  - after the first SIGINT, the run's event loop must show it still runs: StopFlag's watcher thread writes a
    heartbeat byte each time the loop answers (every 0.2 s). No heartbeat for `first_s` (4 s: the in-process
    watcher's own 3 s, which ends a run whose loop is blocked but which still has the GIL, plus 1 s) and the
    watchdog kills the run (SIGKILL);
  - after the second SIGINT, the run has `second_s` (1 s) to exit (it does so at once when its relay thread can
    run, exit 130); then the watchdog kills it.

A killed run exits with SIGKILL's status (137 in a shell), its run dir as after a `kill -9`: checkpoints and
metrics rows are atomic, so the same command resumes from the last checkpoint (docs/reliability.md). The watchdog
sits in a process group of its own (the terminal's Ctrl-C reaches only the run; the run relays it) and ignores
SIGINT; it exits when told to (StopFlag's end), when the pipe closes, or when its parent is gone.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading

STOP, BEAT = b"\xff", b"h"  # bytes the run writes besides signal numbers (1-64): the end, and "my loop runs"
READY, READY_S = b"r", 10.0  # what the watchdog writes first, and how long start() waits for it

_CHILD = r"""
import os, select, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent, first_s, second_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
os.write(1, b"r")
count, deadline, why = 0, None, ""
while os.getppid() == parent:
    wait = 0.25 if deadline is None else min(0.25, max(0.0, deadline - time.monotonic()))
    if select.select([0], [], [], wait)[0]:
        data = os.read(0, 512)
        if not data or 255 in data:
            break
        for b in data:
            if b == signal.SIGINT:
                count += 1
                try:
                    os.write(1, bytes([b]))
                except OSError:
                    pass
                now = time.monotonic()
                if count == 1:
                    deadline = now + first_s
                    why = ("interrupted: the run is blocked (nothing in it ran for %g s after Ctrl-C: an env in C code "
                           "that holds the GIL?); the runner watchdog kills it now. The same command resumes from "
                           "the last checkpoint" % first_s)
                else:
                    deadline = min(deadline if deadline is not None else now + second_s, now + second_s)
                    why = "interrupted again: the runner watchdog kills the run now, without a checkpoint of the last steps"
            elif b == ord("h") and count == 1:
                deadline = time.monotonic() + first_s
    if deadline is not None and time.monotonic() >= deadline and os.getppid() == parent:
        sys.stderr.write("\n" + why + "\n")
        sys.stderr.flush()
        os.kill(parent, signal.SIGKILL)
        break
"""


class Watchdog:
    """The watchdog process of one training session: `wake_fd` is for signal.set_wakeup_fd (non-blocking), the
    relayed SIGINTs are read from `relay_fd` (EOF once the watchdog ended), beat() says the run's loop runs, stop()
    ends it. start() returns None where no watchdog starts and says it is ready within READY_S (the caller keeps its
    in-process handling)."""

    def __init__(self, proc: subprocess.Popen[bytes], wake_fd: int, relay_fd: int, spare_fd: int):
        self.proc, self.wake_fd, self.relay_fd = proc, wake_fd, relay_fd
        # The wake pipe's read end, kept open here too: should the watchdog die, the C handler's writes land in the
        # pipe (dropped once it is full) instead of failing with EPIPE.
        self._spare_fd = spare_fd
        self._lock = threading.Lock()  # beat() from a thread never writes to a closed (reused) descriptor

    @classmethod
    def start(cls, first_s: float = 4.0, second_s: float = 1.0) -> Watchdog | None:
        if not sys.executable:
            return None
        wake_r, wake_w = os.pipe()
        relay_r, relay_w = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD, str(os.getpid()), str(first_s),
                                     str(second_s)], stdin=wake_r, stdout=relay_w, close_fds=True, process_group=0)
        except (OSError, subprocess.SubprocessError):
            for fd in (wake_r, wake_w, relay_r):
                os.close(fd)
            return None
        finally:
            os.close(relay_w)
        # Ready: it ignores SIGINT and reads the pipe. Else (an interpreter that cannot run it) the caller keeps its
        # in-process handling rather than send signals into a pipe nobody reads.
        ready = select.select([relay_r], [], [], READY_S)[0] and os.read(relay_r, 1) == READY
        if not ready:
            proc.kill()
            proc.wait()
            for fd in (wake_r, wake_w, relay_r):
                os.close(fd)
            return None
        os.set_blocking(wake_w, False)
        return cls(proc, wake_w, relay_r, wake_r)

    def beat(self) -> None:
        self._send(BEAT)

    def _send(self, byte: bytes) -> None:
        with self._lock, contextlib.suppress(OSError):  # full (the watchdog is slow) or closed: nothing to do
            if self.wake_fd >= 0:
                os.write(self.wake_fd, byte)

    def stop(self) -> None:
        """Tell the watchdog to end and wait for it (it ends within its 0.25 s poll; killed after 2 s)."""
        self._send(STOP)
        with self._lock:
            fds, self.wake_fd, self._spare_fd = (self.wake_fd, self._spare_fd), -1, -1
            for fd in fds:
                if fd >= 0:
                    os.close(fd)
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
