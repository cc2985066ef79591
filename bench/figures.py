"""Every figure the README and docs/ quote, regenerated from the command that prints it, at HEAD.

    python bench/figures.py --cheap     # rewrite the cheap figures in place (CI checks these: --check)
    python bench/figures.py --all       # and the expensive ones (the recipe table's other rows: rlhf_rl, ...)
    python bench/figures.py --check     # CI: rerun the cheap ones, exit 1 with a diff if a doc differs
    python bench/figures.py --only sweep --only cost-table   # some of them (names: --list)

A figure lives in a doc between two markers, and everything between them is this script's output:

    <!-- figure:NAME (bench/figures.py) -->
    ...
    <!-- /figure:NAME -->

An expensive figure's opening marker also names the commit it was made at (`commit abc1234`), since CI does not
rerun it. The recipe table is one figure in two places (README.md and bench/results/recipes.md, whose rows
tests/test_readme.py checks are the same): its cheap rows (sl_basic, dpo_basic, rl_basic) are checked at HEAD, the
others come from the commit in its header line.

Comparing (--check), what depends on the machine rather than the code is masked: wall-clock times ("21.6s", the
table's `wall s` column), the sweep's "N at a time, M threads each", and the order in which parallel sweep points
finish. Every run is on the CPU (CUDA_VISIBLE_DEVICES=""), so a GPU machine prints the CPU's numbers, and with
torch's, MKL's and oneDNN's kernels pinned to their AVX2 code paths (PINNED_ISA), so an AVX-512 CPU takes the same
paths as an AVX2 one (docs/determinism.md).

Numbers are compared within the precision the doc states: a recipe-table cell reads "0.934 ± 0.03" (PRECISION: the
spread of seeds 0-2, since another CPU's rounding moves a run as another seed does) and a number of another figure
within the relative tolerance its marker states ("within 0.5%"); the words around the numbers must be equal.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_recipes import recipe_rows  # noqa: E402

RECIPES = ROOT / "recipes.toml"
PRICE = "price={prefill=1,sample=2,train=3}"
# The recipe table's rows that CI reruns (the rest take minutes: rlhf_rl alone ~3 on 2 cores).
CHEAP_RECIPES = ("sl_basic", "rl_basic", "dpo_basic")
TABLE_FILES = (ROOT / "README.md", ROOT / "bench" / "results" / "recipes.md")
TABLE_HEAD = ["| recipe | run | metric | first | last | steps | wall s |", "|---|---|---|---|---|---|---|"]


# The CPU kernels' ISA, pinned for the figures' runs where the machine would pick a wider one (docs/determinism.md):
# torch's vectorized ops (ATEN_CPU_CAPABILITY), MKL's GEMMs in conditional-numerical-reproducibility mode
# (MKL_CBWR), oneDNN's primitives (ONEDNN_MAX_CPU_ISA). On an AVX2 CPU they change nothing (same bits, same speed).
PINNED_ISA = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

# The precision the recipe table states for its checked rows, by metric: at least the move of the value when the
# same recipe runs with other float rounding (RUNNER_KERNELS=0: torch's ops instead of the C kernels, as another
# CPU's would differ) and about the spread over seeds 0-2 (docs/determinism.md has the runs). rl_basic, measured:
# last test reward 0.957 / 0.968 without the kernels, 0.938 and 0.961 on seeds 1, 2; last training reward 0.832 /
# 0.856, 0.928 and 0.875 on seeds 1, 2. dpo_basic: test/accuracy 0.92 / 0.92, training 0.938 without the kernels.
# The first values are the step-0 weights, equal with and without the kernels (DPO's: every pair a tie, 0.5).
PRECISION = {
    "test/nll": 0.05, "train_mean_nll": 0.05,
    "test/env/all/reward/total": 0.03, "env/all/reward/total": 0.1,
    "test/accuracy": 0.04, "accuracy": 0.05,
}


def env() -> dict[str, str]:
    return {**PINNED_ISA, **os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}


def runner(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"bench/figures.py: runner {' '.join(args)} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout}{proc.stderr}")
    return proc


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="figures-") as tmp:
        yield Path(tmp)


# ---------------------------------------------------------------- the figures


def cost_table() -> str:
    """docs/cost.md: the dry run's estimate against the run's own totals, sl_basic and rl_basic, 4 steps."""
    rows = ["| recipe     | estimate (dry run)                                   | actual run (metrics.jsonl, final row's totals)   |",
            "|------------|------------------------------------------------------|--------------------------------------------------|"]
    for name in ("sl_basic", "rl_basic"):
        with scratch() as tmp:
            ref, args = f"{RECIPES}#{name}", ["max_steps=4", PRICE]
            dry = runner(["run", ref, "--dry-run", *args], tmp).stdout
            m = re.search(rf"cost of #{name}: .*?: prefill ([\d,]+), sample ([\d,]+), train ([\d,]+) tokens .*?"
                          r"cost \$([\d.]+)", dry)
            assert m is not None, dry
            estimate = _tokens(*(int(x.replace(",", "")) for x in m.groups()[:3]), float(m.group(4)))
            runner(["run", ref, *args], tmp)
            last = [json.loads(x) for x in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()][-1]
            actual = _tokens(last["tokens/total_prefill"], last["tokens/total_sample"], last["tokens/total_train"],
                             last["cost/total_usd"])
        rows.append(f"| {f'`{name}`':<10} | {estimate:<52} | {actual:<48} |")
    return "\n".join(rows)


def _tokens(prefill: int, sample: int, train: int, usd: float) -> str:
    parts = [f"{k} {v:,}" for k, v in (("prefill", prefill), ("sample", sample), ("train", train)) if v]
    return f"{', '.join(parts)}; ${usd:.4f}"


def cost_chain() -> str:
    """docs/cost.md: the rlhf_rl chain's dry run, its cost lines."""
    with scratch() as tmp:
        out = runner(["run", f"{RECIPES}#rlhf_rl", "--dry-run", PRICE], tmp).stdout
    lines = [x for x in out.splitlines() if x.startswith(("cost of #", "total cost of the chain"))]
    return "\n".join(["```", f"$ runner run recipes.toml#rlhf_rl --dry-run '{PRICE}'", "...", *lines, "```"])


