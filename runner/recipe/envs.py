"""The RL environments a recipe's `algo.env` may name (`kind = ...`): the `Env` union.

Each env declares its own struct beside its code, runner/rl/envs/NAME_config.py (a subclass of EnvBase,
runner/recipe/common.py), implemented by runner/rl/envs/NAME.py; the union is every struct those files declare
(backends/configs.py `found`), so `runner check` validates a recipe without importing any env, and a new env
is its two files, with no list to edit (docs/extending.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from backends.configs import found
from runner.recipe.common import EnvBase

# Every env, in file-name order.
ENV_VARIANTS: tuple[type[EnvBase], ...] = found(EnvBase, "runner.rl.envs")
if TYPE_CHECKING:
    Env = EnvBase
else:
    Env = Union[ENV_VARIANTS]  # noqa: UP007 - built from the variants at import
