"""glibc malloc settings for a training process: keep freed tensor memory instead of handing it back to the OS.

A training step allocates and frees the same big activations every time. With glibc's defaults, freed blocks
above the (dynamic) mmap threshold are unmapped and the heap top is trimmed, and a worker thread's own arena
trims eagerly, so the next step page-faults the same memory in again. Measured (bench setup of
bench/bench_train.py, tiny model, ours through its worker thread, 1 thread): 8.9 ms/step of system time and
5,200 minor faults/step with the defaults; 0.9 ms and 340 with the three settings below (the 25M model:
66 -> 34 ms/step sys, 37,500 -> 11,100 faults). MALLOC_ARENA_MAX=1 in the environment alone did not help
(53 ms/step sys on tiny): the trim and mmap thresholds are what matter, one arena removes the rest.

The cost is memory that stays resident after a peak (as with torch's CUDA caching allocator); `runner serve`
still returns it explicitly with malloc_trim when it frees a session. Settings made through the environment
(MALLOC_ARENA_MAX, MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_) are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_done: list[bool] = []


def keep_freed_memory() -> bool:
    """Apply the settings once per process (glibc on Linux only); True if they were applied."""
    if _done:
        return _done[0]
    ok = False
    env = ("MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
    if sys.platform.startswith("linux") and not any(k in os.environ for k in env):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
            mallopt = None
        if mallopt is not None:
            ok = all((
                mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1,  # trim the heap top only past 1 GiB free
                mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1,  # blocks up to 32 MiB (glibc's max) from the heap
                mallopt(_M_ARENA_MAX, 1) == 1,  # worker threads share the main arena
            ))
    _done.append(ok)
    return ok
