"""The `verifiers` env's recipe table (`algo.env = {kind = "verifiers", ...}`), implemented by runner/rl/envs/verifiers_env.py."""

from __future__ import annotations

from typing import Any

from runner.recipe.common import EnvBase, NonNegInt


class Verifiers(EnvBase, tag="verifiers", kw_only=True):
    """Any installed `verifiers` environment (chat; single- or multi-turn, tools included), rolled out through the
    recipe's sampler and renderer by an in-process OpenAI client; its rubric's reward is the reward and its metrics
    are logged. train_size rows of its dataset (repeated as needed), test_size of its eval dataset (else held out)."""

    # What `verifiers.load_environment` takes: an installed environment module ("reverse_text", "owner/env-id").
    module: str
    # Keyword arguments of the module's load_environment.
    args: dict[str, Any] = {}
    # The row order's seed (None: the recipe's).
    seed: NonNegInt | None = None
    # The model name the environment's requests carry (some environments log it).
    model_name: str = "runner"
