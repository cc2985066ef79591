"""Final answers of math replies: extract them and grade them against a reference.

`extract_answer(reply)` finds the final answer: the last `\\boxed{...}` (nested braces allowed), else the last
`#### ...` line (GSM8K), else "the answer is ...", else (mode "auto" only) a reply that is a bare number.
`grade(given, truth)` says whether two answers are the same: by `math-verify` when it is importable (the optional
extra `math`), else by the built-in normalizer here: LaTeX noise removed (`\\left`, `\\dfrac`, `^\\circ`, `\\$`,
`\\%`, `\\text{units}`, trailing unit words), numbers compared exactly as fractions (`3/4` = `\\frac{3}{4}` =
`0.75`, `1,000` = `1000`), tuples element by element, and small expressions by sympy (`2\\sqrt{2}` = `\\sqrt{8}`).
"""

from __future__ import annotations

import functools
import importlib
import re
from fractions import Fraction
from functools import lru_cache
from typing import Literal

ExtractMode = Literal["boxed", "auto"]
Grader = Literal["auto", "builtin", "math_verify"]

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s$]+)")
_GSM8K = re.compile(r"^\s*####\s*:?\s*(.+?)\s*$", re.MULTILINE)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?\s*(.+?)\s*(?:\.\s|\.?$|\n)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced), or of `\\boxed 5`; None if none."""
    found: str | None = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1]
    if found is None:
        bare = _BOXED_BARE.findall(text)
        if bare:
            found = bare[-1]
    return None if found is None else found.strip()


def extract_answer(text: str, mode: ExtractMode = "auto") -> str | None:
    """The reply's final answer, or None when it has none in the form `mode` asks for.

    "boxed": only `\\boxed{}` counts (the cookbook's MathEnv format check). "auto": `\\boxed{}`, else the last
    `#### x` line, else the last "the answer is x", else the whole reply when it is one number (a small model's
    bare "7")."""
    boxed = extract_boxed(text)
    if boxed is not None or mode == "boxed":
        return boxed
    hashes = _GSM8K.findall(text)
    if hashes:
        return hashes[-1].strip()
    said = _ANSWER_IS.findall(text)
    if said:
        return said[-1].strip().rstrip(".").strip("$ ")
    bare = text.strip().rstrip(".").strip()
    if _NUMBER.fullmatch(bare):
        return bare
    return None


def reference_answer(solution: str) -> str:
    """The reference answer in a dataset's solution text: `\\boxed{}` (MATH), `#### x` (GSM8K), else the text."""
    boxed = extract_boxed(solution)
    if boxed is not None:
        return boxed
    hashes = _GSM8K.findall(solution)
    return hashes[-1].strip() if hashes else solution.strip()


# ---------------------------------------------------------------- normalizing

_UNIT_WORDS = (
    "dollars?|cents?|euros?|pounds?|yuan|units?|cm|mm|km|m|meters?|metres?|centimeters?|kilometers?|inches|inch|"
    "feet|foot|ft|miles?|yards?|hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?|degrees?|"
    "kg|g|grams?|kilograms?|pounds|lbs?|liters?|litres?|ml|gallons?|people|persons?|students?|apples?|items?|"
    "points?|pages?|books?|times|percent|sq|square|cubic"
)
_TRAILING_UNITS = re.compile(rf"(?:\s*\b(?:{_UNIT_WORDS})\b\.?(?:\^?\{{?\d\}}?)?)+\s*$", re.IGNORECASE)
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox|mathbf)\s*\{([^{}]*)\}")
_FRAC_BRACED = re.compile(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac\s*(\d)\s*(\d)")
_SQRT_SHORT = re.compile(r"\\sqrt\s*(\d+|[a-zA-Z])")
_VAR_PREFIX = re.compile(r"^[a-zA-Z]\w{0,2}\s*=\s*(?!=)")
_THOUSANDS = re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])")


