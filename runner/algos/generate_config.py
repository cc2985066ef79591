"""The `generate` algorithm's recipe table (`algo = {kind = "generate", ...}`), implemented by
runner/algos/generate.py."""

from __future__ import annotations

from runner.algos.distill_config import Teacher
from runner.recipe.common import AlgoBase, DataSource, NonNegFloat, PosInt


class Generate(AlgoBase):
    """Sample a teacher over prompts and write the conversations (without `system`) to the run dir's generated/,
    for an SFT recipe to train on (`data = {kind = "run_output", run = "#this"}`): the first stage of prompt
    distillation. Resumable and seeded like any run; it trains nothing."""


    # Rows {"messages": [...]} ending with the user's turn.
    prompts: DataSource
    # The teacher's system prompt, which the written conversations leave out.
    system: str | None = None
    teacher: Teacher = Teacher()
    # Replies per prompt.
    n: PosInt = 1
    # Prompts per step.
    batch_size: PosInt = 64
    max_tokens: PosInt = 64
    # 0 = greedy.
    temperature: NonNegFloat = 0.0
    # Keep replies cut off by max_tokens (default: drop them, and count them).
    keep_truncated: bool = False


# A user's algorithm: an `AlgoSpec` in their module (runner/engine/spec.py, examples/custom_algo.py).
