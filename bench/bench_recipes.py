"""Do the shipped recipes learn? Runs each named recipe (its upstream stages too) from a fresh directory and prints,
per run dir, its algorithm's main metric at the first and the last row that has it, and the wall time.

    python bench/bench_recipes.py                       # the recipes of recipes.toml that nothing else starts from
    python bench/bench_recipes.py recipes.toml#rl_basic examples/rl_tictactoe.toml#rl_tictactoe
    python bench/bench_recipes.py --out bench/results/recipes.md

The table is what the README's "What the shipped recipes do" quotes: bench/figures.py writes it there and into
bench/results/recipes.md with recipe_rows below (tests/test_readme.py checks the two agree; CI reruns the cheap rows
with `python bench/figures.py --check`), so a figure there comes from a run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runner.engine.rundir import load_config  # noqa: E402
from runner.engine.spec import spec_of  # noqa: E402
from runner.recipe.load import load_file  # noqa: E402


def terminal_recipes(path: Path) -> list[str]:
    """The recipes of a file that no other recipe of it starts from (each runs its upstreams)."""
    text = path.read_text()  # init_from, teachers and judges name their upstream as "#name"
    return [f"{path}#{n}" for n in load_file(str(path)) if f'"#{n}"' not in text]


def first_last(rows: list[dict], key: str) -> tuple[float, float] | None:
    """A held-out metric's first and last values; a training metric's means over the first and the last 5 rows (one
    step's batch is noisy)."""
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if not values:
        return None
    if key.startswith("test/"):
        return values[0], values[-1]
    k = min(5, len(values))
    return sum(values[:k]) / k, sum(values[-k:]) / k


def summarize(run_dir: Path) -> list[tuple[str, str, str, str]]:
    """(metric, first, last, steps) for the algorithm's first two main metrics the run logged."""
    recipe = load_config(run_dir / "config.toml")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = str(max((r.get("step", 0) for r in rows), default=0))
    out = []
    for key in spec_of(recipe.algo).compare_keys():
        fl = first_last(rows, key)
        if fl is not None:
            out.append((key, f"{fl[0]:.3g}", f"{fl[1]:.3g}", steps))
    out = out[:2]
    for key in EXTRA:  # evaluated once, on the final weights
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if values:
            out.append((key, "-", f"{values[-1]:.3g}", steps))
    return out or [("-", "-", "-", steps)]


# Final-only evals worth a row where a run logs them: RLHF's win rate against the SFT policy (its RL reward is 0.5 by
# construction), prompt distillation's agreement with the teacher.
EXTRA = ("test/win_rate_vs_init", "test/agreement")


def recipe_rows(ref: str) -> tuple[list[str], bool]:
    """(the table rows of recipe `ref`: one per metric of each run dir its chain made, whether it ran): runs it from
    a fresh directory, printing each row as it comes (bench/figures.py keeps the README's rows current with it)."""
    path, _, name = ref.partition("#")
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "runner", "run", f"{Path(path).resolve()}#{name}"],
                              cwd=tmp, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            row = f"| {name} | - | FAILED (exit {proc.returncode}) | - | - | - | {wall:.0f} |"
            print(row, proc.stderr.strip().splitlines()[-1:], file=sys.stderr)
            print(row, flush=True)
            return [row], False
        for run_dir in sorted((Path(tmp) / "runs").glob("*/"), key=lambda d: (d.name != name, d.name)):
            for i, (key, first, last, steps) in enumerate(summarize(run_dir)):
                top = i == 0 and run_dir.name == name
                row = (f"| {name if top else ''} | {run_dir.name if i == 0 else ''} | `{key}` | {first} | {last} | "
                       f"{steps if i == 0 else ''} | {f'{wall:.0f}' if top else ''} |")
                rows.append(row)
                print(row, flush=True)
    return rows, True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("refs", nargs="*", help="FILE#name (default: recipes.toml's terminal recipes)")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()
    refs = args.refs or terminal_recipes(ROOT / "recipes.toml")
    # The same block bench/figures.py writes (which keeps README.md's copy current).
    lines = [f"<!-- figure:recipes (bench/bench_recipes.py on {platform.machine()}, {os.cpu_count()} cores, "
             f"{time.strftime('%Y-%m-%d')}) -->",
             "| recipe | run | metric | first | last | steps | wall s |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    note = ("Held-out (`test/`) metrics: the first and the last eval; training metrics: the mean of the first and of "
            "the last 5 steps. `wall s`: the whole chain, from a fresh directory.")
    failed = 0
    for ref in refs:
        rows, ok = recipe_rows(ref)
        failed += not ok
        lines.extend(rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join([*lines, "<!-- /figure:recipes -->", "", note]) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
