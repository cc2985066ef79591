"""cross_entropy: SFT's loss, −Σ w·lp; offered to no RL recipe (in_rl=False), so it declares no recipe variant."""

from __future__ import annotations

from collections.abc import Mapping

from backends.losses import LossInputs, LossSpec, Tensor, need, register


def token_loss(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    return -need(inp.weights) * lp


SPEC = register(LossSpec(
    "cross_entropy", token_loss, inputs=("weights",), multi_target=True, zero_where="weights", in_rl=False,
    tinker_builtin=True, doc="−Σ w·lp (SFT; (N, K) targets: top-K / soft-target cross entropy)."))
