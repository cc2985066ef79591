"""Tinker's built-in losses (tinker-sdk.md §3), computed per token and SUMMED (never averaged).

Each datum's loss is a pure function of (the learner's target logprobs, the datum's loss inputs, the
config), so it can be tested on random logprobs without a model. Notation: lp = learner logprob of the
target, q = sampler logprob (`Datum.logprobs`), A = advantage, r = exp(lp - q), sg = stop-gradient.

One departure from Tinker: our Datum may carry `mask`, and every per-token loss is multiplied by it.
Tinker has no mask input and relies on A = 0 at prompt positions; that is not enough for dro, whose
quadratic term does not multiply by A (cookbook-algorithms.md §1.6).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from backends.types import LOSS_FNS, Datum, LossFn

# loss_fn_config keys each loss accepts, with Tinker's defaults (tinker-sdk.md §3.3-3.5; dro's beta
# follows the docs example, Tinker states no default).
DEFAULT_CONFIG: dict[LossFn, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}


@dataclass(frozen=True)
class LossInputs:
    """A datum's loss inputs as tensors on the learner's device (None when the datum has none)."""

    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def resolve_config(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults overlaid with `config`; ValueError on an unknown loss or key (a typo must not be ignored)."""
    if loss_fn not in LOSS_FNS:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; expected one of: {', '.join(LOSS_FNS)}")
    out = dict(DEFAULT_CONFIG[loss_fn])
    for key, value in (config or {}).items():
        if key not in out:
            allowed = ", ".join(out) or "none"
            raise ValueError(f"loss {loss_fn!r} takes no config key {key!r} (accepted: {allowed})")
        out[key] = float(value)
    return out


def inputs_from_datum(datum: Datum, device: torch.device) -> LossInputs:
    def t(x):
        return None if x is None else torch.as_tensor(x, dtype=torch.float32, device=device)

    return LossInputs(t(datum.weights), t(datum.logprobs), t(datum.advantages), t(datum.mask))


def token_losses(loss_fn: LossFn, lp: torch.Tensor, inp: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """Per-token loss, shaped like lp ((N,) or (N, K) for cross_entropy), before the mask."""
    if loss_fn == "cross_entropy":
        assert inp.weights is not None
        return -inp.weights * lp
    assert inp.logprobs is not None and inp.advantages is not None
    q, adv = inp.logprobs, inp.advantages
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * config["beta"] * (lp - q) ** 2)
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -ratio * adv
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, clipped * adv)
    if loss_fn == "cispo":
        return -clipped.detach() * lp * adv
    raise ValueError(f"unknown loss_fn {loss_fn!r}")


def datum_loss(loss_fn: LossFn, lp: torch.Tensor, inp: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """Scalar: the datum's per-token losses times its mask (if any), summed."""
    per_token = token_losses(loss_fn, lp, inp, config)
    if inp.mask is not None:
        mask = inp.mask if per_token.ndim == 1 else inp.mask[:, None]
        per_token = per_token * mask
    return per_token.sum()


def batch_loss(loss_fn: LossFn, lps: list[torch.Tensor], data: list[Datum], device: torch.device,
               config: Mapping[str, float]) -> torch.Tensor:
    """sum(datum_loss) over the datums (lps[i] belongs to data[i]). With 1-D targets the datums are concatenated
    and the loss runs once over all their tokens: the same per-token terms (so the same gradients), a handful
    of ops for a chunk instead of a handful per datum (an RL batch has 64 and more)."""
    if len(lps) == 1 or any(lp.ndim != 1 for lp in lps):
        total = sum(datum_loss(loss_fn, lp, inputs_from_datum(d, device), config) for lp, d in zip(lps, data))
        assert isinstance(total, torch.Tensor)
        return total

    def joined(name: str, fill: float) -> torch.Tensor | None:
        values = [getattr(d, name) for d in data]
        if all(v is None for v in values):
            return None
        parts = [np.full(d.length, fill, np.float32) if v is None else v for v, d in zip(values, data)]
        return torch.as_tensor(np.concatenate(parts), device=device)

    inputs = LossInputs(joined("weights", 0.0), joined("logprobs", 0.0), joined("advantages", 0.0), joined("mask", 1.0))
    return datum_loss(loss_fn, torch.cat(lps), inputs, config)
