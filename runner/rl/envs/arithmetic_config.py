"""The `arithmetic` env's recipe table (`algo.env = {kind = "arithmetic", ...}`), implemented by runner/rl/envs/arithmetic.py."""

from __future__ import annotations

from runner.recipe.common import EnvBase


class Arithmetic(EnvBase):
    """Single turn: "What is x + y?". reward = correct + 0.1·(format − 1), format = an integer reply that ended
    on the stop token (the cookbook's math_rl `arithmetic`)."""

    min_value: int = 0
    max_value: int = 99
    # Prepend one solved example ("What is 4 + 5?" → "9") so a small model sees the answer format.
    few_shot: bool = True

    def __post_init__(self) -> None:
        if self.max_value < self.min_value:
            raise ValueError("max_value must be >= min_value")
