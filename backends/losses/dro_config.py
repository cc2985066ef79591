"""dro: −Σ (lp·A − ½·β·(lp − lp_sampler)²); `algo.loss = {kind = "dro", beta = 0.05}`."""

from __future__ import annotations

from collections.abc import Mapping

from backends.losses import LossField, LossInputs, LossSpec, Tensor, loss_config, need, register


def token_loss(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    return -(lp * need(inp.advantages) - 0.5 * cfg["beta"] * (lp - need(inp.logprobs)) ** 2)


# beta follows the docs' example; Tinker states no default.
SPEC = register(LossSpec(
    "dro", token_loss, fields=(LossField("beta", "beta", 0.05, gt=0.0, doc="weight of the quadratic penalty"),),
    tinker_builtin=True, title="DRO", doc="−Σ (lp·A − ½·β·(lp − lp_sampler)²)."))
DRO = loss_config(SPEC, __name__)
