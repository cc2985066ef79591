"""bench/figures.py keeps every figure the README and docs/ quote equal to what the code at HEAD prints; CI runs its
--check. These tests check the machinery (fast); one reruns a cheap figure for real.

    pytest tests/test_figures.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import figures  # noqa: E402


def test_ci_runs_the_figures_check_after_the_tests() -> None:
    lines = (ROOT / ".ci/run").read_text().splitlines()
    pytest_at = next(i for i, x in enumerate(lines) if "-m pytest" in x)
    check_at = next(i for i, x in enumerate(lines) if x.strip() == ".venv/bin/python bench/figures.py --check")
    assert check_at > pytest_at


def test_every_figure_has_one_block_in_each_of_its_docs() -> None:
    assert {f.name for f in figures.FIGURES} == {"cost-table", "cost-chain", "sweep", "smoke", "recipes"}
    for fig in figures.FIGURES:
        for path in fig.files:
            assert len(figures._pattern(fig.name).findall(path.read_text())) == 1, (fig.name, path)
    # The recipe table's rows CI does not rerun name the commit they came from.
    head = figures._pattern("recipes").search((ROOT / "bench/results/recipes.md").read_text())
    assert head is not None and "others: commit " in head.group(1)


def _retimed(name: str, doc: str) -> str:
    """The same figure from another machine: other wall times (and, for the sweep, another finishing order)."""
    lines = doc.splitlines()
    if name == "recipes":  # the last column is the wall time
        return "\n".join("|".join([*x.split("|")[:-2], " 999 ", ""]) if x.startswith("| ") else x for x in lines)
    if name == "smoke":
        return "\n".join(x.replace(x.split()[3], "99.9", 1) if x.endswith("ok") else x for x in lines)
    if name == "sweep":
        done = [i for i, x in enumerate(lines) if " done " in x][:2]
        lines[done[0]], lines[done[1]] = lines[done[1]], lines[done[0]]
        return "\n".join(x.replace("s  20 steps", "1s  20 steps") for x in lines)
    return doc


CHANGED = {"smoke": ("rlhf_rl ", "rlhf_rx "), "sweep": ("train_mean_nll 5.2118", "train_mean_nll 5.4118"),
           "cost-table": ("$0.0", "$0.1"), "recipes": ("| rl_basic | rl_basic |", "| rl_basic | rl_other |")}


@pytest.mark.parametrize("name", ["smoke", "sweep", "cost-table", "recipes"])
def test_check_ignores_the_machine_and_flags_the_code(name: str) -> None:
    fig = next(f for f in figures.FIGURES if f.name == name and f.cheap)
    doc = figures._current(fig.files[0], name)
    assert figures.check(fig, doc) == []
    retimed = _retimed(name, doc)
    assert retimed != doc or name == "cost-table"
    assert figures.check(fig, retimed) == []
    old, new = CHANGED[name]
    assert old in doc
    problems = figures.check(fig, doc.replace(old, new, 1))
    assert problems and problems[0].endswith(f"figure {name} differs from what HEAD prints:")


def test_the_rlhf_rl_dry_run_figure_is_what_head_prints() -> None:
    """One figure rerun for real (a dry run: seconds): docs/cost.md's chain estimate is current."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench/figures.py"), "--check", "--only", "cost-chain"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "bench/figures.py: 1 figures in" in proc.stderr


def test_check_accepts_a_number_within_the_stated_precision_and_no_further() -> None:
    """Another CPU of the kind moves a run as another seed does: a recipe-table cell "v ± p" accepts HEAD's value
    within p of v, and a sweep number within the 0.5% its marker states; a larger move is a difference."""
    fig = next(f for f in figures.FIGURES if f.name == "recipes" and f.cheap)
    doc = figures._current(fig.files[0], "recipes")
    m = figures._STATED.search(doc)
    assert m is not None, "the checked rows state their precision"
    value, precision = float(m.group(1)), float(m.group(2))
    for moved, ok in ((value + precision / 2, True), (value - precision / 2, True), (value + 2 * precision, False)):
        assert (figures.check(fig, doc.replace(m.group(0), f"{moved:.4g} ± {precision:g}", 1)) == []) is ok, moved
    sweep = next(f for f in figures.FIGURES if f.name == "sweep")
    assert "within 0.5%" in (ROOT / "docs/sweeps.md").read_text()
    text = figures._current(sweep.files[0], "sweep")
    assert figures.check(sweep, text.replace("train_mean_nll 5.2118", "train_mean_nll 5.2150", 1)) == []
    assert figures.check(sweep, text.replace("train_mean_nll 5.2118", "train_mean_nll 5.2500", 1)) != []
