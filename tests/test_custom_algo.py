"""A user's own algorithm from a recipe (`algo = {kind = "python", target = "pkg.mod:SPEC"}`,
examples/custom_algo.py): checked, run, compared."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from runner.cli import main
from runner.engine.log import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copy(ROOT / "examples" / "custom_algo.py", tmp_path / "custom_algo.py")
    (tmp_path / "examples" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "data" / "completions.jsonl", tmp_path / "examples" / "data")
    shutil.copy(ROOT / "examples" / "custom_algo.toml", tmp_path / "recipes.toml")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("custom_algo", None)


def test_custom_algorithm_checks_runs_and_learns(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "recipes.toml"]) == 0
    assert main(["run", "recipes.toml#completions", "max_steps=6"]) == 0
    rows = [r for r in read_jsonl(proj / "runs" / "completions" / "metrics.jsonl") if "completion_nll" in r]
    assert len(rows) == 6
    assert rows[-1]["completion_nll"] < rows[0]["completion_nll"]
    assert main(["compare", "runs/completions"]) == 0
    assert "completion_nll final" in capsys.readouterr().out


@pytest.mark.parametrize(("override", "expected"), [
    ("algo.args.batch_sise=3", "algo.args: batch_sise: unknown key; did you mean `batch_size`?"),
    ("algo.target=custom_algo:NOPE", "algo.target: cannot import 'custom_algo:NOPE'"),
    ("algo.target=custom_algo:Completions", "is a type, not an AlgoSpec"),
    # The old spelling, refused with the new one.
    ('algo={kind="custom", spec="custom_algo:SPEC"}',
     'algo: kind "custom" is now spelled {kind = "python", target = "custom_algo:SPEC", args = {...}}'),
])
def test_bad_custom_algorithm_is_one_line(proj: Path, capsys: pytest.CaptureFixture[str], override: str,
                                          expected: str) -> None:
    assert main(["run", "recipes.toml#completions", override]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
