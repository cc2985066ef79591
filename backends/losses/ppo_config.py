"""ppo: −Σ min(r·A, clip(r, lo, hi)·A); `algo.loss = {kind = "ppo", clip_low = 0.8, clip_high = 1.2}`."""

from __future__ import annotations

from collections.abc import Mapping

from backends.losses import LossInputs, LossSpec, Tensor, clip_fields, clips_ordered, loss_config, need, ratio, register


def token_loss(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    r, adv = ratio(lp, inp), need(inp.advantages)
    clipped = r.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(r * adv).minimum(clipped * adv)


SPEC = register(LossSpec(
    "ppo", token_loss, fields=clip_fields(0.8, 1.2), rule=clips_ordered, tinker_builtin=True, zero_where="advantages",
    title="PPO", doc="−Σ min(r·A, clip(r, lo, hi)·A). The bounds are on the ratio itself, not epsilons."))
PPO = loss_config(SPEC, __name__)
