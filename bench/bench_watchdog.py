"""What the run dir's safety and the Ctrl-C watchdog cost a training session (docs/reliability.md).

- watchdog: runner/engine/watchdog.py's process, started and stopped once per training session (StopFlag), against
  its peer, a bare `python -I -S -c pass`;
- claim: rundir.claim() of a run dir of ours holding N iteration_* folders (what it scans is the top level),
  against its peer, os.listdir of the same folder.

Medians over interleaved rounds, wall clock.

    python bench/bench_watchdog.py            (about 5 s)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.engine.rundir import CONFIG, MARKER, claim
from runner.engine.watchdog import Watchdog


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def watchdog_once() -> None:
    w = Watchdog.start()
    assert w is not None
    w.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--entries", type=int, default=1000, help="iteration_* folders in the claimed run dir")
    args = parser.parse_args()

    peer: list[float] = []
    ours: list[float] = []
    for _ in range(args.rounds):
        peer.append(timed(lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)))
        ours.append(timed(watchdog_once))
    p, o = statistics.median(peer), statistics.median(ours)
    print(f"watchdog start+stop  {o * 1e3:7.1f} ms   python -I -S -c pass {p * 1e3:7.1f} ms   ratio {o / p:.2f}")

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        (run_dir / MARKER).write_text('{"format": 1}\n')
        (run_dir / CONFIG).write_text("[recipes.r]\n")
        for i in range(args.entries):
            (run_dir / f"iteration_{i:06d}").mkdir()
        listing, claims = [], []
        for _ in range(args.rounds):
            listing.append(timed(lambda: os.listdir(run_dir)))
            claims.append(timed(lambda: claim(run_dir)))
        lm, cm = statistics.median(listing), statistics.median(claims)
        print(f"claim ({args.entries} entries) {cm * 1e3:7.2f} ms   os.listdir {lm * 1e3:7.2f} ms   ratio {cm / lm:.1f}")


if __name__ == "__main__":
    main()