def normalize(answer: str) -> str:
    """A canonical string: LaTeX spacing, sizing, units, currency, percent and degree marks removed."""
    s = answer.strip().strip("$").strip()
    for old, new in (
        ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", " "), ("~", " "),
        ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("\\displaystyle", ""),
        ("^{\\circ}", ""), ("^\\circ", ""), ("°", ""), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""),
        ("\\cdot", "*"), ("\\times", "*"), ("\\le", "<="), ("\\ge", ">="), ("\u2212", "-"),
    ):  # fmt: skip
        s = s.replace(old, new)
    s = _TEXT.sub(lambda m: " " + m.group(1) + " ", s)
    s = _TRAILING_UNITS.sub("", s).strip()
    s = _VAR_PREFIX.sub("", s)
    s = _THOUSANDS.sub(lambda m: m.group(1).replace(",", ""), s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = s.replace(" ", "").rstrip(".")
    if s.startswith("."):
        s = "0" + s
    return s


def to_fraction(s: str) -> Fraction | None:
    """An exact number for a normalized answer: `-3`, `0.75`, `3/4`, `\\frac{3}{4}`, `-\\frac{3}{4}`, `1e3`."""
    s = s.strip("{}")
    m = _FRAC_BRACED.fullmatch(s.lstrip("-+"))
    if m:
        a, b = to_fraction(m.group(1)), to_fraction(m.group(2))
        if a is None or b is None or b == 0:
            return None
        return -(a / b) if s.startswith("-") else a / b
    if re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?(/[-+]?\d+(\.\d*)?)?", s):
        try:
            return Fraction(s)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _split_tuple(s: str) -> list[str] | None:
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and "," in s:
        return [p for p in s[1:-1].split(",")]
    return None


# ---------------------------------------------------------------- sympy (optional)

_SAFE_EXPR = re.compile(r"[0-9a-zA-Z+\-*/^().\\{} ]+")


def _latex_to_sympy(s: str) -> str:
    s = _FRAC_BRACED.sub(r"((\1)/(\2))", s)
    s = _FRAC_BRACED.sub(r"((\1)/(\2))", s)  # one level of nesting
    s = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("^", "**").replace("{", "(").replace("}", ")")
    return s


@lru_cache(maxsize=4096)
def _sympy_equal(a: str, b: str) -> bool:
    """a == b as expressions, when sympy is installed and both look like small, safe expressions."""
    try:
        sympy = importlib.import_module("sympy")
        parser = importlib.import_module("sympy.parsing.sympy_parser")
    except ImportError:
        return False
    exprs = []
    for s in (a, b):
        # Guard against pathological inputs (huge powers, long strings) before sympy sees them.
        if len(s) > 60 or not _SAFE_EXPR.fullmatch(s) or re.search(r"\^\{?\d{3,}|\*\*\d{3,}", s):
            return False
        text = _latex_to_sympy(s)
        if "\\" in text or len(re.findall(r"[a-zA-Z]{2,}", text.replace("sqrt", "").replace("pi", ""))) > 0:
            return False
        try:
            transformations = (*parser.standard_transformations, parser.implicit_multiplication_application)
            exprs.append(parser.parse_expr(text, transformations=transformations, evaluate=True))
        except Exception:  # noqa: BLE001 - anything sympy cannot parse is simply not equal
            return False
    try:
        return bool(sympy.simplify(exprs[0] - exprs[1]) == 0)
    except Exception:  # noqa: BLE001 - as above
        return False


# ---------------------------------------------------------------- grading


def _builtin_equal(given: str, truth: str) -> bool:
    g, t = normalize(given), normalize(truth)
    if not g or not t:
        return False
    if g == t or g.lower() == t.lower():
        return True
    gn, tn = to_fraction(g), to_fraction(t)
    if gn is not None and tn is not None:
        return gn == tn or abs(gn - tn) <= 1e-6 * max(1, abs(tn))
    gt, tt = _split_tuple(g), _split_tuple(t)
    if gt is not None and tt is not None:
        return g[0] + g[-1] == t[0] + t[-1] and len(gt) == len(tt) and all(map(_builtin_equal, gt, tt))
    if gt is not None or tt is not None:
        return False
    return _sympy_equal(g, t)


def math_verify_available() -> bool:
    try:
        importlib.import_module("math_verify")
    except ImportError:
        return False
    return True


def _math_verify_equal(given: str, truth: str) -> bool:
    """math-verify's judgment. Its own timeouts use SIGALRM, which works only in the main thread (envs grade in a
    worker thread, under their own time limit), so they are turned off."""
    mv = importlib.import_module("math_verify")
    wrap = [s if s.startswith("$") else f"${s}$" for s in (given, truth)]
    try:
        gold, pred = (mv.parse(s, parsing_timeout=None) for s in (wrap[1], wrap[0]))
        return bool(mv.verify(gold, pred, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - a grader failure is a wrong answer, not a crashed run
        return False


@functools.cache
def warm_up(grader: Grader = "auto") -> None:
    """Import and exercise the grader once, outside any time limit: math-verify's first call imports sympy and its
    LaTeX parser (seconds on a loaded machine), which under an env's GRADE_TIMEOUT_S would mark the run's first
    answers wrong."""
    grade("\\frac{1}{2}", "0.5", grader if grader != "math_verify" or math_verify_available() else "builtin")


def grade(given: str | None, truth: str, grader: Grader = "auto") -> bool:
    """Whether `given` (an extracted answer; None = none found) is the reference answer `truth`.

    "auto": math-verify when installed, and the built-in normalizer as well (either saying equal is equal:
    math-verify misses some unit and comma forms the normalizer handles). "builtin" / "math_verify": one only."""
    if given is None or not given.strip():
        return False
    if grader != "builtin" and math_verify_available():
        if _math_verify_equal(given, truth):
            return True
        if grader == "math_verify":
            return False
    elif grader == "math_verify":
        raise ImportError("grader 'math_verify' needs the math-verify package (pip install 'runner[math]')")
    return _builtin_equal(given, truth)
