"""backends/local/loss_math.py against independent numpy implementations of Tinker's formulas
(docs/losses.md "Formulas"): values and gradients w.r.t. the learner's logprobs, float64, random inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.local.loss_math import LossInputs, datum_loss, inputs_from_datum, resolve_config
from backends.types import Datum

N = 23
RNG = np.random.default_rng(0)


def _inputs(mask: bool, k: int | None = None):
    lp = -np.abs(RNG.normal(size=(N,) if k is None else (N, k))) * 2
    q = lp + RNG.normal(scale=0.3, size=lp.shape)  # ratios land on both sides of the clip bounds
    adv = RNG.normal(size=(N,))
    w = RNG.uniform(0, 1, size=lp.shape)
    m = (RNG.uniform(size=(N,)) < 0.6).astype(np.float64) if mask else None
    return lp, q, adv, w, m


def _torch_loss(loss_fn, lp, q, adv, w, m, config):
    def t(x):
        return None if x is None else torch.tensor(x, dtype=torch.float64)

    lp_t = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    inp = LossInputs(weights=t(w), logprobs=t(q) if loss_fn != "cross_entropy" else None,
                     advantages=t(adv) if loss_fn != "cross_entropy" else None, mask=t(m))
    loss = datum_loss(loss_fn, lp_t, inp, resolve_config(loss_fn, config))
    (grad,) = torch.autograd.grad(loss, lp_t)
    return loss.item(), grad.numpy()


def _reference(loss_fn, lp, q, adv, w, m, cfg):
    """(per-token loss, d loss / d lp), written out by hand."""
    r = np.exp(lp - q)
    if loss_fn == "cross_entropy":
        loss, grad = -w * lp, -w
    elif loss_fn == "importance_sampling":
        loss, grad = -r * adv, -r * adv
    elif loss_fn == "ppo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        clipped = np.clip(r, lo, hi)
        unclipped_wins = r * adv <= clipped * adv
        loss = -np.where(unclipped_wins, r * adv, clipped * adv)
        inside = (r > lo) & (r < hi)
        grad = -np.where(unclipped_wins | inside, r * adv, 0.0)
    elif loss_fn == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        clipped = np.clip(r, lo, hi)
        loss, grad = -clipped * lp * adv, -clipped * adv  # the clipped ratio is a constant (stop-gradient)
    elif loss_fn == "dro":
        beta = cfg.get("beta", 0.05)
        loss = -(lp * adv - 0.5 * beta * (lp - q) ** 2)
        grad = -(adv - beta * (lp - q))
    if m is not None:
        mm = m if loss.ndim == 1 else m[:, None]
        loss, grad = loss * mm, grad * mm
    return loss.sum(), grad


CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", {}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", {}),
    ("dro", {"beta": 0.7}),
]


@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("loss_fn,config", CASES)
def test_loss_matches_formula(loss_fn, config, mask):
    lp, q, adv, w, m = _inputs(mask)
    value, grad = _torch_loss(loss_fn, lp, q, adv, w, m, config)
    ref_value, ref_grad = _reference(loss_fn, lp, q, adv, w, m, config)
    assert value == pytest.approx(ref_value, abs=1e-6, rel=1e-9)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mask", [False, True])
def test_cross_entropy_top_k_targets(mask):
    lp, _, _, w, m = _inputs(mask, k=5)
    value, grad = _torch_loss("cross_entropy", lp, None, None, w, m, {})
    mm = np.ones(N) if m is None else m
    assert value == pytest.approx(float(np.sum(-w * lp * mm[:, None])), abs=1e-6)
    np.testing.assert_allclose(grad, -w * mm[:, None], atol=1e-6, rtol=0)
    assert grad.shape == (N, 5)


def test_clipping_is_exercised():
    # Guards the tests above: they only prove clipping if some ratios fall outside the bounds.
    lp, q, *_ = _inputs(False)
    r = np.exp(lp - q)
    assert (r < 0.8).any() and (r > 1.2).any() and ((r > 0.8) & (r < 1.2)).any()


def test_mask_zero_removes_dro_quadratic_term():
    # The reason for `mask`: with A = 0 on prompt tokens, dro still pulls lp towards q there unless masked.
    lp, q, _, _, _ = _inputs(False)
    adv = np.zeros(N)
    unmasked, _ = _torch_loss("dro", lp, q, adv, None, None, {})
    masked, grad = _torch_loss("dro", lp, q, adv, None, np.zeros(N), {})
    assert unmasked > 0 and masked == 0 and not grad.any()


def test_resolve_config():
    assert resolve_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("cispo", {"clip_high_threshold": 2}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 2.0}
    assert resolve_config("dro", None) == {"beta": 0.05}
    with pytest.raises(ValueError, match="takes no config key 'clip_hi'"):
        resolve_config("ppo", {"clip_hi": 1.3})
    with pytest.raises(ValueError, match="takes no config key 'beta'"):
        resolve_config("cross_entropy", {"beta": 1.0})
    with pytest.raises(ValueError, match="unknown loss_fn 'grpo'"):
        resolve_config("grpo", None)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_batch_loss_equals_the_sum_of_datum_losses(loss_fn):
    # batch_loss concatenates a chunk's datums; a datum without a mask counts every token, as alone.
    from backends.local.loss_math import batch_loss

    rng = np.random.default_rng(0)
    data, lps = [], []
    for i, n in enumerate([5, 1, 9]):

        def f(n: int = n) -> np.ndarray:
            return rng.standard_normal(n).astype(np.float32)

        mask = (rng.random(n) > 0.3).astype(np.float32) if i != 1 else None
        data.append(Datum(list(range(n)), np.arange(n), weights=f(), logprobs=f() - 2, advantages=f(), mask=mask))
        lps.append(torch.tensor(f() - 2, requires_grad=True))
    cpu = torch.device("cpu")
    config = resolve_config(loss_fn, None)
    joined = batch_loss(loss_fn, lps, data, cpu, config)
    grads = torch.autograd.grad(joined, lps)
    alone = sum(datum_loss(loss_fn, lp, inputs_from_datum(d, cpu), config) for lp, d in zip(lps, data))
    assert float(joined) == pytest.approx(float(alone), rel=1e-6, abs=1e-6)
    for g, want in zip(grads, torch.autograd.grad(alone, lps)):
        torch.testing.assert_close(g, want)


def test_a_non_finite_loss_input_is_refused() -> None:
    """A NaN or infinite weight, advantage, mask or sampler logprob made the loss and every gradient NaN, and the
    next optim_step left the adapter NaN for good; the Datum refuses it, naming the input and the position."""
    ok = np.zeros(3, dtype=np.float32)
    for name in ("weights", "logprobs", "advantages", "mask"):
        for bad in (np.nan, np.inf, -np.inf):
            values = ok.copy()
            values[1] = bad
            with pytest.raises(ValueError, match=f"^{name} holds {bad} at position 1: loss inputs must be finite$"):
                Datum(model_input=[1, 2, 3], target_tokens=np.array([2, 3, 4]), **{name: values})
    Datum(model_input=[1, 2, 3], target_tokens=np.array([2, 3, 4]), weights=ok, advantages=ok + 1e30)
