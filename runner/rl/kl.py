"""KL terms on action tokens (mask > 0), as the cookbook computes them (rl/metrics.py).

- `apply_kl_penalty`: a penalty towards a reference policy folded into the advantages, centred on the
  batch mean so it reshapes credit without shifting the mean advantage:
  d_t = (lp_sampler − lp_ref)·mask, adv_t += coef·mask·(mean(d) − d_t); metric kl_policy_base = mean(d).
- `kl_sample_train`: how far the learner's logprobs (from forward_backward) are from the sampler's, a check
  that sampling and training see the same model: optim/kl_sample_train_v1 = mean(diff),
  v2 = ½·mean(diff²), optim/entropy = −mean(lp_sampler).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from backends.base import SamplingClient
from backends.types import Datum


async def reference_logprobs(client: SamplingClient, data_D: Sequence[Datum]) -> list[np.ndarray]:
    """The reference model's logprob of every target token (compute_logprobs of the full sequence, minus
    its leading None, lines up with target_tokens)."""
    outs = await asyncio.gather(*(client.compute_logprobs(d.full_sequence) for d in data_D))
    return [np.asarray(out[1:], dtype=np.float32) for out in outs]


def _rl(d: Datum) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprobs, advantages, mask) of an RL datum (runner/rl/datums.py always sets all three)."""
    assert d.logprobs is not None and d.advantages is not None and d.mask is not None
    return d.logprobs, d.advantages, d.mask


def apply_kl_penalty(
    data_D: Sequence[Datum], ref_logprobs_D: Sequence[np.ndarray], coef: float
) -> tuple[list[Datum], dict[str, float]]:
    parts_D = [_rl(d) for d in data_D]
    diffs_D = [(lp - ref) * mask for (lp, _, mask), ref in zip(parts_D, ref_logprobs_D, strict=True)]
    n = float(sum(mask.sum() for _, _, mask in parts_D))
    mean = float(sum(x.sum() for x in diffs_D)) / n if n else 0.0
    out = [
        replace(d, advantages=adv + coef * mask * (mean - diff))
        for d, (_, adv, mask), diff in zip(data_D, parts_D, diffs_D, strict=True)
    ]
    return out, {"kl_policy_base": mean}


def kl_sample_train(data_D: Sequence[Datum], train_logprobs_D: Sequence[np.ndarray]) -> dict[str, float]:
    parts_D = [_rl(d) for d in data_D]
    sampled = np.concatenate([lp[mask > 0] for lp, _, mask in parts_D] or [np.zeros(0)])
    trained = np.concatenate(
        [np.asarray(lp)[mask > 0] for (_, _, mask), lp in zip(parts_D, train_logprobs_D, strict=True)]
        or [np.zeros(0)]
    )
    if sampled.size == 0:
        return {}
    diff = sampled - trained
    return {
        "optim/kl_sample_train_v1": float(diff.mean()),
        "optim/kl_sample_train_v2": float(0.5 * (diff**2).mean()),
        "optim/entropy": float(-sampled.mean()),
    }
