"""The `python` pinned eval's recipe table (`[[recipes.x.evals]] kind = "python"`), implemented by runner/engine/python_eval.py."""

from __future__ import annotations

from typing import ClassVar

from runner.recipe.common import Json, PinnedEvalBase, Target


class PythonPinned(PinnedEvalBase, tag="python"):
    """User code: fn(sampler, tokenizer, **args) -> {metric: float} (sync or async); `sampler` is a backend
    SamplingClient (sample, compute_logprobs)."""

    target: Target
    args: Json = {}
    # fn's positional arguments before the args (sampler, tokenizer): what `runner check` binds them after.
    TARGET_LEADING: ClassVar[int] = 2
