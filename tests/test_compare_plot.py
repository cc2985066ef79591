"""`runner compare` and `runner plot` over run dirs written by hand (config.toml + metrics.jsonl): the columns
(keys that differ), final and best values with each metric's direction, sorting, formats, discovery under sweep
dirs and globs, the PNG's curves and labels, the report page, and the one-line errors.

Run: pytest tests/test_compare_plot.py   (a few seconds; the plot tests skip without matplotlib)
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runner.cli import main
from runner.recipe.load import dump_recipe
from runner.recipe.schema import Recipe
from runner.tools.compare import choose_metrics, find_runs, render


def make_run(run_dir: Path, rows: list[dict[str, Any]], algo: dict[str, Any] | None = None, **over: Any) -> Path:
    algo = algo or {"kind": "sft", "data": {"kind": "jsonl", "path": "data.jsonl"}}
    recipe = msgspec.convert({"algo": algo, "log_dir": str(run_dir), **over}, Recipe)
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text(dump_recipe("r", recipe))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def sft_rows(train: list[float], test: dict[int, float]) -> list[dict[str, Any]]:
    out = []
    for s, v in enumerate(train):
        row: dict[str, Any] = {"step": s, "train_mean_nll": v, "progress/done_frac": (s + 1) / len(train)}
        if s in test:
            row["test/nll"] = test[s]
        out.append(row)
    return out


@pytest.fixture
def sweep_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """runs/sl: three SFT points differing in lr (and one in rank), plus a moved-aside old run that is left out."""
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "runs" / "sl"
    make_run(base / "lr=0.001", sft_rows([5.0, 4.0, 3.5, 3.6], {0: 6.0, 2: 4.0}), lr=1e-3)
    make_run(base / "lr=0.004", sft_rows([5.0, 3.0, 2.0, 2.5], {0: 6.0, 2: 3.0}), lr=4e-3)
    make_run(base / "lr=0.01", sft_rows([5.0, 6.0, 7.0, 8.0], {0: 6.0, 2: 7.5}), lr=1e-2, lora={"rank": 8})
    make_run(base / "lr=0.004.old-20250101-000000", sft_rows([9.0], {}), lr=4e-3)
    (base / "sweep.json").write_text(json.dumps({"recipe": "recipes.toml#sl", "axes": {"lr": [0.001, 0.004, 0.01]}}))
    return base


def test_compare_table(sweep_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "runs/sl"]) == 0
    assert capsys.readouterr().out == (
        "run               lr     lora.rank  steps  test/nll final  test/nll best  train_mean_nll final  "
        "train_mean_nll best\n"
        "runs/sl/lr=0.004  0.004  32             4          3.0000         3.0000                2.5000  "
        "             2.0000\n"
        "runs/sl/lr=0.001  0.001  32             4          4.0000         4.0000                3.6000  "
        "             3.5000\n"
        "runs/sl/lr=0.01   0.01   8              4          7.5000         6.0000                8.0000  "
        "             5.0000\n")


def test_compare_metric_choice_formats_and_globs(sweep_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --metric picks; a name without nll/loss in it is higher-is-better unless it says :min.
    assert main(["compare", "runs/sl/lr=0.00?", "--metric", "train_mean_nll", "--format", "csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows == [["run", "lr", "steps", "train_mean_nll final", "train_mean_nll best"],
                    ["runs/sl/lr=0.004", "0.004", "4", "2.5", "2.0"],
                    ["runs/sl/lr=0.001", "0.001", "4", "3.6", "3.5"]]
    assert main(["compare", "runs/sl", "--metric", "progress/done_frac:min", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["run"] for d in data] == ["runs/sl/lr=0.001", "runs/sl/lr=0.004", "runs/sl/lr=0.01"]  # ties: given order
    assert data[0]["config"] == {"lr": 0.001, "lora.rank": 32}
    assert data[0]["metrics"]["progress/done_frac"] == {"final": 1.0, "best": 0.25, "best_step": 0, "better": "min"}
    assert main(["compare", "runs/sl/lr=0.001", "runs/sl/lr=0.01/config.toml", "--format", "markdown"]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0].startswith("| run | lr | lora.rank | steps | test/nll final |")
    assert md[1].startswith("|---|---|---|---:|")
    assert main(["compare", "runs/sl", "--format", "html"]) == 0
    page = capsys.readouterr().out
    assert page.startswith("<!doctype html>") and "<td>runs/sl/lr=0.004</td>" in page


def test_rl_reward_is_higher_is_better_and_runs_can_mix(sweep_dir: Path) -> None:
    rl = {"kind": "rl", "env": {"kind": "arithmetic"}}
    make_run(sweep_dir.parent / "rl_a", [{"step": 0, "env/all/reward/total": 0.2, "progress/done_frac": 0.5},
                                         {"step": 1, "env/all/reward/total": 0.6, "progress/done_frac": 1.0},
                                         {"step": 2, "test/env/all/reward/total": 0.5}], algo=rl)
    make_run(sweep_dir.parent / "rl_b", [{"step": 0, "env/all/reward/total": 0.4, "progress/done_frac": 0.5},
                                         {"step": 1, "env/all/reward/total": 0.3, "progress/done_frac": 1.0},
                                         {"step": 2, "test/env/all/reward/total": 0.7}], algo=rl, seed=1)
    runs = find_runs(["runs/rl_*"])
    metrics = choose_metrics(runs)
    assert [m.name for m in metrics] == ["test/env/all/reward/total", "env/all/reward/total"]
    data = json.loads(render(runs, metrics, "json"))
    assert [d["run"] for d in data] == ["runs/rl_b", "runs/rl_a"]  # higher final test reward first
    assert data[0]["steps"] == 2  # the final eval row is not a step
    assert data[1]["metrics"]["env/all/reward/total"] == {"final": 0.6, "best": 0.6, "best_step": 1, "better": "max"}
    # SFT and RL side by side: each algorithm's main metrics, "-" where a run has none.
    both = find_runs(["runs/rl_a", "runs/sl/lr=0.001"])
    mixed = render(both, choose_metrics(both), "table")
    assert "test/env/all/reward/total final" in mixed.splitlines()[0] and "test/nll final" in mixed.splitlines()[0]


def test_main_metrics_of_other_algorithms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runner.tools.compare import main_metrics

    assert main_metrics("dpo") == ["test/accuracy", "accuracy"]
    assert main_metrics("no_such_kind") == []
    # A custom algorithm's spec without `compare` gets its headline metrics, held-out first.
    (tmp_path / "my_algo_mod.py").write_text(
        "from runner.engine.spec import AlgoSpec\n"
        "SPEC = AlgoSpec(build=lambda cfg, args: None, headline=[('loss', 'loss'), ('test/score', 's')])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main_metrics("custom", "my_algo_mod:SPEC") == ["test/score", "loss"]
    assert main_metrics("custom", "my_algo_mod:GONE") == []


@pytest.mark.parametrize(("args", "expected"), [
    (["compare", "runs/nope"], "error: runs/nope: no such run dir\n"),
    (["compare", "runs/zz*"], "error: runs/zz*: matches nothing\n"),
    (["compare", "empty"], "error: empty: no run dir in it (a run dir holds config.toml and metrics.jsonl)\n"),
    (["compare", "runs/sl", "--metric", "reward"], "error: no run logged reward; metrics in these runs: "),
])
def test_compare_errors_are_one_line(sweep_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                     expected: str) -> None:
    (sweep_dir.parent.parent / "empty").mkdir()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1


# ---------------------------------------------------------------- plots

def test_plot_draws_one_labelled_curve_per_run(sweep_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from runner.tools.plot import figure

    runs = find_runs(["runs/sl/lr=0.001", "runs/sl/lr=0.004"])
    fig = figure(runs, choose_metrics(runs, ["train_mean_nll"]))
    [ax] = fig.axes
    assert ax.get_title() == "train_mean_nll" and ax.get_xlabel() == "step"
    assert ax.get_ylabel() == "train_mean_nll (lower is better)"
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "lr" and [t.get_text() for t in legend.get_texts()] == ["0.001", "0.004"]
    assert [list(line.get_ydata()) for line in ax.get_lines()] == [[5.0, 4.0, 3.5, 3.6], [5.0, 3.0, 2.0, 2.5]]
    # Smoothed: a faint raw line and a bold moving average per run; only the bold one is in the legend.
    fig = figure(runs, choose_metrics(runs, ["train_mean_nll", "test/nll"]), k=2)
    train, test = fig.axes[:2]
    lines = train.get_lines()
    assert len(lines) == 4 and list(lines[1].get_ydata()) == [5.0, 4.5, 3.75, 3.55]
    assert lines[0].get_alpha() == 0.25 and [t.get_text() for t in train.get_legend().get_texts()] == [
        "0.001", "0.004"]
    assert train.get_title() == "train_mean_nll  (moving average of 2 points)"
    # Two evals per run: too few to average, drawn as they are.
    assert test.get_title() == "test/nll" and [list(line.get_ydata()) for line in test.get_lines()] == [
        [6.0, 4.0], [6.0, 3.0]]

    assert main(["plot", "runs/sl/lr=0.001", "runs/sl/lr=0.004", "--metric", "train_mean_nll", "-o", "x.png"]) == 0
    assert capsys.readouterr().out == "wrote x.png (2 runs)\n"
    assert Path("x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and Path("x.png").stat().st_size > 10_000


def test_plot_of_a_sweep_dir_writes_its_report(sweep_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    assert main(["plot", "runs/sl", "--smooth", "2"]) == 0
    assert capsys.readouterr().out == "wrote runs/sl/index.html and its plots\n"
    page = (sweep_dir / "index.html").read_text()
    assert '<img src="plot-test_nll.png"' in page and '<img src="plot-train_mean_nll.png"' in page
    assert "<td>runs/sl/lr=0.004</td>" in page and "recipe <code>recipes.toml#sl</code>" in page
    assert "old-2025" not in page  # the moved-aside run is not part of the sweep
    for png in ("plot-test_nll.png", "plot-train_mean_nll.png"):
        assert (sweep_dir / png).read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_is_one_line(sweep_dir: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["plot", "runs/sl", "-o", "x.png"]) == 2
    assert capsys.readouterr().err == (
        "error: runner plot: matplotlib is not installed: pip install 'runner[plot]' (or pip install matplotlib)\n")
    # The sweep report still has its table, and says what the curves need.
    from runner.tools.plot import write_report

    page = write_report(sweep_dir, find_runs(["runs/sl"])).read_text()
    assert "<td>runs/sl/lr=0.004</td>" in page and "No curves: matplotlib is not installed" in page
