"""importance_sampling: the RL default, −Σ r·A; `algo.loss = {kind = "importance_sampling"}`."""

from __future__ import annotations

from collections.abc import Mapping

from backends.losses import LossInputs, LossSpec, Tensor, loss_config, need, ratio, register


def token_loss(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    return -ratio(lp, inp) * need(inp.advantages)


SPEC = register(LossSpec(
    "importance_sampling", token_loss, tinker_builtin=True, zero_where="advantages", title="ImportanceSampling",
    doc="−Σ r·A, r = exp(lp − lp_sampler)."))
ImportanceSampling = loss_config(SPEC, __name__)
