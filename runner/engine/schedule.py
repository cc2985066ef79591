"""Learning-rate schedules: lr(step) = recipe.lr * multiplier(step, total).

Warmup ramps linearly over the first warmup_steps steps (nanoGPT's (step+1)/(warmup+1), so step 0
already trains). After warmup the decay follows the cookbook's `lr_scheduling.py` exactly when
warmup_steps = 0 and final_frac = 0: progress p = (step - warmup) / (total - warmup), so the last
step trains at 1/total of the peak rather than wasting itself at lr 0; `final_frac` is the floor
that the decay reaches at p = 1.
"""

from __future__ import annotations

import math

from backends.types import AdamParams
from runner.recipe.schema import Constant, Cosine, Linear, Optim, Recipe, Schedule


def multiplier(schedule: Schedule, step: int, total: int) -> float:
    """The factor on the peak lr at `step` (0-based) of a run of `total` steps."""
    if total <= 0:
        raise ValueError(f"total steps must be positive, got {total}")
    warmup = schedule.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    match schedule:
        case Constant():
            return 1.0
        case Linear(final_frac=f):
            return 1.0 - (1.0 - f) * p
        case Cosine(final_frac=f):
            return f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * p))
    raise TypeError(f"unknown schedule {schedule!r}")


def adam_params(optim: Optim, lr: float) -> AdamParams:
    return AdamParams(
        learning_rate=lr,
        beta1=optim.beta1,
        beta2=optim.beta2,
        eps=optim.eps,
        weight_decay=optim.weight_decay,
        grad_clip_norm=optim.grad_clip_norm,
    )


def adam_at(recipe: Recipe, step: int, total: int) -> AdamParams:
    """The optimizer parameters for `step`: the one place the schedule meets the optimizer."""
    return adam_params(recipe.optim, recipe.lr * multiplier(recipe.schedule, step, total))
