"""Pinned evals (`[[recipes.x.evals]]`, runner/engine/evals.py): run before eval steps, in the final row, and by
`runner eval`; math accuracy, NLL and user python evals; bad ones are one-line errors. Tiny SFT runs, seconds."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from backends.errors import UserError
from runner.cli import main
from runner.engine.evals import names
from runner.engine.loop import run
from runner.engine.math_eval_config import MathPinned
from runner.engine.nll_eval_config import NLLPinned
from runner.engine.python_eval_config import PythonPinned
from runner.recipe.load import load_recipe
from runner.recipe.sources import Jsonl

ROOT = Path(__file__).resolve().parents[1]
WORDS = ROOT / "examples/data/word_problems.jsonl"
CHAT = ROOT / "examples/data/chat_sft.jsonl"

EVAL_MODULE = '''
from backends.types import SamplingParams

def prompt_length(sampler, tokenizer, text="hi"):
    return {"length": len(tokenizer.encode(text)), "sampled": float(len(sampler.sample(
        tokenizer.encode(text), 1, SamplingParams(max_tokens=2, temperature=0)).result().sequences))}

async def async_one(sampler, tokenizer):
    return {"one": 1}

def not_a_dict(sampler, tokenizer):
    return [1.0]

def boom(sampler, tokenizer):
    raise RuntimeError("eval exploded")
'''


def recipe_text(tmp_path: Path, evals: str, max_steps: int = 3) -> str:
    return textwrap.dedent(f"""\
        [recipes.p]
        lr = 1e-2
        max_steps = {max_steps}
        eval_every = 2
        save_every = 0
        schedule = {{ kind = "constant" }}
        log_dir = "{tmp_path / 'run'}"
        algo = {{ kind = "sft", data = {{ kind = "jsonl", path = "{CHAT}" }}, batch_size = 8 }}
        """) + textwrap.dedent(evals)


PINNED = f"""
[[recipes.p.evals]]
kind = "math"
data = {{ kind = "jsonl", path = "{WORDS}" }}
answer_format = "auto"
max_problems = 8
max_tokens = 6

[[recipes.p.evals]]
kind = "nll"
name = "chat"
data = {{ kind = "jsonl", path = "{CHAT}" }}
max_rows = 8

