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
from runner.types import Datum


async def reference_logprobs(client: SamplingClient, data_D: Sequence[Datum]) -> list[np.ndarray]:
    """The reference model's logprob of every target token (compute_logprobs of the full sequence, minus
    its leading None, lines up with target_tokens)."""
    outs = await asyncio.gather(*(client.compute_logprobs(d.full_sequence) for d in data_D))
    return [np.asarray(out[1:], dtype=np.float32) for out in outs]


def apply_kl_penalty(
    data_D: Sequence[Datum], ref_logprobs_D: Sequence[np.ndarray], coef: float
) -> tuple[list[Datum], dict[str, float]]:
    diffs_D = [(d.logprobs - ref) * d.mask for d, ref in zip(data_D, ref_logprobs_D, strict=True)]
    n = float(sum(d.mask.sum() for d in data_D))
    mean = float(sum(x.sum() for x in diffs_D)) / n if n else 0.0
    out = [
        replace(d, advantages=d.advantages + coef * d.mask * (mean - diff))
        for d, diff in zip(data_D, diffs_D, strict=True)
    ]
    return out, {"kl_policy_base": mean}


def kl_sample_train(data_D: Sequence[Datum], train_logprobs_D: Sequence[np.ndarray]) -> dict[str, float]:
    sampled = np.concatenate([d.logprobs[d.mask > 0] for d in data_D] or [np.zeros(0)])
    trained = np.concatenate(
        [np.asarray(lp)[d.mask > 0] for d, lp in zip(data_D, train_logprobs_D, strict=True)] or [np.zeros(0)]
    )
    if sampled.size == 0:
        return {}
    diff = sampled - trained
    return {
        "optim/kl_sample_train_v1": float(diff.mean()),
        "optim/kl_sample_train_v2": float(0.5 * (diff**2).mean()),
        "optim/entropy": float(-sampled.mean()),
    }
