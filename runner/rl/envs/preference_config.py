"""The `preference` env's recipe table (`algo.env = {kind = "preference", ...}`), implemented by runner/rl/envs/preference.py."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from runner.recipe.common import Base, EnvBase, NonNegFloat, RecipeRef, Target


class ModelJudge(Base, tag_field="kind", tag="model"):
    """A trained pairwise reward model as the preference judge: P(a better) from the logprobs of its "A"/"B" label
    tokens, averaged over both orders (runner/rewards/judge.py). When the RL recipe is chained (init_from), the
    final eval also reports test/win_rate_vs_init: the final policy's replies against the initial policy's, judged by
    it on the test prompts."""

    init_from: RecipeRef


class Preference(EnvBase):
    """Single turn; the group's replies are judged pairwise, round-robin, both orders; reward = win fraction
    + format_coef·(ended_on_stop − 1). The judge is fn(prompt, a, b) -> P(a better) in [0, 1]."""

    prompts: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["Who are you?"])
    # Held-out prompts for evals (test_size is not used here).
    test_prompts: list[str] = []
    # None: the shorter reply wins (the cookbook's `shorter` recipe); "pkg.mod:fn"; or {kind = "model", init_from =
    # "#reward_model_recipe"}: a trained reward model (algo kind reward_model), run first by `runner run`.
    judge: Target | ModelJudge | None = None
    format_coef: NonNegFloat = 0.1
