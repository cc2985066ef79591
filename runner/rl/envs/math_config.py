"""The `math` env's recipe table (`algo.env = {kind = "math", ...}`), implemented by runner/rl/envs/math.py."""

from __future__ import annotations

from typing import Literal

from runner.recipe.common import DataSource, EnvBase, NonNegFloat


class Math(EnvBase, kw_only=True):
    """Single turn: a math problem from `data`; the reply's final answer is graded against the reference (math-verify
    when installed, else runner's normalizer: runner/rewards/math_grading.py). reward = correct + format_coef·(format
    − 1), format = an answer found (in `answer_format`) and the reply ended on the stop token (cookbook math_rl)."""

    # Rows with a question and a reference answer: `question`/`problem` and `answer`/`solution` by default (GSM8K's
    # "#### x" and MATH's \boxed{x} solutions are reduced to x; a plain answer is taken as is).
    data: DataSource
    # Held-out problems for evals; None: test_size rows of `data` (shuffled by the seed) are held out.
    test_data: DataSource | None = None
    question_field: str | None = None
    answer_field: str | None = None
    # "boxed": only \boxed{x} counts (the cookbook); "auto": also "#### x", "the answer is x" or a bare number.
    answer_format: Literal["boxed", "auto"] = "boxed"
    # Appended to every question; None: the cookbook's " Write your answer in \boxed{} format." for "boxed", nothing
    # for "auto".
    question_suffix: str | None = None
    # Prepend one solved example in the answer format (the cookbook's "strawberry" example for "boxed").
    few_shot: bool = True
    format_coef: NonNegFloat = 0.1
    # "auto": math-verify when installed (the `math` extra), else the built-in normalizer.
    grader: Literal["auto", "builtin", "math_verify"] = "auto"
