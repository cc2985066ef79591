"""Evals pinned in a recipe (`[[recipes.x.evals]]`, run by runner/engine/evals.py): the `PinnedEval` union.

Each kind declares its own struct beside its code, runner/engine/NAME_eval_config.py (a subclass of PinnedEvalBase,
runner/recipe/common.py), implemented by runner/engine/NAME_eval.py, which declares `EVAL = EvalKind(run, check)`;
the union is every struct those files declare (backends/configs.py `found`): nothing lists the kinds, as for
algorithms and envs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from backends.configs import found
from runner.engine.inspect_eval_config import task_file as task_file  # runner/recipe/load.py's import
from runner.recipe.common import PinnedEvalBase

# Every pinned eval, in file-name order.
PINNED_VARIANTS: tuple[type[PinnedEvalBase], ...] = found(PinnedEvalBase, "runner.engine")
if TYPE_CHECKING:
    PinnedEval = PinnedEvalBase
else:
    PinnedEval = Union[PINNED_VARIANTS]  # noqa: UP007 - built from the variants at import
