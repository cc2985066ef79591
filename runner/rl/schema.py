"""The RL section of the recipe schema now lives in runner/recipe.py (the one schema file); these names
are re-exported for code written against the draft."""

from runner.recipe import (
    CISPO,
    DRO,
    KL,
    PPO,
    RL,
    Arithmetic,
    Async,
    Env,
    GuessNumber,
    ImportanceSampling,
    Loss,
    Mode,
    NoKL,
    Preference,
    PythonEnv,
    ReferenceKL,
    RLEval,
    Stream,
    Sync,
    TicTacToe,
    TwentyQuestions,
)

__all__ = [
    "CISPO", "DRO", "KL", "PPO", "RL", "Arithmetic", "Async", "Env", "GuessNumber", "ImportanceSampling", "Loss",
    "Mode", "NoKL", "Preference", "PythonEnv", "ReferenceKL", "RLEval", "Stream", "Sync", "TicTacToe",
    "TwentyQuestions",
]
