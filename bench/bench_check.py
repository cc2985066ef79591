"""How long `runner check recipes.toml` takes: the median of N runs (default 5), each a fresh process.

    python bench/bench_check.py [--runs N] [--file recipes.toml] [--ref DIR]

Each run is `python -m runner check FILE` with this checkout first on PYTHONPATH, bytecode caches allowed
(a first untimed run writes them, as any installed copy has them), so the figure is what a user waits.
Printed per run: wall seconds and CPU seconds (user + sys of the child). On a shared machine the wall time
grows with the load while the CPU time barely moves, so both medians are printed. `--ref DIR` times another
checkout of the project (e.g. the main branch) interleaved with this one, run for run, for a fair comparison.
Target (issue 23): median < 0.5 s.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(root: Path, file: str) -> tuple[float, float]:
    """(wall s, cpu s) of one `runner check` run of `root`'s code."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(root)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "runner", "check", file], cwd=root, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"runner check failed in {root}:\n{proc.stdout}{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--file", default="recipes.toml")
    ap.add_argument("--ref", type=Path, default=None, help="another checkout to time alongside, run for run")
    args = ap.parse_args(argv)
    roots = {"this": ROOT, **({"ref": args.ref.resolve()} if args.ref else {})}
    for root in roots.values():
        one_run(root, args.file)  # writes the bytecode caches; not timed
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in roots}
    for i in range(args.runs):
        for label, root in roots.items():
            wall, cpu = one_run(root, args.file)
            times[label].append((wall, cpu))
            print(f"run {i + 1} {label:4s} wall {wall:.3f} s  cpu {cpu:.3f} s", flush=True)
    for label, rows in times.items():
        wall = statistics.median(w for w, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        print(f"{label:4s} median of {args.runs}: wall {wall:.3f} s  cpu {cpu:.3f} s  ({roots[label]})")


if __name__ == "__main__":
    main()
