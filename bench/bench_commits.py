"""Wall time of one recipe, this checkout against an older commit, side by side (interleaved rounds, medians).

Each round runs `python -m runner run RECIPE` once from a temporary git worktree of --old and once from this
checkout (alternating which goes first), each as a fresh process in its own run dir, with the same Python.
`python -m` puts the checkout's own folder first on sys.path, so each imports its own `runner/` and
`backends/`. Prints each run's wall time and its reward summary (so a speed-up that changed what is learned
shows), then the medians and their ratio.

    python bench/bench_commits.py                              # rl_basic vs d2d6e79, 3 rounds, ~4 min
    python bench/bench_commits.py --old HEAD~3 --recipe recipes.toml#sl_basic --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def summary(run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    reward = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    tests = [r for r in rows if any(k.startswith("test/") for k in r)]
    final = {k: round(v, 4) for k, v in tests[-1].items() if k in ("test/env/all/reward/total", "test/nll")} if tests else {}
    head = f"reward first 5 {statistics.mean(reward[:5]):.3f} last 5 {statistics.mean(reward[-5:]):.3f}; " if reward else ""
    return f"{head}final {final}; {len(rows)} rows"


def run(checkout: Path, recipe: str, out: Path, overrides: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "runner", "run", recipe, f"log_dir={out}", *overrides],
                          cwd=checkout, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: runner run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="d2d6e79", help="git ref to compare against (default: before the performance work)")
    ap.add_argument("--recipe", default="recipes.toml#rl_basic")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for both runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_commits_") as tmp_:
        tmp = Path(tmp_)
        old = tmp / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.old], check=True)
        try:
            walls: dict[str, list[float]] = {"old": [], "new": []}
            print(f"{args.recipe}: {args.old} (old) vs this checkout (new); load average {os.getloadavg()[0]:.2f}")
            for r in range(args.rounds):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for which in order:
                    out = tmp / f"{which}-{r}"
                    wall = run(old if which == "old" else ROOT, args.recipe, out, args.overrides)
                    walls[which].append(wall)
                    print(f"round {r + 1} {which}: {wall:6.1f} s  {summary(out)}", flush=True)
            m_old, m_new = statistics.median(walls["old"]), statistics.median(walls["new"])
            print(f"median wall: old {m_old:.1f} s, new {m_new:.1f} s; new / old = {m_new / m_old:.2f}x; "
                  f"load average {os.getloadavg()[0]:.2f}")
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)


if __name__ == "__main__":
    main()
