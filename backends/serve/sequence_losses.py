"""The two Tinker losses that are not registry entries, computed by `runner serve` through the training client's
one-pass custom-loss path (LocalTrainingClient.forward_backward_custom).

Every loss in the registry (backends/losses.py: Tinker's token-wise built-ins and any loss registered in the server's
process) is served by name through the local backend (service.py: `loss_fn in LOSS_FNS`, a live view of the
registry). These two are not token-wise functions of a Datum: gspo reads the wire-only `sequence_ratio_mask` and
normalises over the sequence, stable_reinforce reads the sampler's records named by provenance spans.

`gspo` (GSPO-token, Zheng et al. 2025, "Group Sequence Policy Optimization", eq. 7-8), as the Tinker service
computes it: with M = {t : sequence_ratio_mask_t != 0},
    s   = exp(mean_{t in M} (sg(lp_t) - q_t))             the length-normalised sequence ratio
    s_t = sg(s) * exp(lp_t - sg(lp_t))                    its value, the token's own gradient
    L   = -sum_t min(s_t A_t, clip(s_t, lo, hi) A_t)
Tinker states no default clip; the paper's are 1 - 3e-4 and 1 + 4e-4 (sequence ratios sit close to 1).

`stable_reinforce` is Tinker's (alpha) REINFORCE variant whose exact formula is NOT public. It needs the
sampler's per-sequence records (`record_stability_info=True` when sampling) named by provenance spans; the
service here keeps those records and checks the spans against them (an unknown or mismatching sequence is
the user's error, as on the service), then trains with a documented stand-in: truncated-importance-weight
REINFORCE,
    L = -sum_t sg(min(r_t, C) / r_t) * r_t * A_t  +  kl_coeff * sum_{t sampled} (r_t - 1 - log r_t)
(value -sum_t min(r_t, C) A_t, gradient -sum_t min(r_t, C) A_t grad lp_t)
with r_t = exp(lp_t - q_t), q_t the recorded sampler logprob, C = `clip_high_threshold` (default 2.0) and
the k3 KL estimator of KL(sampler || learner) on sampled tokens. On-policy (r = 1) its gradient equals
importance_sampling's; off-policy a stale token's weight is capped at C instead of growing without bound.
Curves will not match the hosted service's exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

GSPO_DEFAULTS = {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
STABLE_REINFORCE_DEFAULTS = {"clip_high_threshold": 2.0, "kl_coeff": 0.0}
EXTRA_LOSSES = {"gspo": GSPO_DEFAULTS, "stable_reinforce": STABLE_REINFORCE_DEFAULTS}


def resolve(loss_fn: str, config: Mapping[str, float | str] | None) -> dict[str, float]:
    out = dict(EXTRA_LOSSES[loss_fn])
    for key, value in (config or {}).items():
        if key not in out:
            raise ValueError(f"loss {loss_fn!r} takes no config key {key!r} (accepted: {', '.join(out)})")
        out[key] = float(value)
    return out


def gspo(lp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, cfg: Mapping[str, float]) -> torch.Tensor:
    m = (mask != 0).to(lp.dtype)
    n = m.sum().clamp_min(1.0)
    s = torch.exp(((lp.detach() - q) * m).sum() / n)
    s_t = s.detach() * torch.exp(lp - lp.detach())
    clipped = s_t.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.minimum(s_t * adv, clipped * adv).sum()


def stable_reinforce(lp: torch.Tensor, q: torch.Tensor, adv: torch.Tensor, sampled: torch.Tensor,
                     cfg: Mapping[str, float]) -> torch.Tensor:
    log_r = lp - q
    r = torch.exp(log_r)
    capped = (r.detach().clamp(max=cfg["clip_high_threshold"]) / r.detach()).nan_to_num(0.0)
    loss = -(capped * r * adv).sum()
    if cfg["kl_coeff"]:
        k3 = torch.exp(log_r) - 1 - log_r
        loss = loss + cfg["kl_coeff"] * (k3 * sampled).sum()
    return loss
