"""The `twenty_questions` env's recipe table (`algo.env = {kind = "twenty_questions", ...}`), implemented by runner/rl/envs/twenty_questions.py."""

from __future__ import annotations

from runner.recipe.common import EnvBase, NonNegInt, PosInt


class TwentyQuestions(EnvBase, tag="twenty_questions"):
    """Multi-turn: find an object from a fixed table by yes/no questions about its attributes, then
    "Guess: <name>". reward 1 for a correct guess within max_turns, else 0. Test objects are held out."""

    # The table needs about five well-chosen questions; 12 turns keep a byte-level conversation inside the
    # tiny model's 2048-token context at max_tokens 32 (longer prompts drop the group: ContextOverflow).
    max_turns: PosInt = 12
    train_size: PosInt = 2_000
    test_size: NonNegInt = 4
