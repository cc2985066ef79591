"""Wall time of `runner sweep` with --parallel 2 against --parallel 1, side by side in one run.

The sweep: 4 points (lr = 1e-3, 2e-3, 4e-3, 8e-3) of a tiny SFT recipe (the embedded model, sl_basic's data,
--steps steps each), local backend, CPU. Each round runs the sequential sweep and the parallel one in fresh
directories, alternating which goes first (A B, B A, ...) so drift in the machine's load hits both alike; the
report is each round's times and the ratio of the totals. `runner sweep` sets OMP_NUM_THREADS to
cores // parallel itself (2 threads per point sequentially, 1 per point in parallel, on 2 cores), so this
measures the command as a user gets it. OMP_NUM_THREADS in the environment would override that: it is removed.

    python bench/bench_sweep.py                 # 2 rounds, 10 steps per point, about 3 minutes on 2 cores
    python bench/bench_sweep.py --rounds 3 --steps 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LRS = "[1e-3,2e-3,4e-3,8e-3]"


def sweep_once(parallel: int, steps: int) -> float:
    """Seconds for a whole 4-point sweep with `parallel` points at a time, in a fresh directory."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="bench_sweep_") as tmp:
        cmd = [sys.executable, "-m", "runner", "sweep", f"{REPO}/recipes.toml#sl_basic", f"lr={LRS}",
               f"max_steps={steps}", "eval_every=0", "--parallel", str(parallel)]
        t = time.monotonic()
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, check=False)
        took = time.monotonic() - t
        if done.returncode != 0:
            sys.exit(f"sweep --parallel {parallel} failed:\n{done.stdout}\n{done.stderr}")
        if done.stdout.count(" done ") != 4:
            sys.exit(f"expected 4 finished points:\n{done.stdout}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="training steps per point")
    args = ap.parse_args()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    print(f"4-point SFT sweep, {args.steps} steps per point, {cores} cores; --parallel 1 vs --parallel 2")
    seq: list[float] = []
    par: list[float] = []
    for r in range(args.rounds):
        order = (1, 2) if r % 2 == 0 else (2, 1)
        times = {p: sweep_once(p, args.steps) for p in order}
        seq.append(times[1])
        par.append(times[2])
        print(f"round {r + 1}: --parallel 1 {times[1]:6.1f} s   --parallel 2 {times[2]:6.1f} s   "
              f"ratio {times[2] / times[1]:.2f}", flush=True)
    print(f"total: --parallel 1 {sum(seq):.1f} s, --parallel 2 {sum(par):.1f} s; "
          f"parallel/sequential = {sum(par) / sum(seq):.2f} (target <= 0.65)")


if __name__ == "__main__":
    main()