def sweep() -> str:
    """docs/sweeps.md: a 4-point sweep of sl_basic and its comparison."""
    with scratch() as tmp:
        args = ["sweep", f"{RECIPES}#sl_basic", "lr=[1e-3,4e-3]", "lora.rank=[8,16]", "max_steps=20"]
        proc = runner(args, tmp)
        compare = runner(["compare", "runs/sl_basic"], tmp).stdout
    log = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    return "\n".join(["```", *log, "", "$ runner compare runs/sl_basic", *compare.rstrip().splitlines(), "```"])


def smoke() -> str:
    """docs/smoke.md: `runner smoke examples/cookbook.toml`'s table."""
    with scratch() as tmp:
        out = runner(["smoke", str(ROOT / "examples" / "cookbook.toml")], tmp).stdout
    table = out[out.index("recipe "):].rstrip()
    return "\n".join(["```", table, "```"])


def recipe_table(names: tuple[str, ...]) -> Callable[[], str]:
    """README.md and bench/results/recipes.md: bench/bench_recipes.py's rows of these recipes, the others kept."""
    def make() -> str:
        blocks = _table_blocks(_current(TABLE_FILES[1], "recipes"))
        for name in names:
            rows, ok = recipe_rows(f"{RECIPES}#{name}")
            if not ok:
                raise SystemExit(f"bench/figures.py: {name} failed: {rows[0]}")
            blocks[name] = [_with_precision(row) for row in rows] if name in CHEAP_RECIPES else rows
        return "\n".join([*TABLE_HEAD, *(row for rows in blocks.values() for row in rows)])
    return make


def _with_precision(row: str) -> str:
    """A checked row's first and last values as "value ± precision" (PRECISION, by the row's metric)."""
    cells = row.split("|")
    metric = cells[3].strip().strip("`")
    if metric not in PRECISION:
        return row
    for i in (4, 5):
        value = cells[i].strip()
        if value not in ("", "-"):
            cells[i] = f" {value} ± {PRECISION[metric]:g} "
    return "|".join(cells)


def _table_blocks(text: str) -> dict[str, list[str]]:
    """The recipe table's rows by recipe (a recipe's block starts at a row naming it)."""
    blocks: dict[str, list[str]] = {}
    name = ""
    for line in text.splitlines():
        if not line.startswith("| ") or line in TABLE_HEAD:
            continue
        first = line.split("|")[1].strip()
        if first:
            name = first
        blocks.setdefault(name, []).append(line)
    return blocks


