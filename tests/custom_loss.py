"""A user's own loss, as a user writes it: a module that registers a LossSpec (tests/test_losses_registry.py names
it from a recipe as `custom_loss:LINEAR_PG`). No backend, schema or RL edit; torch is not imported here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends import losses


def _linear_pg(lp: Any, inp: losses.LossInputs, cfg: Mapping[str, float]) -> Any:
    """Plain REINFORCE with a quadratic pull toward the sampler: −Σ (coef·lp·A − ½·tau·(lp − q)²)."""
    assert inp.advantages is not None and inp.logprobs is not None
    return -(cfg["coef"] * lp * inp.advantages - 0.5 * cfg["tau"] * (lp - inp.logprobs) ** 2)


LINEAR_PG = losses.register(losses.LossSpec(
    "test_linear_pg", _linear_pg,
    fields=(losses.LossField("coef", "coef", 1.0, gt=0.0), losses.LossField("tau", "tau", 0.0, ge=0.0)),
    doc="−Σ (coef·lp·A − ½·tau·(lp − q)²)"))
NOT_A_LOSS = 3
