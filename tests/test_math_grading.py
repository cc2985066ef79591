"""runner/rewards/math_grading.py: answer extraction and the built-in grader, on a table of known answers."""

from __future__ import annotations

import sys
import types

import pytest

from runner.rewards import math_grading as mg

# (given, truth, equal)
GRADE_TABLE = [
    # integers, commas, signs, decimals
    ("42", "42", True),
    ("1,000", "1000", True),
    ("1,234,567", "1234567", True),
    ("-5", "-5", True),
    ("-5", "5", False),
    ("7.0", "7", True),
    ("7.50", "7.5", True),
    (".5", "0.5", True),
    ("41", "42", False),
    ("4.2", "42", False),
    ("100", "1,000", False),
    # fractions in every spelling
    ("3/4", "\\frac{3}{4}", True),
    ("0.75", "\\frac{3}{4}", True),
    ("\\dfrac{3}{4}", "3/4", True),
    ("\\tfrac{3}{4}", "0.75", True),
    ("\\frac34", "3/4", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("\\frac{6}{8}", "\\frac{3}{4}", True),
    ("\\frac{3}{5}", "\\frac{3}{4}", False),
    ("-\\frac{1}{2}", "\\frac{1}{2}", False),
    ("0.33", "\\frac{1}{3}", False),
    # LaTeX noise
    ("\\left( 1, 2 \\right)", "(1,2)", True),
    ("(2, 1)", "(1,2)", False),
    ("[1, 2]", "(1, 2)", False),
    ("(1, 2, 3)", "(1, 2)", False),
    ("90^\\circ", "90", True),
    ("90^{\\circ}", "90", True),
    ("\\$18", "18", True),
    ("$18$", "18", True),
    ("\\text{(B)}", "(B)", True),
    ("x = 5", "5", True),
    ("y=-3", "-3", True),
    # units and percentages
    ("18 dollars", "18", True),
    ("18 \\text{ dollars}", "18", True),
    ("12 cm", "12", True),
    ("5 hours", "5", True),
    ("25\\%", "25", True),
    ("25%", "25", True),
    ("26 cm", "25", False),
    # expressions (sympy)
    ("2\\sqrt{2}", "\\sqrt{8}", True),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt3}{2}", True),
    ("2\\pi", "\\pi*2", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("x^2+1", "(x+1)^2", False),
    ("3\\pi", "2\\pi", False),
    # words and junk
    ("Paris", "paris", True),
    ("", "5", False),
    ("five", "5", False),
    ("none", "0", False),
]


@pytest.mark.parametrize(("given", "truth", "equal"), GRADE_TABLE)
def test_builtin_grader_table(given: str, truth: str, equal: bool) -> None:
    assert mg.grade(given, truth, grader="builtin") is equal


def test_table_is_big_and_two_sided() -> None:
    assert len(GRADE_TABLE) >= 40
    assert sum(not e for *_, e in GRADE_TABLE) >= 12


def test_none_is_never_right() -> None:
    assert mg.grade(None, "5") is False


EXTRACT_TABLE = [
    ("So the total is \\boxed{42}.", "auto", "42"),
    ("\\boxed{\\frac{1}{2}} and later \\boxed{\\frac{\\sqrt{3}}{2}}", "auto", "\\frac{\\sqrt{3}}{2}"),
    ("The set is \\boxed{\\{1, 2\\}}", "auto", "\\{1, 2\\}"),  # \\{ and \\} balance each other
    ("answer: \\boxed 7", "auto", "7"),
    ("He pays 3*4 = 12 dollars.\n#### 12", "auto", "12"),
    ("#### 1,000\n", "auto", "1,000"),
    ("We add them. The answer is 15.", "auto", "15"),
    ("The answer is $\\frac{3}{4}$.", "auto", "\\frac{3}{4}"),
    ("7", "auto", "7"),
    (" -3.5 ", "auto", "-3.5"),
    ("I think 7", "auto", None),
    ("The answer is 15.", "boxed", None),
    ("7", "boxed", None),
    ("\\boxed{7}", "boxed", "7"),
    ("unbalanced \\boxed{7", "auto", None),
]


@pytest.mark.parametrize(("reply", "mode", "answer"), EXTRACT_TABLE)
def test_extract_answer(reply: str, mode: mg.ExtractMode, answer: str | None) -> None:
    assert mg.extract_answer(reply, mode) == answer


def test_reference_answer_from_dataset_solutions() -> None:
    assert mg.reference_answer("Half of 8 is 4.\n#### 4") == "4"
    assert mg.reference_answer("So we get $\\boxed{\\dfrac{1}{2}}$.") == "\\dfrac{1}{2}"
    assert mg.reference_answer(" 12 ") == "12"


def test_end_to_end_extract_then_grade() -> None:
    reply = "Three bags of 4 apples: 3 \\times 4 = 12. \\boxed{12 \\text{ apples}}"
    assert mg.grade(mg.extract_answer(reply), mg.reference_answer("3*4=12\n#### 12"))
    assert not mg.grade(mg.extract_answer("\\boxed{13}"), "12")


def test_math_verify_used_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a (stand-in) math_verify module importable, grade() asks it first and falls back to the builtin."""
    calls: list[tuple[str, str]] = []
    fake = types.ModuleType("math_verify")
    fake.parse = lambda s, parsing_timeout=5: s  # type: ignore[attr-defined]

    def verify(gold: str, pred: str, timeout_seconds: int | None = 5) -> bool:
        assert timeout_seconds is None  # SIGALRM timeouts fail off the main thread
        calls.append((gold, pred))
        return gold == "$\\pi$" and pred == "$3.14159$"  # a judgment the builtin would not make

    fake.verify = verify  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    assert mg.math_verify_available()
    assert mg.grade("3.14159", "\\pi") is True
    assert calls == [("$\\pi$", "$3.14159$")]
    assert mg.grade("3/4", "0.75") is True  # math_verify says no, the builtin says yes
    assert mg.grade("3/4", "0.75", grader="math_verify") is False
    assert mg.grade("3.14159", "\\pi", grader="builtin") is False


def test_math_verify_grader_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    assert not mg.math_verify_available()
    with pytest.raises(ImportError, match="math-verify"):
        mg.grade("1", "1", grader="math_verify")


@pytest.mark.extras("cookbook")
def test_agrees_with_cookbook_grader_on_plain_rows() -> None:
    """The cookbook's sympy grader (the peer) agrees on the rows both are meant to handle."""
    cookbook = pytest.importorskip("tinker_cookbook.recipes.math_rl.math_grading", exc_type=ImportError)  # needs pylatexenc
    rows = [r for r in GRADE_TABLE if r[0] and "dollars" not in r[0] and "hours" not in r[0] and " cm" not in r[0]]
    rows = [r for r in rows if r[0] not in {"Paris", "five", "none", "y=-3", "x = 5", "25%", "2\\pi"}]
    rows = [r for r in rows if "x^2" not in r[0] and "[1, 2]" not in r[0] and "(2, 1)" not in r[0]]
    rows = [r for r in rows if r[0] != "\\frac{6}{8}"]  # the cookbook does not reduce fractions; we do
    disagree = [r for r in rows if bool(cookbook.grade_answer(r[0], r[1])) != r[2]]
    assert disagree == []


@pytest.mark.extras("math")
@pytest.mark.parametrize(("given", "truth", "equal"), GRADE_TABLE)
def test_auto_grader_table_with_real_math_verify(given: str, truth: str, equal: bool) -> None:
    """With the `math` extra installed, "auto" (math-verify, then the normalizer) grades the same table."""
    pytest.importorskip("math_verify", exc_type=ImportError)
    assert mg.grade(given, truth) is equal