@dataclass(frozen=True)
class Figure:
    name: str
    cheap: bool
    make: Callable[[], str]
    files: tuple[Path, ...]
    # --check: each number within this relative tolerance (stated in the figure's marker); the recipe table's cells
    # state their own (PRECISION).
    rtol: float = 0.0


# The table's other rows, in its order (the recipes of recipes.toml that nothing else starts from).
EXPENSIVE_RECIPES = ("distill_on_policy", "prompt_distill", "rlhf_rl", "math_rl", "code_rl", "tool_use", "rubric")
FIGURES = [
    # The rl_basic row's sampled tokens follow its replies' lengths: 2%. The dry runs' estimates are arithmetic: exact.
    Figure("cost-table", True, cost_table, (ROOT / "docs" / "cost.md",), rtol=0.02),
    Figure("cost-chain", True, cost_chain, (ROOT / "docs" / "cost.md",)),
    Figure("sweep", True, sweep, (ROOT / "docs" / "sweeps.md",), rtol=0.005),
    Figure("smoke", True, smoke, (ROOT / "docs" / "smoke.md",)),
    # One table, two parts: the cheap rows (CI) and the others (--all, which makes both).
    Figure("recipes", True, recipe_table(CHEAP_RECIPES), TABLE_FILES),
    Figure("recipes", False, recipe_table(EXPENSIVE_RECIPES), TABLE_FILES),
]


# ---------------------------------------------------------------- docs: reading, writing, comparing


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- figure:{re.escape(name)} [^\n]*-->\n)(.*?)(\n<!-- /figure:{re.escape(name)} -->)",
                      re.DOTALL)


def _current(path: Path, name: str) -> str:
    m = _pattern(name).search(path.read_text())
    if m is None:
        raise SystemExit(f"bench/figures.py: {path.relative_to(ROOT)} has no <!-- figure:{name} ... --> block")
    return m.group(2)


def _commit() -> str:
    """HEAD's short hash (+changes when tracked files differ from it), as it was when this script started."""
    global _COMMIT
    if _COMMIT is None:
        _COMMIT = _head()
    return _COMMIT


_COMMIT: str | None = None