[[recipes.p.evals]]
kind = "python"
target = "pinned_helpers:prompt_length"
args = {{ text = "four" }}
"""


@pytest.fixture(autouse=True)
def helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pinned_helpers.py").write_text(EVAL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))


def rows(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_pinned_evals_at_eval_steps_final_row_and_runner_eval(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, PINNED))
    name, recipe = load_recipe(f"{path}#p")
    run(recipe, name)
    ms = rows(tmp_path)
    with_evals = [m["step"] for m in ms if "test/eval/math/accuracy" in m]
    assert with_evals == [0, 2, 3]  # before steps 0 and 2, and the final row (SFT has no final() of its own)
    for m in (r for r in ms if r["step"] in with_evals):
        assert 0 <= m["test/eval/math/accuracy"] <= 1 and m["test/eval/math/problems"] == 8
        assert m["test/eval/python/length"] == 4 and m["test/eval/python/sampled"] == 1
        assert m["test/eval/chat/tokens"] > 0
    nll = [m["test/eval/chat/nll"] for m in ms if "test/eval/chat/nll" in m]
    assert nll[-1] < nll[0] - 0.5  # trained on the very conversations it scores
    err = capsys.readouterr().err
    assert "eval at step 0" in err and "eval/chat/nll" in err and "eval/math/accuracy" in err

    assert main(["eval", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "test/eval/chat/nll" in out and "test/eval/python/length 4" in out
    final = next(m for m in ms if m["step"] == 3)
    evals = [json.loads(line) for line in (tmp_path / "run" / "evals.jsonl").read_text().splitlines()]
    assert evals[-1]["test/eval/chat/nll"] == pytest.approx(final["test/eval/chat/nll"], rel=1e-4)

    assert main(["compare", str(tmp_path / "run")]) == 0  # the pinned evals are default columns
    table = capsys.readouterr().out
    assert "test/eval/chat/nll" in table and "test/eval/math/accuracy" in table


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("pinned_helpers:not_a_dict", "python eval 'pinned_helpers:not_a_dict' returned list, expected a dict"),
        ("pinned_helpers:boom", "python eval 'pinned_helpers:boom' raised RuntimeError: eval exploded"),
    ],
)
def test_bad_python_evals_are_one_line_errors(tmp_path: Path, target: str, message: str) -> None:
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, f'[[recipes.p.evals]]\nkind = "python"\ntarget = "{target}"\n', 1))
    name, recipe = load_recipe(f"{path}#p")
    with pytest.raises(UserError, match=message):
        run(recipe, name)


def test_async_python_eval_and_pass_at_k(tmp_path: Path) -> None:
    evals = f"""
    [[recipes.p.evals]]
    kind = "python"
    target = "pinned_helpers:async_one"

    [[recipes.p.evals]]
    kind = "math"
    data = {{ kind = "jsonl", path = "{WORDS}" }}
    answer_format = "auto"
    max_problems = 4
    max_tokens = 4
    temperature = 1.0
    samples = 3
    """
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, evals, 1))
    name, recipe = load_recipe(f"{path}#p")
    run(recipe, name)
    first = rows(tmp_path)[0]
    assert first["test/eval/python/one"] == 1.0
    assert first["test/eval/math/pass@3"] >= first["test/eval/math/accuracy"]


def test_eval_names() -> None:
    data = Jsonl("x.jsonl")
    assert names([MathPinned(data=data), NLLPinned(data=data)]) == ["math", "nll"]
    assert names([MathPinned(data=data), MathPinned(data=data, name="gsm")]) == ["math_0", "gsm"]
    with pytest.raises(UserError, match="named the same"):
        names([PythonPinned(target="a:b", name="x"), NLLPinned(data=data, name="x")])


def test_check_finds_two_evals_named_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`runner check` passed two evals with one name; the run stopped at its first eval, after the model loaded."""
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, f"""
        [[recipes.p.evals]]
        kind = "nll"
        name = "x"
        data = {{ kind = "jsonl", path = "{CHAT}" }}

        [[recipes.p.evals]]
        kind = "python"
        name = "x"
        target = "pinned_helpers:async_one"
        """))
    capsys.readouterr()
    assert main(["check", f"{path}#p"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {path}#p: evals: two pinned evals are named the same (x, x); set distinct `name`s", err


@pytest.mark.parametrize(("evals", "says"), [
    (f"""
        [[recipes.p.evals]]
        kind = "math"
        data = {{ kind = "jsonl", path = "{WORDS}" }}
        question_field = "nope"
        """, f"evals[0]: {WORDS}:1: expected a non-empty question in field 'nope'"),
    (f"""
        [[recipes.p.evals]]
        kind = "nll"
        data = {{ kind = "jsonl", path = "{WORDS}" }}
        """, f'evals[0]: {WORDS}:1: expected an object with a "messages" list'),
])
def test_check_reads_a_math_or_nll_evals_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], evals: str,
                                              says: str) -> None:
    """The math and nll evals' rows are checked by `runner check` (their EvalKind's check), not found wrong by the
    run's first eval after the model loaded."""
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, evals))
    capsys.readouterr()
    assert main(["check", f"{path}#p"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}#p: {says}") and "\n" not in err, err


def test_sft_killed_before_its_pinned_final_row_resumes_for_it_alone(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.toml"
    path.write_text(recipe_text(tmp_path, PINNED, 2))
    name, recipe = load_recipe(f"{path}#p")
    run(recipe, name)
    metrics = tmp_path / "run" / "metrics.jsonl"
    full = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in full] == [0, 1, 2]
    metrics.write_text("\n".join(full[:-1]) + "\n")  # killed after the last checkpoint, before the final row
    capsys.readouterr()
    run(recipe, name, dry_run=True)
    assert "still to run: pinned evals (math, chat, python) on the final weights" in capsys.readouterr().out
    run(recipe, name)
    again = rows(tmp_path)
    assert [m["step"] for m in again] == [0, 1, 2]
    assert again[-1]["test/eval/chat/nll"] == pytest.approx(json.loads(full[-1])["test/eval/chat/nll"], rel=1e-4)
    run(recipe, name)  # finished: nothing more
    assert len(rows(tmp_path)) == 3
