"""Do the shipped recipes learn? Runs each named recipe (its upstream stages too) from a fresh directory and prints,
per run dir, its algorithm's main metric at the first and the last row that has it, and the wall time.

    python bench/bench_recipes.py                       # the recipes of recipes.toml that nothing else starts from
    python bench/bench_recipes.py recipes.toml#rl_basic examples/rl_tictactoe.toml#rl_tictactoe
    python bench/bench_recipes.py --out bench/results/recipes.md

The table is what the README's "What the shipped recipes do" quotes (tests/test_readme.py checks the README's rows are
this file's rows), so a figure there comes from a run of this script, on the machine named in the header line.
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

from runner.algos import spec_of  # noqa: E402
from runner.engine.rundir import load_config  # noqa: E402
from runner.recipe.load import load_file  # noqa: E402


def terminal_recipes(path: Path) -> list[str]:
    """The recipes of a file that no other recipe of it starts from (each runs its upstreams)."""
    text = path.read_text()  # init_from, teachers and judges name their upstream as "#name"
    return [f"{path}#{n}" for n in load_file(str(path)) if f'"#{n}"' not in text]


def first_last(rows: list[dict], key: str) -> tuple[float, float] | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return (values[0], values[-1]) if values else None


def summarize(run_dir: Path) -> tuple[str, str, str, str]:
    recipe = load_config(run_dir / "config.toml")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = max((r.get("step", 0) for r in rows), default=0)
    for key in spec_of(recipe.algo).compare_keys():
        fl = first_last(rows, key)
        if fl is not None:
            return key, f"{fl[0]:.3g}", f"{fl[1]:.3g}", str(steps)
    return "-", "-", "-", str(steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("refs", nargs="*", help="FILE#name (default: recipes.toml's terminal recipes)")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()
    refs = args.refs or terminal_recipes(ROOT / "recipes.toml")
    lines = [f"<!-- bench/bench_recipes.py on {platform.machine()}, {os.cpu_count()} cores, "
             f"{time.strftime('%Y-%m-%d')} -->",
             "| recipe | run | metric | first | last | steps | wall s |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    failed = 0
    for ref in refs:
        path, _, name = ref.partition("#")
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "runner", "run", f"{Path(path).resolve()}#{name}"],
                                  cwd=tmp, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                failed += 1
                row = f"| {name} | - | FAILED (exit {proc.returncode}) | - | - | - | {wall:.0f} |"
                print(row, proc.stderr.strip().splitlines()[-1:], file=sys.stderr)
                lines.append(row)
                print(row, flush=True)
                continue
            for run_dir in sorted((Path(tmp) / "runs").glob("*/"), key=lambda d: (d.name != name, d.name)):
                key, first, last, steps = summarize(run_dir)
                shown = f"{wall:.0f}" if run_dir.name == name else ""
                row = f"| {name if run_dir.name == name else ''} | {run_dir.name} | `{key}` | {first} | {last} | " \
                      f"{steps} | {shown} |"
                lines.append(row)
                print(row, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
