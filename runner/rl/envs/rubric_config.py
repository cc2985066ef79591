"""The `rubric` env's recipe table (`algo.env = {kind = "rubric", ...}`), implemented by runner/rl/envs/rubric.py."""

from __future__ import annotations

from runner.recipe.common import Base, DataSource, EnvBase, NonNegFloat, PosInt, RecipeRef, Target


class JudgeModel(Base, tag_field="kind", tag="model"):
    """A model that grades in text: a chained run's final weights (init_from), a saved sampler checkpoint, or a base
    model (`model`; default the recipe's own)."""

    init_from: RecipeRef | None = None
    checkpoint: str | None = None
    model: str | None = None
    # The judge's reply (the cookbook's grader gets 2048 to reason before its <score>).
    max_tokens: PosInt = 256
    temperature: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        if self.init_from is not None and self.checkpoint is not None:
            raise ValueError("give init_from or checkpoint, not both")


class PythonGrader(Base, tag_field="kind", tag="python"):
    """fn(messages, reply, item) -> a score in [0, 1] (number or bool), or a judge's text (parsed as a model's)."""

    target: Target


class Rubric(EnvBase, kw_only=True):
    """Single turn; a judge grades the reply against each rubric item of its prompt (cookbook rubric recipe): reward =
    mean item score in [0, 1] + format_coef·(ended_on_stop − 1); judge text that gives no score counts 0
    (runner/rl/envs/rubric.py)."""

    # Rows {prompt or messages, rubric: [items] or one string}, or the cookbook's {convo, rubric_items: [{rubric_str}]}.
    data: DataSource
    test_data: DataSource | None = None
    judge: JudgeModel | PythonGrader = JudgeModel()
    format_coef: NonNegFloat = 0.1
