"""cispo: −Σ sg(clip(r, lo, hi))·lp·A; `algo.loss = {kind = "cispo", clip_low = 0.0, clip_high = 4.0}`."""

from __future__ import annotations

from collections.abc import Mapping

from backends.losses import LossInputs, LossSpec, Tensor, clip_fields, clips_ordered, loss_config, need, ratio, register


def token_loss(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    clipped = ratio(lp, inp).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -clipped.detach() * lp * need(inp.advantages)


SPEC = register(LossSpec(
    "cispo", token_loss, fields=clip_fields(0.0, 4.0), rule=clips_ordered, tinker_builtin=True,
    zero_where="advantages", title="CISPO", doc="−Σ sg(clip(r, lo, hi))·lp·A. Default one-sided (Tinker's)."))
CISPO = loss_config(SPEC, __name__)
