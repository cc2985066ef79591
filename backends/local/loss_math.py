"""The local backend's losses: the registry's functions (backends/losses.py) on the learner's logprobs, summed.

Each datum's loss is a pure function of (the learner's target logprobs, the datum's loss inputs, the config), so it
can be tested on random logprobs without a model. Every per-token loss is multiplied by the datum's `mask` when it
has one (Tinker has no mask input and relies on A = 0 at prompt positions; that is not enough for dro).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from backends import losses
from backends.local.transfer import h2d, to_device
from backends.losses import LossInputs
from backends.types import Datum, LossFn

__all__ = ["LossInputs", "batch_loss", "datum_loss", "inputs_from_datum", "resolve_config", "token_losses",
           "trained_positions"]


def resolve_config(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults overlaid with `config`; ValueError on an unknown loss or key (a typo must not be ignored)."""
    return losses.get(loss_fn).resolve(config)


def inputs_from_datum(datum: Datum, device: torch.device) -> LossInputs:
    return LossInputs.of(datum, lambda x: torch.as_tensor(x, dtype=torch.float32, device=device))


_FIELDS = ("weights", "logprobs", "advantages", "mask")


def inputs_from_data(data: list[Datum], device: torch.device) -> list[LossInputs]:
    """inputs_from_datum of each datum, every array moved in one non-blocking copy (transfer.py: no host sync
    per datum inside a step; on the CPU the same tensors as inputs_from_datum's)."""
    arrays = [getattr(d, f) for d in data for f in _FIELDS]
    present = [a for a in arrays if a is not None]
    moved = iter(to_device(present, device, np.float32))
    values = [None if a is None else next(moved) for a in arrays]
    n = len(_FIELDS)
    return [LossInputs(*values[i * n:(i + 1) * n]) for i in range(len(data))]


def token_losses(loss_fn: LossFn, lp: torch.Tensor, inp: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """Per-token loss, shaped like lp ((N,) or (N, K) for cross_entropy), before the mask."""
    return losses.get(loss_fn).token_loss(lp, inp, config)


def datum_loss(loss_fn: LossFn, lp: torch.Tensor, inp: LossInputs, config: Mapping[str, float]) -> torch.Tensor:
    """Scalar: the datum's per-token losses times its mask (if any), summed."""
    return losses.get(loss_fn).masked_sum(lp, inp, config)


def batch_loss(loss_fn: LossFn, lps: list[torch.Tensor], data: list[Datum], device: torch.device,
               config: Mapping[str, float]) -> torch.Tensor:
    """sum(datum_loss) over the datums (lps[i] belongs to data[i]). With 1-D targets the datums are concatenated
    and the loss runs once over all their tokens: the same per-token terms (so the same gradients), a handful
    of ops for a chunk instead of a handful per datum (an RL batch has 64 and more)."""
    if len(lps) == 1 or any(lp.ndim != 1 for lp in lps):
        total = sum(datum_loss(loss_fn, lp, inp, config) for lp, inp in zip(lps, inputs_from_data(data, device)))
        assert isinstance(total, torch.Tensor)
        return total

    def joined(name: str, fill: float) -> torch.Tensor | None:
        values = [getattr(d, name) for d in data]
        if all(v is None for v in values):
            return None
        parts = [np.full(d.length, fill, np.float32) if v is None else v for v, d in zip(values, data)]
        return h2d(np.concatenate(parts), device)

    inputs = LossInputs(joined("weights", 0.0), joined("logprobs", 0.0), joined("advantages", 0.0), joined("mask", 1.0))
    return datum_loss(loss_fn, torch.cat(lps), inputs, config)


def trained_positions(loss_fn: LossFn, datum: Datum, config: Mapping[str, float]) -> np.ndarray | None:
    """Per position of the datum, whether its loss can have a gradient: not where `mask` is 0, nor where the
    loss's `zero_where` input is 0 (LossSpec.zero_where: cross_entropy's weights, the policy-gradient losses'
    advantages). None: every position (nothing to skip). `config` is unused today (kept for losses whose zero set
    depends on it)."""
    spec = losses.get(loss_fn)
    keep = np.ones(datum.length, dtype=bool)
    if datum.mask is not None:
        keep &= np.asarray(datum.mask).reshape(datum.length, -1).any(axis=1)
    if spec.zero_where is not None:
        value = getattr(datum, spec.zero_where)
        if value is not None:
            keep &= (np.asarray(value).reshape(datum.length, -1) != 0).any(axis=1)
    return None if keep.all() else keep
