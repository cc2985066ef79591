"""The chunked unembedding (backends/local/logprobs.py) gives the logprobs and gradients of the full-logits path,
for every loss, on raw tensors and through the packed model, skips only work whose gradient is zero, and holds a
fraction of the full path's memory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from backends.local import batching
from backends.local import logprobs as LP
from backends.local.loss_math import batch_loss, resolve_config, trained_positions
from backends.local.packed import PackedLM
from backends.types import Datum
from tests.test_packed import _data, _group, _lora, _model

CPU = torch.device("cpu")


def _reference(h, w, rows, targets, lora=None):
    z = h[rows] @ w.t()
    if lora is not None:
        a, b, s = lora
        z = z + s * (h[rows] @ a.t()) @ b.t()
    t = torch.as_tensor(targets).view(len(rows), -1)
    return (z.log_softmax(-1).gather(-1, t)).reshape(-1)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_chunked_matches_full_logits(k, lora, skip):
    g0 = torch.Generator().manual_seed(k)
    T, H, V, R = 23, 16, 97, 4
    h = torch.randn(T, H, generator=g0, requires_grad=True)
    w = torch.randn(V, H, generator=g0).mul_(0.5).requires_grad_(True)  # a trained W: its gradient is checked too
    ab = (torch.randn(R, H, generator=g0).requires_grad_(True), torch.randn(V, R, generator=g0).requires_grad_(True), 0.7)
    rng = np.random.default_rng(k)
    rows = np.concatenate([np.arange(T), rng.integers(0, T, 9)])  # rows read twice (a shared prompt's)
    rng.shuffle(rows)
    targets = rng.integers(0, V, (len(rows), k)) if k > 1 else rng.integers(0, V, len(rows))
    grad = rng.random(len(rows)) < 0.6 if skip else None
    gout = torch.randn(len(rows) * k, generator=g0)
    if grad is not None:  # the loss's gradient is zero where the plan skips
        gout = gout * torch.as_tensor(np.repeat(grad, k), dtype=torch.float32)
    plan = LP.plan(rows, targets, T, V, CPU, grad, chunk=5)  # several chunks
    assert len(plan.fwd.bounds) == 5 and (not skip or plan.grad.n < plan.fwd.n)
    params = [h, w, *ab[:2]] if lora else [h, w]
    got = LP.target_logprobs(h, w, plan, ab if lora else None)
    dgot = torch.autograd.grad((got * gout).sum(), params)
    ref = _reference(h, w, rows, targets, ab if lora else None)
    dref = torch.autograd.grad((ref * gout).sum(), params)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    for x, y in zip(dgot, dref):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)


LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"]


def _rl_data(seed: int) -> list[Datum]:
    """Two RL groups (shared prompts: trees) and lone sequences, with sampler logprobs, advantages and weights
    that are 0 on the prompt, as the RL loop builds them."""
    rng = np.random.default_rng(seed)
    data = _group(list(map(int, rng.integers(0, 259, 30))), [4, 9, 2], 0) + _data([17, 26, 5], seed=seed)
    data += _group(list(map(int, rng.integers(0, 259, 20))), [12, 3], 1)
    out = []
    for d in data:
        n = d.length
        w = np.ones(n, np.float32)
        w[: n // 2] = 0  # the "prompt"
        adv = np.where(w > 0, rng.normal(size=n), 0).astype(np.float32)
        q = (-rng.random(n) * 3).astype(np.float32)
        out.append(Datum(d.model_input, d.target_tokens, weights=w, logprobs=q, advantages=adv))
    return out


def _run(model, packed, data, loss_fn, chunked: bool):
    packed.chunked_head = chunked
    config = resolve_config(loss_fn, None)
    trained = [trained_positions(loss_fn, d, config) for d in data] if chunked else None
    lps: dict[int, torch.Tensor] = {}
    for idx, lp in packed.chunk_logprobs(data, packed.token_budget(259), CPU, trained):
        batch_loss(loss_fn, lp, [data[i] for i in idx], CPU, config).backward()
        lps.update({i: x.detach() for i, x in zip(idx, lp)})
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lps, grads


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_every_loss_through_the_packed_model(loss_fn):
    """Per-token logprobs and LoRA gradients (lm_head's adapter included) of the chunked path against the
    full-logits path of the same packed model, on a packed batch with prefix trees; the skipped positions
    (weight / advantage 0) change nothing."""
    model = _lora(_model("qwen3"))
    packed, why = PackedLM.build(model)
    assert packed is not None, why
    data = _rl_data(3)
    if loss_fn == "dro":
        assert all(trained_positions(loss_fn, d, resolve_config(loss_fn, None)) is None for d in data)
    else:
        assert all(trained_positions(loss_fn, d, resolve_config(loss_fn, None)) is not None for d in data)
    ref_lp, ref_g = _run(model, packed, data, loss_fn, chunked=False)
    lp, g = _run(model, packed, data, loss_fn, chunked=True)
    for i, d in enumerate(data):
        assert lp[i].shape == d.target_tokens.shape
        torch.testing.assert_close(lp[i], ref_lp[i], atol=2e-5, rtol=1e-5)
    assert set(g) == set(ref_g) and any("lm_head" in n for n in g)
    for name in g:
        err = float((g[name] - ref_g[name]).norm() / ref_g[name].norm())
        assert err < 1e-5, (name, err)


def test_the_chunked_path_matches_hf_and_its_mask():
    """Against HF's own forward (batching.chunk_logprobs), with a mask hiding some positions."""
    model = _lora(_model("qwen3"))
    packed, _ = PackedLM.build(model)
    assert packed is not None
    data = _rl_data(5)
    rng = np.random.default_rng(0)
    data = [Datum(d.model_input, d.target_tokens, weights=d.weights, mask=(rng.random(d.length) < 0.7).astype(np.float32))
            for d in data]
    cfg = resolve_config("cross_entropy", None)
    trained = [trained_positions("cross_entropy", d, cfg) for d in data]
    assert all(t is not None and 0 < t.sum() < len(t) for t in trained)

    def run(chunks):
        lps = {}
        for idx, lp in chunks:
            batch_loss("cross_entropy", lp, [data[i] for i in idx], CPU, cfg).backward()
            lps.update({i: x.detach() for i, x in zip(idx, lp)})
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return lps, grads

    ref_lp, ref_g = run(batching.chunk_logprobs(model, data, CPU, 16384))
    lp, g = run(packed.chunk_logprobs(data, 16384, CPU, trained))
    for i in range(len(data)):
        torch.testing.assert_close(lp[i], ref_lp[i], atol=2e-5, rtol=1e-5)
    for name in g:
        assert float((g[name] - ref_g[name]).norm() / ref_g[name].norm()) < 1e-5, name


_PEAK = """
import sys, numpy as np, torch
from backends.local import logprobs as LP
torch.manual_seed(0)
T, H, V = 1024, 64, 65536
h = torch.randn(T, H, requires_grad=True); w = torch.randn(V, H) * 0.1
rows = np.arange(T); tg = np.random.default_rng(0).integers(0, V, T)
plan = LP.plan(rows, tg, T, V, torch.device("cpu"), chunk=64)
def status(key):
    return next(int(x.split()[1]) for x in open('/proc/self/status') if x.startswith(key + ':'))  # KiB
# Reset the peak resident size (VmHWM) to the current one: the peak of the imports must not hide the growth.
open('/proc/self/clear_refs', 'w').write('5')
base = status('VmRSS')
if sys.argv[1] == "chunked":
    lp = LP.target_logprobs(h, w, plan)
else:
    z = (h @ w.t()).float(); lp = z.gather(-1, torch.as_tensor(tg)[:, None])[:, 0] - torch.logsumexp(z, -1)
lp.sum().backward()
print(status('VmHWM') - base)
"""


def test_peak_memory_is_a_fraction_of_the_full_logits():
    """Peak resident memory of forward + backward at vocab 65,536 and 1,024 tokens (full float32 logits: 256 MiB),
    each in a fresh process: the chunked path's growth is under a quarter of the full path's. The two processes run
    at once (each measures its own peak, so neither sees the other's memory)."""
    procs = {mode: subprocess.Popen([sys.executable, "-c", _PEAK, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for mode in ("full", "chunked")}
    grown = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        grown[mode] = int(out.strip().splitlines()[-1])  # KiB
    full, chunked = grown["full"], grown["chunked"]
    assert full > 256 * 1024, full  # at least the logits themselves
    assert chunked < full / 4, (chunked, full)


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_zero_where_holds_for_every_builtin(loss_fn):
    """A loss's zero_where input at 0 gives a zero gradient whatever the logprob (what the skipping relies on);
    a loss without one (dro: its penalty does not multiply by A) has nonzero gradients there."""
    from backends import losses as registry
    from backends.local.loss_math import LossInputs, token_losses

    spec = registry.get(loss_fn)
    rng = np.random.default_rng(0)
    n = 40
    zero = rng.random(n) < 0.5
    lp = torch.tensor(-rng.random(n) * 4, requires_grad=True)
    value = torch.tensor(np.where(zero, 0.0, rng.normal(size=n)))
    q = torch.tensor(-rng.random(n) * 4)
    inp = LossInputs(weights=value, logprobs=q, advantages=value)
    (g,) = torch.autograd.grad(token_losses(loss_fn, lp, inp, resolve_config(loss_fn, None)).sum(), lp)
    if spec.zero_where is None:
        assert loss_fn == "dro" and bool((g[torch.as_tensor(zero)] != 0).all())
    else:
        assert bool((g[torch.as_tensor(zero)] == 0).all()) and bool((g[torch.as_tensor(~zero)] != 0).any())


def test_token_budget_is_bound_by_activations_not_logits(monkeypatch):
    from backends.local import packed as packed_mod

    packed, _ = PackedLM.build(_lora(_model("qwen3")))
    assert packed is not None
    assert packed.token_budget(151936) == packed_mod.MAX_PACKED_TOKENS  # small model: the cap, whatever the vocab
    monkeypatch.setattr(packed_mod, "ACTIVATION_BYTES", 8 << 20)  # 8 MiB of activations
    per_token = 2 * (4 * 64 + 2 * 64 + 2 * 32 + 3 * 96) * 4  # layers x (4 hidden + 2 q + 2 kv + 3 inter) x fp32
    assert packed.token_budget(151936) == (8 << 20) // per_token == 1424  # above the logits budget (883)
    monkeypatch.setattr(packed_mod, "ACTIVATION_BYTES", 1 << 20)  # fewer than the logits budget: that one
    assert packed.token_budget(151936) == batching.chunk_tokens(151936) == 883
    packed.chunked_head = False  # the full-logits path keeps the logits budget
    assert packed.token_budget(151936) == batching.chunk_tokens(151936)
