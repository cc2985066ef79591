"""What the run dir's safety and the Ctrl-C watchdog cost a training session (docs/reliability.md).

- watchdog: runner/engine/watchdog.py's process, started and stopped once per training session (StopFlag), against
  its peer, a bare `python -I -S -c pass`;
- claim: rundir.claim() of a run dir of ours holding N iteration_* folders (what it scans is the top level),
  against its peer, os.listdir of the same folder.

Medians over interleaved rounds, wall clock.

With --ctrl-c, also what it is for: `runner run` of an RL recipe on the tiny local model whose env holds the GIL in C
(`sum(range(10**12))`) once a checkpoint is saved, sent one SIGINT, then (a fresh run) two SIGINTs 0.3 s apart:
seconds from the last SIGINT to the exit, and the same command resuming to the end.

    python bench/bench_watchdog.py            (about 5 s)
    python bench/bench_watchdog.py --ctrl-c   (about 1 min)
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
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


def blocking_env(block: str) -> str:
    """An RL env module (make(run_dir)) whose step, once the run has recorded a checkpoint and until a file "unblock"
    exists beside the run dir, touches "blocked" there and runs the statement `block` (blocking the event loop's
    thread; tests/test_interrupt.py uses a sleep, this bench a GIL-holding sum)."""
    return textwrap.dedent("""
        import time
        from pathlib import Path
        from runner.rl.envs.arithmetic import ArithmeticEnv
        from runner.rl.envs.common import ListDataset, RepeatGroupBuilder

        class Blocking(ArithmeticEnv):
            def __init__(self, run_dir, *args):
                super().__init__(*args)
                self.run_dir = Path(run_dir)

            async def step(self, action_tokens, stop_reason):
                ckpts = self.run_dir / "checkpoints.jsonl"
                if ckpts.exists() and ckpts.read_text().strip() and not (self.run_dir.parent / "unblock").exists():
                    (self.run_dir.parent / "blocked").touch()
                    BLOCK
                return await super().step(action_tokens, stop_reason)

        def make(run_dir):
            def builder(ctx):
                group = lambda i: RepeatGroupBuilder(lambda: Blocking(run_dir, ctx.renderer, i % 10, 1), ctx.group_size, [])
                return ListDataset(range(40), group, 2), None
            return builder
    """).replace("BLOCK", block)


GIL_ENV = blocking_env("sum(range(10**12))  # holds the GIL for hours")

RECIPE = """[recipes.gil]
lr = 1e-2
max_steps = 6
save_every = 1
eval_every = 0
log_dir = "run"
algo = {kind = "rl", env = {kind = "python", target = "gil_env:make", args = {run_dir = "run"}}, group_size = 2, \
groups_per_batch = 2, max_tokens = 4}
"""


def ctrl_c() -> None:
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "gil_env.py").write_text(GIL_ENV)
        (work / "recipes.toml").write_text(RECIPE)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), str(root)])}
        command = [sys.executable, "-m", "runner", "run", "recipes.toml#gil"]
        for signals in (1, 2):
            for name in ("blocked", "run"):
                subprocess.run(["rm", "-rf", str(work / name)], check=True)
            proc = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            while not (work / "blocked").exists():
                if proc.poll() is not None:
                    raise SystemExit(proc.stderr.read().decode()[-3000:] if proc.stderr else "the run ended")
                time.sleep(0.05)
            time.sleep(0.5)  # inside the C loop
            for i in range(signals):
                if i:
                    time.sleep(0.3)
                proc.send_signal(signal.SIGINT)
            t = time.monotonic()
            _, err = proc.communicate(timeout=60)
            took, last = time.monotonic() - t, err.decode().strip().splitlines()[-1]
            print(f"ctrl-c x{signals}: exit {proc.returncode} {took:.2f} s after the last SIGINT: {last}")
        (work / "unblock").touch()
        resumed = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        print(f"resume: exit {resumed.returncode}: {resumed.stderr.strip().splitlines()[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--entries", type=int, default=1000, help="iteration_* folders in the claimed run dir")
    parser.add_argument("--ctrl-c", action="store_true", help="also Ctrl-C a runner run whose env holds the GIL")
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
    if args.ctrl_c:
        ctrl_c()


if __name__ == "__main__":
    main()