def _head() -> str:
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return (proc.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def write(fig: Figure, text: str) -> None:
    within = f" within {fig.rtol:.1%}".replace(".0%", "%") if fig.rtol else ""
    stamp = (f"commit {_commit()}, {os.uname().machine}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}"
             if not fig.cheap else f"checked by CI at HEAD{within}: python bench/figures.py --check")
    if fig.name == "recipes":  # the cheap rows are checked at HEAD; the rest name the commit of the last --all
        old = _pattern(fig.name).search(TABLE_FILES[1].read_text())
        prev = old.group(1) if old else ""
        m = re.search(r"others: (commit [^;>]*)", prev)
        others = f"commit {_commit()}, {time.strftime('%Y-%m-%d')}" if not fig.cheap else (m.group(1) if m else "?")
        stamp = (f"rows of {', '.join(CHEAP_RECIPES)} checked by CI at HEAD within their ± "
                 f"(python bench/figures.py --check); "
                 f"others: {others}; {os.uname().machine}, {os.cpu_count()} cores")
    for path in fig.files:
        doc = path.read_text()
        new, n = _pattern(fig.name).subn(
            lambda m: f"<!-- figure:{fig.name} ({stamp}) -->\n{text}{m.group(3)}", doc)
        if n != 1:
            raise SystemExit(f"bench/figures.py: {path.relative_to(ROOT)} has {n} <!-- figure:{fig.name} --> blocks")
        path.write_text(new)


# Machine, not code: wall-clock seconds, the sweep's parallelism, the order parallel points finish in.
_TIME = re.compile(r"\b\d+(\.\d+)?s\b")
_PARALLEL = re.compile(r"\d+ to run, \d+ at a time, \d+ threads? each")


def normalize(name: str, text: str) -> list[str]:
    lines = []
    for line in text.splitlines():
        line = _PARALLEL.sub("N at a time", _TIME.sub("<t>s", line))
        if name == "recipes" and line.startswith("| "):
            line = re.sub(r"\| [^|]* \|$", "| <wall> |", line)  # the wall s column
        if name == "smoke" and re.match(r"\S+\s+\d+\s+\d+\s+[\d.]+\s", line):
            line = re.sub(r"^(\S+\s+\d+\s+\d+\s+)[\d.]+", r"\1<wall>", line)
        lines.append(re.sub(r"\s+", " ", line).strip())
    if name == "sweep":  # points finish in either order
        lines = sorted(re.sub(r"^\[\d/\d\] ", "", x) for x in lines)
    return lines


_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?(?![\w.])")
_STATED = re.compile(r"(-?\d+(?:\.\d+)?) ± (\d+(?:\.\d+)?)")


def _same(doc: list[str], head: list[str], rtol: float) -> bool:
    """Whether HEAD's lines are the doc's within the precision the doc states: a "v ± p" cell of the doc holds any
    number within p of v; any other number within rtol of the doc's (exactly, at rtol 0); every word equal."""
    if len(doc) != len(head):
        return False
    for have, got in zip(doc, head, strict=True):
        stated = [(float(v), float(p)) for v, p in _STATED.findall(have)]
        have_words, got_words = _STATED.sub("<v>", have), _STATED.sub("<v>", got)
        got_values = [float(v) for v, _ in _STATED.findall(got)]
        if len(got_values) != len(stated):
            return False
        if any(abs(g - v) > p + 1e-9 for g, (v, p) in zip(got_values, stated, strict=True)):
            return False
        nums_a = [float(x.replace(",", "")) for x in _NUMBER.findall(have_words)]
        nums_b = [float(x.replace(",", "")) for x in _NUMBER.findall(got_words)]
        if _NUMBER.sub("<n>", have_words) != _NUMBER.sub("<n>", got_words) or len(nums_a) != len(nums_b):
            return False
        if any(abs(x - y) > rtol * abs(x) for x, y in zip(nums_a, nums_b, strict=True)):
            return False
    return True


def check(fig: Figure, text: str) -> list[str]:
    """The differences between `text` and each doc's copy of the figure (normalized), as diff lines."""
    out = []
    for path in fig.files:
        have = _current(path, fig.name)
        if fig.name == "recipes":  # only the rows this run made
            keep = set(CHEAP_RECIPES)
            text_blocks, have_blocks = _table_blocks(text), _table_blocks(have)
            text = "\n".join(r for n in keep for r in text_blocks.get(n, []))
            have = "\n".join(r for n in keep for r in have_blocks.get(n, []))
        a, b = normalize(fig.name, have), normalize(fig.name, text)
        if not _same(a, b, fig.rtol):
            out += [f"{path.relative_to(ROOT)}: figure {fig.name} differs from what HEAD prints:",
                    *difflib.unified_diff(a, b, "in the doc", "at HEAD", lineterm="", n=1)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--cheap", action="store_true", help="regenerate the cheap figures in place")
    mode.add_argument("--all", action="store_true", help="regenerate every figure in place")
    mode.add_argument("--check", action="store_true", help="rerun the cheap figures; exit 1 if a doc differs")
    mode.add_argument("--list", action="store_true", help="name the figures")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="just this figure (repeatable)")
    args = ap.parse_args()
    if args.list:
        for fig in FIGURES:
            print(f"{fig.name:12} {'cheap' if fig.cheap else 'expensive':9} "
                  f"{', '.join(str(p.relative_to(ROOT)) for p in fig.files)}")
        return 0
    figs = [f for f in FIGURES if f.cheap or args.all]
    if args.only:
        figs = [f for f in figs if f.name in args.only]
    problems: list[str] = []
    _commit()  # the code the figures come from: HEAD now, before they run
    t_all = time.perf_counter()
    for fig in figs:
        t0 = time.perf_counter()
        text = fig.make()
        print(f"figure {fig.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if args.check:
            problems += check(fig, text)
        else:
            write(fig, text)
    print(f"bench/figures.py: {len(figs)} figures in {time.perf_counter() - t_all:.0f} s", file=sys.stderr)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        print("bench/figures.py --check: a figure in the docs is not what the code prints; regenerate it with "
              "python bench/figures.py --cheap (and commit the docs)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
