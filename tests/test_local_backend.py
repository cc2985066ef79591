"""The local backend on the embedded tiny model (CPU, float32): ordering, gradient accumulation, AdamW,
custom losses, checkpoints, PEFT export, sampler snapshots, determinism and error reporting."""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from backends.base import Backend, BackendError, SamplingClient, TrainingClient
from backends.errors import UserError
from backends.local import batching
from backends.local import model as M
from backends.local.backend import LocalBackend
from backends.local.device import pick_device
from backends.local.llama import LoraDelta
from backends.local.local_config import Local
from backends.local.sampler import SampleRequest
from backends.local.tiny import TINY_DIR
from backends.types import AdamParams, Datum, LoraSpec, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_sampling_clients import count_batches  # noqa: E402 - the bench's decode-run counter

SPEC = LoraSpec("tiny", rank=4, seed=7)
ADAM = AdamParams(learning_rate=3e-3)


def _seq(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 256, size=n).tolist()


def _ce(seq: list[int], rng: np.random.Generator | None = None) -> Datum:
    w = np.ones(len(seq) - 1) if rng is None else rng.uniform(0, 1, len(seq) - 1)
    return Datum(seq[:-1], np.array(seq[1:]), weights=w)


@pytest.fixture(scope="module")
def data() -> list[Datum]:
    rng = np.random.default_rng(0)
    return [_ce(_seq(rng, n), rng) for n in (9, 17, 5, 12)]


@pytest.fixture(scope="module")
def backend(tmp_path_factory) -> LocalBackend:
    be = LocalBackend(Local(), "tiny", None, tmp_path_factory.mktemp("store"), seed=0)
    yield be
    be.close()


def _weights(tc) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in M.trainable_params(tc.model)}


def _grads(tc) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in M.trainable_params(tc.model)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = 1e-5) -> bool:
    """Same tensors up to float32 rounding, relative to each tensor's scale (LoRA A grads start at 0)."""
    return a.keys() == b.keys() and all((a[n] - b[n]).abs().max() <= rel * b[n].abs().max() + 1e-12 for n in a)


def _train(tc, data, steps: int) -> list[float]:
    """`steps` pipelined fb+optim steps, submitted before awaiting anything; the losses."""
    futs = [(tc.forward_backward(data, "cross_entropy"), tc.optim_step(ADAM)) for _ in range(steps)]
    futs[-1][1].result()  # the last step has landed too
    return [fb.result().metrics["loss:sum"] for fb, _ in futs]


