"""OpenMP's wait policy for the process, chosen before torch loads.

torch's CPU thread pool is OpenMP (libgomp), whose idle threads busy-wait ("spin") by default. On a
machine whose cores are shared (other processes, or our own sampler thread next to a training thread) a
spinning team burns the CPU that its partner needs, and every small op waits out a preempted thread.
Measured on 2 cores, the local backend, `bench/bench_loop.py --part speed` (rl_basic): with the machine
otherwise idle, spinning gave 5.47 sync / 5.51 async steps/s and passive 4.86 / 5.24; once another
process used a core, spinning fell to 0.3-0.6 steps/s (10x slower) while passive held 4.0-4.6. So
`runner run` asks for passive waiting unless the user set OMP_WAIT_POLICY (or GOMP_SPINCOUNT) already.
libgomp reads the variable once, when torch is first imported: setting it later does nothing.
"""

from __future__ import annotations

import os
import sys


def prefer_passive_openmp() -> bool:
    """Sets OMP_WAIT_POLICY=PASSIVE for this process if torch is not loaded yet and the user chose nothing;
    returns whether the policy in force is (or will be) passive."""
    if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"
