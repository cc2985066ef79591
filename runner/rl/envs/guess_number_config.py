"""The `guess_number` env's recipe table (`algo.env = {kind = "guess_number", ...}`), implemented by runner/rl/envs/guess_number.py."""

from __future__ import annotations

from runner.recipe.common import EnvBase, PosInt


class GuessNumber(EnvBase, tag="guess_number"):
    """Multi-turn: guess a secret integer in [low, high]; the env answers "higher", "lower" or "correct".
    reward = 1 − (guesses − 1)/max_turns on success, 0 when out of turns, −1 for a reply that is not an integer."""

    low: int = 0
    high: int = 1023
    max_turns: PosInt = 10

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high must be >= low")
