"""The `python` env's recipe table (`algo.env = {kind = "python", ...}`), implemented by runner/rl/envs/python.py."""

from __future__ import annotations

from typing import Any

from runner.recipe.common import EnvBase, Target


class PythonEnv(EnvBase, tag="python", kw_only=True):
    """User code: target "pkg.mod:fn" is called as fn(**args) and returns a dataset builder, a callable
    builder(ctx: runner.rl.envs.EnvContext) -> (train: RLDataset, test: RLDataset | None).
    train_size / test_size are not used (the builder decides)."""

    target: Target
    args: dict[str, Any] = {}