def _base_logprobs(model, d: Datum) -> np.ndarray:
    """Independent target logprobs: one plain HF forward on the unpadded sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([d.model_input])).logits[0].double()
    return logits.log_softmax(-1).gather(-1, torch.tensor(d.target_tokens).view(d.length, -1)).view(-1).numpy()


# ---------------------------------------------------------------- protocol, forward, batching


def test_protocol_and_initial_logprobs(backend, data):
    tc = backend.create_training_client(SPEC).result()
    assert isinstance(backend, Backend) and isinstance(tc, TrainingClient)
    out = tc.forward(data, "cross_entropy").result()
    # LoRA starts at B = 0: the learner equals the base model, computed here without padding or batching.
    for d, lp in zip(data, out.logprobs):
        assert lp.dtype == np.float32 and lp.shape == d.target_tokens.shape
        np.testing.assert_allclose(lp, _base_logprobs(backend.base(), d), atol=2e-5)
    expected = sum(float(-(d.weights * lp).sum()) for d, lp in zip(data, out.logprobs))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    # forward accumulates nothing
    assert all(p.grad is None for _, p in M.trainable_params(tc.model))


def test_top_k_targets_and_mask(backend):
    tc = backend.create_training_client(SPEC).result()
    rng = np.random.default_rng(1)
    seq = _seq(rng, 10)
    targets = np.stack([seq[1:], rng.integers(0, 256, 9), rng.integers(0, 256, 9)], axis=1)
    w = rng.uniform(0, 1, targets.shape)
    mask = (np.arange(9) >= 4).astype(np.float32)
    out = tc.forward([Datum(seq[:-1], targets, weights=w, mask=mask)], "cross_entropy").result()
    lp = out.logprobs[0]
    assert lp.shape == (9, 3)
    with torch.no_grad():
        ref = backend.base()(input_ids=torch.tensor([seq[:-1]])).logits[0].double().log_softmax(-1)
    np.testing.assert_allclose(lp, ref.gather(-1, torch.tensor(targets)).numpy(), atol=2e-5)
    assert out.metrics["loss:sum"] == pytest.approx(float(-(w * lp * mask[:, None]).sum()), rel=1e-5)


def test_chunking_matches_one_batch(backend, data, monkeypatch):
    one = backend.create_training_client(SPEC).result()
    chunked = backend.create_training_client(SPEC).result()
    full = one.forward_backward(data, "cross_entropy").result()
    monkeypatch.setattr(batching, "chunk_tokens", lambda vocab: 20)  # forces 3 chunks of mixed lengths
    assert len(batching.plan_chunks([d.length for d in data], 20)) == 3
    part = chunked.forward_backward(data, "cross_entropy").result()
    for a, b in zip(full.logprobs, part.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert part.metrics["loss:sum"] == pytest.approx(full.metrics["loss:sum"], rel=1e-5)
    ga, gb = _grads(one), _grads(chunked)
    assert _close(ga, gb)


# ---------------------------------------------------------------- ordering and accumulation


def test_fifo_forward_after_optim_sees_new_weights(backend, data):
    tc = backend.create_training_client(SPEC).result()
    fb1 = tc.forward_backward(data, "cross_entropy")
    step = tc.optim_step(ADAM)
    fb2 = tc.forward_backward(data, "cross_entropy")
    assert not fb2.done() or step.done()  # submitted without waiting
    lp1, lp2 = fb1.result().logprobs[0], fb2.result().logprobs[0]
    assert step.result().metrics["grad_norm:mean"] > 0
    assert np.abs(lp1 - lp2).max() > 1e-4  # the update landed between them
    assert fb2.result().metrics["loss:sum"] < fb1.result().metrics["loss:sum"]


def test_grads_accumulate_until_optim_step(backend, data):
    split = backend.create_training_client(SPEC).result()
    union = backend.create_training_client(SPEC).result()
    f1 = split.forward_backward(data[:2], "cross_entropy")
    f2 = split.forward_backward(data[2:], "cross_entropy")
    fu = union.forward_backward(data, "cross_entropy")
    s1 = f1.result().metrics["loss:sum"] + f2.result().metrics["loss:sum"]
    assert s1 == pytest.approx(fu.result().metrics["loss:sum"], rel=1e-6)
    ga, gb = _grads(split), _grads(union)
    assert _close(ga, gb)
    split.optim_step(ADAM).result()
    union.optim_step(ADAM).result()
    wa, wb = _weights(split), _weights(union)
    assert _close(wa, wb)
    assert all(p.grad is None for _, p in M.trainable_params(split.model))  # zeroed by the step


def test_optim_step_matches_adamw_by_hand(backend, data):
    """Two AdamW steps with decoupled weight decay and a global-norm clip, written out in numpy."""
    tc = backend.create_training_client(SPEC).result()
    params = AdamParams(learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1, grad_clip_norm=0.5)
    w = {n: t.double().numpy() for n, t in _weights(tc).items()}
    m = {n: np.zeros_like(v) for n, v in w.items()}
    v2 = {n: np.zeros_like(v) for n, v in w.items()}
    for t in (1, 2):
        tc.forward_backward(data, "cross_entropy").result()
        g = {n: t_.double().numpy() for n, t_ in _grads(tc).items()}
        norm = np.sqrt(sum((x**2).sum() for x in g.values()))
        out = tc.optim_step(params).result()
        assert out.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        assert norm > params.grad_clip_norm  # the clip is exercised
        scale = params.grad_clip_norm / (norm + 1e-6)  # torch's clip_grad_norm_ formula
        for n, gn in g.items():
            gn = gn * scale
            m[n] = params.beta1 * m[n] + (1 - params.beta1) * gn
            v2[n] = params.beta2 * v2[n] + (1 - params.beta2) * gn**2
            mhat, vhat = m[n] / (1 - params.beta1**t), v2[n] / (1 - params.beta2**t)
            w[n] = w[n] * (1 - params.learning_rate * params.weight_decay)
            w[n] = w[n] - params.learning_rate * mhat / (np.sqrt(vhat) + params.eps)
    got = _weights(tc)
    for n, want in w.items():
        np.testing.assert_allclose(got[n].double().numpy(), want, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- custom losses


def _reference_grads(tc, data, loss_of_logprobs):
    """Autograd of the loss written directly on a copy of the model (no backend involved)."""
    model = copy.deepcopy(tc.model)
    lps = [None] * len(data)
    with torch.enable_grad():
        for idx, out in batching.chunk_logprobs(model, data, torch.device("cpu"), 10**6):
            for i, lp in zip(idx, out):
                lps[i] = lp
        loss = loss_of_logprobs(lps)
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in M.trainable_params(model)}, lps


def _dpo(data, lps, ref_lps, beta=0.1):
    """Cookbook-style DPO on interleaved (chosen, rejected) pairs."""
    margins = []
    for i in range(0, len(data), 2):
        c = (torch.from_numpy(data[i].weights) * (lps[i] - ref_lps[i])).sum()
        r = (torch.from_numpy(data[i + 1].weights) * (lps[i + 1] - ref_lps[i + 1])).sum()
        margins.append(beta * (c - r))
    return -F.logsigmoid(torch.stack(margins)).mean()


def test_custom_loss_gradient_equals_direct_autograd_dpo(backend, data):
    tc = backend.create_training_client(SPEC).result()
    _train(tc, data, 1)  # move off B = 0 so every term has a gradient
    rng = np.random.default_rng(3)
    ref = [torch.tensor(rng.normal(size=d.length) * 0.1 - 4, dtype=torch.float32) for d in data]

    def fn(data_, lps):
        loss = _dpo(data_, [lp for lp in lps], ref)
        return loss, {"dpo_loss": float(loss.detach())}

    loss_ref, grads_ref, lps_ref = _reference_grads(tc, data, lambda lps: _dpo(data, lps, ref))
    out = tc.forward_backward_custom(data, fn).result()
    assert out.metrics["loss:sum"] == pytest.approx(loss_ref, rel=1e-5)
    assert out.metrics["dpo_loss"] == pytest.approx(loss_ref, rel=1e-5)
    got = _grads(tc)
    for n in got:
        torch.testing.assert_close(got[n], grads_ref[n], atol=1e-6, rtol=1e-4)
    # surrogate = sum(g * lp) with g = dloss/dlp, computed here by autograd on detached logprobs
    leaves = [lp.detach().requires_grad_() for lp in lps_ref]
    g = torch.autograd.grad(_dpo(data, leaves, ref), leaves)
    surrogate = sum(float((gi * lp.detach()).sum()) for gi, lp in zip(g, leaves))
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(surrogate, rel=1e-4)
    for lp, lp_ref in zip(out.logprobs, lps_ref):
        np.testing.assert_allclose(lp, lp_ref.detach().numpy(), atol=1e-5)


def test_custom_ce_equals_builtin_ce(backend, data):
    builtin = backend.create_training_client(SPEC).result()
    custom = backend.create_training_client(SPEC).result()
    a = builtin.forward_backward(data, "cross_entropy").result()

    def ce(data_, lps):
        return sum((-torch.tensor(d.weights, dtype=torch.float32) * lp).sum() for d, lp in zip(data_, lps)), {}

    b = custom.forward_backward_custom(data, ce).result()
    assert b.metrics["loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-6)
    # For a loss linear in the logprobs the SDK's surrogate is the loss itself.
    assert b.metrics["surrogate_loss:sum"] == pytest.approx(a.metrics["loss:sum"], rel=1e-5)
    ga, gb = _grads(builtin), _grads(custom)
    assert _close(ga, gb)


def test_custom_loss_errors_fail_only_their_future(backend, data):
    tc = backend.create_training_client(SPEC).result()

    def boom(data_, lps):
        raise RuntimeError("bad loss")

    def ignores_datum_1(data_, lps):
        return lps[0].sum(), {}

    f1 = tc.forward_backward_custom(data, boom)
    f2 = tc.forward_backward_custom(data[:2], ignores_datum_1)
    f3 = tc.forward(data, "cross_entropy")
    with pytest.raises(BackendError, match=r"forward_backward_custom #1 failed: RuntimeError: bad loss"):
        f1.result()
    with pytest.raises(BackendError, match="does not depend on the logprobs of datum 1") as e:
        f2.result()
    assert e.value.user_error
    assert f3.result().metrics["loss:sum"] > 0


def test_a_forward_backward_failing_part_way_leaves_the_gradients_as_they_were(backend, data, monkeypatch):
    """Out of memory at a batch's second chunk: the first chunk's backward had already added to .grad, and the next
    optim_step applied half a batch. The failed request now leaves the gradients as before it (None, or what an
    earlier forward_backward accumulated), the error is one line naming the request and what to lower, and the
    client trains on exactly as one that never saw the request."""
    monkeypatch.setattr(batching, "chunk_tokens", lambda vocab: 20)  # several chunks per batch (the unpacked path)

    clean = backend.create_training_client(SPEC).result()
    hit = backend.create_training_client(SPEC).result()
    if hit.packed is not None:  # the packed path (tiny is a Llama): its own budget, the same for both clients
        monkeypatch.setattr(type(hit.packed), "token_budget", lambda self, vocab: 20)
    with torch.no_grad():
        assert len(list(hit._logprobs(data))) >= 2
    original = hit._logprobs

    def first_chunk_then_oom(data_, trained=None):
        it = original(data_, trained)
        yield next(it)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                                     "of 79.19 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this "
                                     "process has 78.1 GiB memory in use.\nSee documentation for Memory Management")

    for tc in (clean, hit):
        tc.forward_backward(data[:2], "cross_entropy").result()  # a pending gradient, kept through the failure
    monkeypatch.setattr(hit, "_logprobs", first_chunk_then_oom)
    with pytest.raises(BackendError) as e:
        hit.forward_backward(data, "cross_entropy").result()
    msg = str(e.value)
    assert msg.startswith("forward_backward #2 ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert "\n" not in msg and "lower the tokens in flight" in msg and not e.value.user_error
    assert _close(_grads(hit), _grads(clean), rel=0.0)
    monkeypatch.setattr(hit, "_logprobs", original)
    for tc in (clean, hit):
        tc.optim_step(ADAM).result()
    assert _close(_weights(hit), _weights(clean), rel=0.0)
    # No gradient pending: the failed request leaves none.
    monkeypatch.setattr(hit, "_logprobs", first_chunk_then_oom)
    with pytest.raises(BackendError, match="forward_backward #4 ran out of memory"):
        hit.forward_backward(data, "cross_entropy").result()
    assert all(p.grad is None for _, p in M.trainable_params(hit.model))


# ---------------------------------------------------------------- bad input


def test_bad_input_is_a_user_error_naming_the_request(backend, data):
    tc = backend.create_training_client(SPEC).result()
    rl = Datum([1, 2, 3], np.array([2, 3, 4]), logprobs=np.zeros(3))  # no advantages
    cases = [
        (tc.forward_backward([Datum([1, 999], np.array([2, 3]), weights=np.ones(2))], "cross_entropy"),
         r"forward_backward #1: datum 0: model_input holds token id 999"),
        (tc.forward([data[0], Datum([1], np.array([259]), weights=np.ones(1))], "cross_entropy"),
         r"forward #2: datum 1: target_tokens holds token id 259"),
        (tc.forward_backward([data[0], rl], "ppo"), r"datum 0: loss 'ppo' needs loss input 'logprobs'"),
        (tc.forward_backward([rl], "ppo", {"clip_eps": 0.2}), r"takes no config key 'clip_eps'"),
        (tc.forward_backward([], "cross_entropy"), r"no data"),
        (tc.optim_step(AdamParams(learning_rate=-1.0)), r"optim_step #6: invalid AdamParams"),
        # past the model's 2048 positions (the sampler refuses such a sequence too)
        (tc.forward_backward([Datum([1] * 2049, np.ones(2049, np.int64), weights=np.ones(2049))], "cross_entropy"),
         r"forward_backward #7: datum 0: 2049 tokens exceed the model's context of 2048"),
    ]
    ok = tc.forward(data, "cross_entropy")  # queued after all the failures: the client is not poisoned
    for fut, pattern in cases:
        with pytest.raises(BackendError, match=pattern) as e:
            fut.result()
        assert e.value.user_error and e.value.request
    assert ok.result().metrics["loss:sum"] > 0
    assert all(p.grad is None for _, p in M.trainable_params(tc.model))  # failed fbs left no gradient


def test_missing_model_and_device_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="'no-such-org/no-such-model' is not in the Hugging Face cache and downloads"):
        LocalBackend(Local(local_files_only=True), "no-such-org/no-such-model", None, tmp_path)
    with pytest.raises(UserError, match="does not exist"):
        LocalBackend(Local(), str(tmp_path / "nope"), None, tmp_path)
    assert pick_device(Local()) == (torch.device("cpu"), torch.float32) or torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA device"):
            pick_device(Local(device="cuda"))


# ---------------------------------------------------------------- checkpoints and export


def test_resume_continues_bit_identically(backend, data, tmp_path):
    straight = backend.create_training_client(SPEC).result()
    losses_straight = _train(straight, data, 4)

    first = backend.create_training_client(SPEC).result()
    losses = _train(first, data, 2)
    path = first.save_state("resume-test").result()
    assert Path(path).is_absolute() and Path(path).is_dir()
    with pytest.raises(BackendError, match="already exists") as e:
        first.save_state("resume-test").result()
    assert e.value.user_error
    resumed = backend.create_training_client_from_state(path, SPEC).result()
    assert resumed.step == 2
    losses += _train(resumed, data, 2)
    assert losses == losses_straight  # exact, not approximate
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)

    # Weights only: the same weights with fresh Adam moments, so the next step differs.
    fresh = backend.create_training_client_from_state(path, SPEC, with_optimizer=False).result()
    again = backend.create_training_client_from_state(path, SPEC).result()
    assert fresh.step == 0 and _weights(fresh).keys() == _weights(again).keys()
    assert all(torch.equal(w, _weights(again)[n]) for n, w in _weights(fresh).items())
    _train(fresh, data, 1)
    _train(again, data, 1)
    assert not all(torch.equal(w, _weights(again)[n]) for n, w in _weights(fresh).items())

    with pytest.raises(BackendError, match="rank=4"):
        backend.create_training_client_from_state(path, LoraSpec("tiny", rank=8)).result()
    with pytest.raises(BackendError, match="not a local save_state checkpoint") as e:
        backend.create_training_client_from_state(str(tmp_path / "nope"), SPEC).result()
    assert e.value.user_error


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_peft_export_loads_with_peft(backend, data):
    import peft

    tc = backend.create_training_client(SPEC).result()
    _train(tc, data, 3)
    path = tc.save_weights_for_sampler("export").result()
    expect = tc.forward(data, "cross_entropy").result().logprobs
    base = M.load_base(TINY_DIR, torch.device("cpu"), torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, path)
    for d, lp in zip(data, expect):
        np.testing.assert_allclose(_base_logprobs(loaded, d), lp, atol=2e-5)
    # ... and a sampling client made from it scores the same (LoRA merged there).
    sc = backend.create_sampling_client(model_path=path).result()
    got = sc.compute_logprobs(data[0].full_sequence).result()
    assert got[0] is None
    np.testing.assert_allclose(np.array(got[1:]), expect[0], atol=1e-4)


# ---------------------------------------------------------------- sampling clients


def test_sampler_snapshot_is_immutable(backend, data):
    tc = backend.create_training_client(SPEC).result()
    _train(tc, data, 2)
    snap = tc.save_weights_and_get_sampling_client()
    _train(tc, data, 3)  # queued behind the snapshot
    sc = snap.result()
    assert isinstance(sc, SamplingClient)
    seq = data[1].full_sequence
    before = sc.compute_logprobs(seq).result()
    _train(tc, data, 2)
    assert sc.compute_logprobs(seq).result() == before
    later = tc.save_weights_and_get_sampling_client().result().compute_logprobs(seq).result()
    assert np.abs(np.array(later[1:]) - np.array(before[1:])).max() > 1e-3
    now = tc.forward([data[1]], "cross_entropy").result().logprobs[0]
    np.testing.assert_allclose(np.array(later[1:]), now, atol=1e-4)


def test_tied_unembed_adapter_leaves_base_embeddings(backend, data):
    tc = backend.create_training_client(SPEC).result()
    _train(tc, data, 2)
    assert any("lm_head" in n and "lora_B" in n and p.abs().max() > 0 for n, p in M.trainable_params(tc.model))
    sc = tc.save_weights_and_get_sampling_client().result()
    base_emb = backend.base().get_input_embeddings().weight
    assert torch.equal(sc.model.get_input_embeddings().weight, base_emb)
    out = sc.model.get_output_embeddings()
    if isinstance(out, LoraDelta):  # sampler_weights "lora" (auto on a GPU): the adapter, applied unmerged
        assert out.base.weight is base_emb and out.b_t.abs().max() > 0
    else:  # merged: lm_head got its own tensor
        assert not torch.equal(out.weight, base_emb)
    # LoRA clients share the base's frozen tensors: training and merging must leave them as loaded.
    pristine = M.load_base(TINY_DIR, torch.device("cpu"), torch.float32).state_dict()
    assert all(torch.equal(t, pristine[n]) for n, t in backend.base().state_dict().items())


def test_base_sampling_client_and_batched_requests(backend, data):
    sc = backend.create_sampling_client(base_model="tiny").result()
    seqs = [d.full_sequence for d in data]
    futs = [sc.compute_logprobs(s) for s in seqs]  # queued together, served in one batch
    samples = sc.sample(seqs[0][:4], 3, SamplingParams(max_tokens=6, seed=1))
    bad = sc.sample([1, 500], 1, SamplingParams(max_tokens=2))
    for d, f in zip(data, futs):
        np.testing.assert_allclose(np.array(f.result()[1:]), _base_logprobs(backend.base(), d), atol=1e-4)
    out = samples.result()
    assert len(out.sequences) == 3 and all(len(s.tokens) == len(s.logprobs) <= 6 for s in out.sequences)
    with pytest.raises(BackendError, match="token id 500") as e:
        bad.result()
    assert e.value.user_error
    with pytest.raises(BackendError, match="serves model 'tiny', not 'Qwen/Qwen3-8B'"):
        backend.create_sampling_client(base_model="Qwen/Qwen3-8B").result()


def test_sampling_worker_batches_queued_requests(backend, data):
    import threading

    sc = backend.create_sampling_client(base_model="tiny").result()
    inner = sc._sampler.compute_logprobs_batch
    sizes, release = [], threading.Event()

    def spy(seqs):
        sizes.append(len(seqs))
        release.wait(120)  # hold the worker so the next requests queue up behind this call (set once they are in)
        return inner(seqs)

    sc._sampler.compute_logprobs_batch = spy
    first = sc.compute_logprobs(data[0].full_sequence)
    while not sizes:
        threading.Event().wait(0.01)
    rest = [sc.compute_logprobs(d.full_sequence) for d in data[1:]]
    release.set()
    assert [len(f.result()) for f in [first, *rest]] == [d.length + 1 for d in data]
    assert sizes == [1, len(data) - 1]  # everything queued meanwhile went in one call


def test_dropped_sampling_client_is_freed(backend, data, monkeypatch):
    import gc
    import weakref

    from backends.local import worker

    monkeypatch.setattr(worker, "IDLE_EXIT_S", 0.05)
    tc = backend.create_training_client(SPEC).result()
    sc = tc.save_weights_and_get_sampling_client().result()
    sc.compute_logprobs(data[0].full_sequence).result()
    ref = weakref.ref(sc.model)
    del sc
    deadline = time.monotonic() + 60  # 0.05 s idle, then the thread's exit: ms on an idle machine
    while ref() is not None and time.monotonic() < deadline:  # its worker thread exits when idle
        time.sleep(0.05)
        gc.collect()
    assert ref() is None


def test_training_worker_keeps_its_thread_and_a_dropped_client_is_freed(backend, data, monkeypatch):
    # The training thread outlives idle spells (a new thread may land in another malloc arena and re-fault a
    # whole step's activations: backends/local/worker.py), and still goes away with its client.
    import gc
    import weakref

    from backends.local import worker

    monkeypatch.setattr(worker, "IDLE_EXIT_S", 0.05)
    tc = backend.create_training_client(SPEC).result()
    tc.forward(data[:2], "cross_entropy").result()
    thread = tc._worker._thread
    assert thread is not None and thread.is_alive()
    time.sleep(0.3)  # six idle spells of a sampling worker
    tc.forward(data[:2], "cross_entropy").result()
    assert tc._worker._thread is thread and thread.is_alive()
    ref = weakref.ref(tc.model)
    del tc
    deadline = time.monotonic() + 60
    while (ref() is not None or thread.is_alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    assert ref() is None and not thread.is_alive()
    # A client dropped right after a submit still runs it: the queued job keeps its worker alive.
    fut = backend.create_training_client(SPEC).result().forward(data[:2], "cross_entropy")
    gc.collect()
    assert len(fut.result(timeout=30).logprobs) == 2


# ---------------------------------------------------------------- determinism, full fine-tune


def _run_fresh(tmp: Path):
    be = LocalBackend(Local(), "tiny", None, tmp, seed=5)
    tc = be.create_training_client(LoraSpec("tiny", rank=4)).result()  # seed=None: derived from the backend's
    rng = np.random.default_rng(9)
    batch = [_ce(_seq(rng, 11), rng) for _ in range(3)]
    losses = _train(tc, batch, 2)
    sc = tc.save_weights_and_get_sampling_client().result()
    s = sc.sample(batch[0].model_input[:3], 2, SamplingParams(max_tokens=5)).result()
    be.close()
    return losses, _weights(tc), [q.tokens for q in s.sequences]


def test_two_fresh_backends_are_identical(tmp_path):
    l1, w1, s1 = _run_fresh(tmp_path / "a")
    l2, w2, s2 = _run_fresh(tmp_path / "b")
    assert l1 == l2 and s1 == s2
    assert all(torch.equal(w1[n], w2[n]) for n in w1)


def test_full_finetune(tmp_path, data):
    be = LocalBackend(Local(full_finetune=True), "tiny", None, tmp_path, seed=0)
    tc = be.create_training_client(SPEC).result()
    n_all = sum(p.numel() for p in tc.model.parameters())
    assert sum(p.numel() for _, p in M.trainable_params(tc.model)) == n_all
    losses = _train(tc, data, 2)
    assert losses[1] < losses[0]
    path = tc.save_weights_for_sampler("full").result()
    sc = be.create_sampling_client(model_path=path).result()
    got = sc.compute_logprobs(data[0].full_sequence).result()
    np.testing.assert_allclose(np.array(got[1:]), tc.forward(data[:1], "cross_entropy").result().logprobs[0], atol=1e-4)
    assert not torch.equal(be.base().get_input_embeddings().weight, tc.model.get_input_embeddings().weight)
    be.close()


# ---------------------------------------------------------------- sampling workers: threads, coalescing, seeds


def test_sampling_threads_are_single_and_training_keeps_its_own(backend, data):
    """Sampling workers on the CPU run torch single-threaded (libgomp spin-waits badly on shared cores);
    a training worker started afterwards still gets the process's count, not the sampler's."""
    from backends.local import backend as B

    sc = backend.create_sampling_client(base_model="tiny").result()
    inner, seen = sc._sampler.compute_logprobs_batch, []
    sc._sampler.compute_logprobs_batch = lambda seqs: (seen.append(torch.get_num_threads()), inner(seqs))[1]
    sc.compute_logprobs(data[0].full_sequence).result()
    assert seen == [B.SAMPLER_CPU_THREADS]

    def loss(batch, lps):
        seen.append(torch.get_num_threads())
        return -sum(lp.sum() for lp in lps), {}

    tc = backend.create_training_client(SPEC).result()
    tc.forward_backward_custom(data[:1], loss).result()
    assert seen[1] == B._default_threads[0]


def test_training_results_do_not_depend_on_a_sampler_having_run(tmp_path):
    """Training keeps its thread count, and a sampler thread starting (torch.set_num_threads, which also turns
    MKL's dynamic threading off process-wide) changes nothing in it: the same batch gives bit-identical
    gradients before and after. The batch is big enough (~4,000 tokens) that MKL splits a LoRA weight
    gradient's sum over tokens across threads; on this project's Xeon both the thread count (the CoreShare
    of before) and the dynamic switch changed those bits (22 of 58 gradients, here), and seeded RL runs did
    not repeat. A fresh backend: the switch happens once per process, at the first torch.set_num_threads."""
    be = LocalBackend(Local(), "tiny", None, tmp_path, seed=0)
    rng = np.random.default_rng(5)
    big = [Datum(list(map(int, rng.integers(0, 259, 250))), rng.integers(0, 259, 250),
                 weights=rng.random(250).astype(np.float32)) for _ in range(16)]
    results = []
    sc = be.create_sampling_client(base_model="tiny").result()
    for busy in (False, True):
        tc = be.create_training_client(LoraSpec("tiny", rank=8, seed=0)).result()
        if busy:  # a sampler's worker thread starts and decodes (one intra-op thread)
            for f in [sc.sample([1, 2, 3], 8, SamplingParams(max_tokens=50, stop=[])) for _ in range(4)]:
                f.result()
        out = tc.forward_backward(big, "cross_entropy").result()
        results.append((out.metrics, [p.grad.clone() for _, p in tc._params if p.grad is not None]))
    be.close()
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))


def _episodes(submit, n: int, turns: int, pause) -> None:
    """n threads, each `turns` times: submit, wait for the result, pause(i) (an env step), resubmit."""
    import threading

    def episode(i: int) -> None:
        for t in range(turns):
            submit(i, t).result(30)
            pause(i)

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def test_worker_coalesces_requests_that_arrive_apart(monkeypatch):
    """Episodes resubmit 0-15 ms apart after each batch; the worker waits for all of them, so every turn is
    one batch. (Windows widened so a loaded CI machine cannot split a batch.)"""

    from backends.local import worker as W

    monkeypatch.setattr(W, "WARM_GAP_S", 1.0)
    monkeypatch.setattr(W, "MAX_WAIT_S", 5.0)
    monkeypatch.setattr(W, "WAIT_FRACTION", 100.0)
    monkeypatch.setattr(W, "COLD_GAP_S", 0.5)
    monkeypatch.setattr(W, "COLD_MAX_S", 2.0)  # the first batch is cold: 4 threads start under load (20 ms split it)
    sizes: list[int] = []

    def handle(jobs):
        sizes.append(len(jobs))
        time.sleep(0.02)  # the batch's work
        for j in jobs:
            j.future.set_result(j.payload)

    w = W.Worker("test", handle, drain=True, coalesce=True)
    _episodes(lambda i, t: w.submit(f"r{i}.{t}", (i, t)), 4, 3, lambda i: time.sleep(0.005 * i))
    w.close()
    assert sizes == [4, 4, 4]


def test_lone_sequential_caller_does_not_wait(monkeypatch):
    """Once every caller of the last batch is back, the batch starts at once, however wide the windows."""

    from backends.local import worker as W

    monkeypatch.setattr(W, "WARM_GAP_S", 60.0)
    monkeypatch.setattr(W, "MAX_WAIT_S", 60.0)
    monkeypatch.setattr(W, "WAIT_FRACTION", 1000.0)
    def handle(jobs):
        time.sleep(0.05)  # a batch that takes time: the warm wait would be min(MAX_WAIT_S, 1000 x 0.05 s) = 50 s
        for j in jobs:
            j.future.set_result(None)

    w = W.Worker("test", handle, drain=True, coalesce=True)
    w.submit("first", None).result(30)  # cold: waits COLD_GAP_S (2 ms) for company
    start = time.monotonic()
    for i in range(5):
        w.submit(f"r{i}", None).result(30)  # a warm wait (50 s) times this out
    w.close()
    assert time.monotonic() - start < 15  # 0.25 s of handling on an idle machine; a warm wait takes 50 s per request


def test_seeded_samples_do_not_depend_on_the_batch(backend, data, monkeypatch):
    """With seeds, a request alone and the same request coalesced with others sample the same tokens."""
    import asyncio

    from backends.local import worker as W

    # The requests below arrive microseconds apart; wide cold windows keep a loaded machine from splitting them.
    monkeypatch.setattr(W, "COLD_GAP_S", 0.5)
    monkeypatch.setattr(W, "COLD_MAX_S", 2.0)

    sc = backend.create_sampling_client(base_model="tiny").result()
    prompts = [d.model_input[: 3 + i] for i, d in enumerate(data)]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=100 + i, stop=[]) for i in range(len(data))]
    # Alone: on the engine directly. Through the client, the last of them would still be decoding when its
    # result is delivered, and the requests below could join its batch (continuous batching) before the spy.
    alone = [sc._sampler.sample_batch([SampleRequest(p, 2, q)])[0] for p, q in zip(prompts, params)]
    sizes = count_batches(sc)  # per decode run: those coalesced at its start, plus those that joined it

    async def together():
        return await asyncio.gather(*(sc.sample(p, 2, q) for p, q in zip(prompts, params)))

    batched = asyncio.run(together())
    assert sizes == [len(data)]
    for a, b in zip(alone, batched):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for sa, sb in zip(a.sequences, b.sequences):
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-4)


def test_the_largest_recipe_seed_makes_clients(tmp_path):
    """A recipe seed up to 2**63 - 1 is valid (runner/recipe/schema.py); the backend seeds its clients from
    seed * 1000 + index, which overflowed torch's signed 64-bit seed ("Overflow when unpacking long long" at the
    first training client of a recipe with seed >= 2**53 or so). The derived seeds now wrap modulo 2**63."""
    be = LocalBackend(Local(device="cpu"), "tiny", None, tmp_path / "store", seed=2**63 - 1)
    try:
        tc = be.create_training_client(LoraSpec("tiny", rank=2)).result()
        sc = tc.save_weights_and_get_sampling_client().result()
        out = sc.sample([1, 2, 3], 2, SamplingParams(max_tokens=3, stop=[])).result()
        assert len(out.sequences) == 2 and all(len(s.tokens) == 3 for s in out.sequences)
    finally:
        be.close()
