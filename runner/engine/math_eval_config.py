"""The `math` pinned eval's recipe table (`[[recipes.x.evals]] kind = "math"`), implemented by runner/engine/math_eval.py."""

from __future__ import annotations

from typing import Literal

from runner.recipe.common import DataSource, NonNegFloat, NonNegInt, PinnedEvalBase, PosInt


class MathPinned(PinnedEvalBase, tag="math"):
    """Accuracy on math problems (the `math` env's loading, prompt and grading) at fixed sampling params:
    test/eval/<name>/accuracy, .../format."""

    data: DataSource
    question_field: str | None = None
    answer_field: str | None = None
    answer_format: Literal["boxed", "auto"] = "boxed"
    question_suffix: str | None = None
    few_shot: bool = True
    grader: Literal["auto", "builtin", "math_verify"] = "auto"
    # The first max_problems rows (None: all).
    max_problems: PosInt | None = None
    # 0 = greedy; with samples > 1 accuracy is the mean over samples (and pass@samples is logged).
    temperature: NonNegFloat = 0.0
    max_tokens: PosInt = 256
    samples: PosInt = 1
    seed: NonNegInt = 0
