"""The local backend on CUDA (`pytest -m gpu`; every test here skips where torch sees no CUDA device): a bfloat16
training step against a float32 reference, sampler/trainer agreement, and `runner conformance` against `runner serve
--device cuda`. The CPU stand-in of the same checks is tests/test_bf16.py, whose tolerances these reuse: CUDA's
bfloat16 kernels round differently from the CPU's, not more coarsely. One exception, OWN_CUDA below."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_bf16 import (
    GRAD_COS,
    MEAN_VS_FP32,
    SPEC,
    TOL_LORA,
    TOL_VS_FP32,
    _data,
    _own_logprobs_gap,
    _worst,
    conformance_results,
)

from backends.local import model as M
from backends.local.backend import LocalBackend
from backends.local.local_config import Local
from backends.types import AdamParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# A sample's own logprobs vs compute_logprobs of the same sequence, on cuda in bfloat16. On the CPU the two are the
# same kernels on the same rows (batch invariance, decoding.ROW_QUANTUM: 5e-7 measured, TOL_OWN = 1e-3). On cuda
# they are not: the decode step attends under a boolean mask (an SDPA kernel other than flash, which takes no mask;
# 4 rows per matmul) and compute_logprobs runs the whole sequence causally (flash; 32 rows per matmul, where cuBLAS
# may pick other kernels), and each rounds its outputs to bfloat16. The logits themselves are bfloat16 (one ulp is
# 2^-6 = 0.016 at magnitude 2-4), so a single rounding that comes out the other way moves a logprob by about 0.016:
# on the CPU, compute_logprobs with its attention swapped for another kernel (float32 math, rounded) gave
# 0.0095-0.0155 on five seeds (tests/test_bf16.py's model and data). The bound is that of two bfloat16 computations
# of the same math in other op orders, TOL_LORA.
OWN_CUDA = TOL_LORA


def _cuda(tmp: Path, dtype: str = "auto") -> LocalBackend:
    return LocalBackend(Local(device="cuda", dtype=dtype), "tiny", None, tmp, seed=0)  # type: ignore[arg-type]


def test_auto_puts_tiny_on_the_cpu_and_cuda_takes_bf16(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNNER_LOCAL_DEVICE", raising=False)  # (set, it decides what "auto" picks)
    auto = LocalBackend(Local(), "tiny", None, tmp_path / "auto", seed=0)
    cuda = _cuda(tmp_path / "cuda")
    try:
        assert (auto.device.type, auto.dtype) == ("cpu", torch.float32)
        assert (cuda.device.type, cuda.dtype) == ("cuda", torch.bfloat16)
        assert not cuda.merge_samplers()  # unmerged float32 adapters over the shared bf16 base
    finally:
        auto.close()
        cuda.close()


def test_a_real_gpu_box_keeps_tinys_defaults_of_a_cpu_box(tmp_path, monkeypatch):
    """What tests/test_gpu_box.py fakes, on the real device: tiny's sweeps parallelise and `runner serve` of tiny
    caps its memory at half the machine's; --device cuda sizes it by the GPU's."""
    from backends.serve.http import ServeConfig, build_service
    from backends.serve.memory import physical_memory

    monkeypatch.delenv("RUNNER_LOCAL_DEVICE", raising=False)
    assert Local().sweep_parallel(16, "tiny") == 8 and Local(device="cuda").sweep_parallel(16, "tiny") == 1
    gpu = int(torch.cuda.get_device_properties(0).total_memory * 0.9)
    for device, want in (("auto", physical_memory() // 2), ("cuda", gpu)):
        service = build_service(ServeConfig(storage=tmp_path / device, device=device))
        try:
            assert service.memory.max_bytes == want, device
        finally:
            service.close()


def test_bf16_training_step_tracks_float32_on_cuda(tmp_path):
    """A forward_backward + optim_step in bf16 on cuda vs float32 on cuda and on the CPU: logprobs before the step
    within the bf16 tolerance, the LoRA B gradients pointing the same way (cosine; 0.996 measured on the CPU), and
    the step lowering the loss in each."""
    out = {}
    for key, backend in (("cpu32", LocalBackend(Local(device="cpu"), "tiny", None, tmp_path / "c", seed=0)),
                         ("cuda32", _cuda(tmp_path / "g32", "float32")), ("cuda16", _cuda(tmp_path / "g16"))):
        try:
            data = _data(backend.get_tokenizer())
            tc = backend.create_training_client(SPEC).result()
            before = tc.forward(data, "cross_entropy").result().logprobs
            tc.forward_backward(data, "cross_entropy").result()
            grad = torch.cat([p.grad.float().cpu().flatten() for n, p in M.trainable_params(tc.model) if "lora_B" in n])
            tc.optim_step(AdamParams(learning_rate=1e-2)).result()
            after = tc.forward(data, "cross_entropy").result().logprobs
            out[key] = (before, after, grad)
        finally:
            backend.close()
    for a, b in zip(out["cpu32"][0], out["cuda32"][0], strict=True):
        assert np.abs(a - b).max() <= 5e-3  # float32 on cuda: the CPU's numbers up to kernel rounding
    gaps = [np.abs(a - b) for a, b in zip(out["cuda32"][0], out["cuda16"][0], strict=True)]
    assert max(g.max() for g in gaps) <= TOL_VS_FP32 and np.mean([g.mean() for g in gaps]) <= MEAN_VS_FP32
    for ref in ("cpu32", "cuda32"):
        assert torch.nn.functional.cosine_similarity(out[ref][2], out["cuda16"][2], dim=0) >= GRAD_COS
    for key in out:
        assert sum(x.sum() for x in out[key][1]) > sum(x.sum() for x in out[key][0])


def test_sampler_agrees_with_trainer_on_cuda(tmp_path):
    backend = _cuda(tmp_path)
    try:
        tok = backend.get_tokenizer()
        data = _data(tok)
        tc = backend.create_training_client(SPEC).result()
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=1e-2)).result()
        lps = tc.forward(data, "cross_entropy").result().logprobs
        snap = tc.save_weights_and_get_sampling_client().result()
        assert _worst(snap, data, lps) <= TOL_LORA
        assert _own_logprobs_gap(snap, tok) <= OWN_CUDA
        saved = backend.create_sampling_client(model_path=tc.save_weights_for_sampler("s").result()).result()
        assert _worst(saved, data, lps) <= TOL_LORA
    finally:
        backend.close()


@pytest.mark.slow
def test_conformance_against_serve_on_cuda(tmp_path, monkeypatch):
    pytest.importorskip("tinker")
    from backends.serve.http import ServeConfig, build_service

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    results = conformance_results(build_service(ServeConfig(storage=tmp_path / "storage", device="cuda")))
    assert [(r.check, r.detail) for r in results if r.result != "pass"] == []



# ---------------------------------------------------------------- CUDA graphs of the sampler's decode steps


def _graph_and_eager(dtype: torch.dtype = torch.bfloat16):
    """A tiny Qwen3 on cuda; a Sampler factory with CUDA graphs (the default) or without; mixed requests."""
    from test_static_decode import _model, _requests

    from backends.local.sampler import Sampler
    from backends.local.tiny import build_tokenizer

    tok = build_tokenizer()
    dev = torch.device("cuda")
    model = _model(tok, dtype, dev)

    def sampler(graphs: bool) -> Sampler:
        s = Sampler(model, tok, dev, seed=1)
        s.cuda_graphs = graphs
        return s

    reqs = [r for r in _requests(tok) if r.params.seed is not None or r.params.temperature == 0]  # seeded or greedy
    return sampler, reqs


def test_a_failed_capture_on_cuda_decodes_eagerly_on_the_threads_own_stream(monkeypatch):
    """A decode step that cannot be captured (here: a host sync inside it) fails the capture; the decoder gives up
    graphs, the thread is back on its default stream (torch.cuda.graph's __exit__ left its capture stream current
    when capture_end raised), later CUDA work runs, torch.cuda.empty_cache() too (the allocator counted the failed
    capture as underway: torch's capture_end stops at CUDA's error), so does a draw from the default CUDA
    generator (left in capture mode by the same stop), and the samples are the eager static path's."""
    from test_static_decode import _flat

    from backends.local import static_decode

    sampler, reqs = _graph_and_eager()
    want = _flat(sampler(False).sample_batch(reqs))
    forward = static_decode.StaticBatch._forward

    def syncing(self):
        if torch.cuda.is_current_stream_capturing():
            float(self.tok.sum())  # a device-to-host copy: not capturable
        return forward(self)

    monkeypatch.setattr(static_decode.StaticBatch, "_forward", syncing)
    graph = sampler(True)
    got = _flat(graph.sample_batch(reqs))
    static = graph._static
    assert static is not None and not static.graphs and all(b.graph is None for b in static.batches.values())
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert float(torch.ones(3, device="cuda").sum()) == 3.0  # no CUDA error left behind
    torch.cuda.empty_cache()  # torch asserts no capture is underway: the failed one was ended with the allocator
    assert torch.rand(2, device="cuda").shape == (2,)  # the default generator is out of capture mode
    for (ta, la, ra), (tb, lb, rb) in zip(got, want, strict=True):
        assert ta == tb and ra == rb and la == pytest.approx(lb, abs=2e-2)


def test_a_capture_leaves_the_allocators_cache_alone():
    """Capturing decode steps keeps the blocks the caching allocator holds: torch.cuda.graph empties its cache
    before each capture, and an RL run's training thread would then allocate its next step from the driver again,
    at every capture of every new sampling client."""
    sampler, reqs = _graph_and_eager()
    s = sampler(True)
    torch.cuda.synchronize()
    block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del block  # freed into the allocator's cache: reserved, not allocated
    held = torch.cuda.memory_reserved()
    s.sample_batch(reqs)
    static = s._static
    assert static is not None and static.graphs and any(b.graph is not None for b in static.batches.values())
    assert torch.cuda.memory_reserved() >= held


def test_two_sampling_threads_capture_at_once_on_cuda():
    """Two sampling clients' worker threads capturing their decode steps at the same time (torch allows one
    capture at a time in a process, and its default capture stream is shared): both keep their graphs, and each
    gets the tokens it gets alone with the graphs off."""
    import threading

    from test_static_decode import _flat

    sampler, reqs = _graph_and_eager()
    want = _flat(sampler(False).sample_batch(reqs))
    samplers = [sampler(True), sampler(True)]
    start = threading.Barrier(2)
    got: dict[int, Any] = {}

    def run(i: int) -> None:
        start.wait()
        try:
            got[i] = _flat(samplers[i].sample_batch(reqs))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            got[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, s in enumerate(samplers):
        static = s._static
        assert static is not None and static.graphs, i  # no capture failed
        assert all(b.graph is not None for b in static.batches.values()), i
        assert isinstance(got[i], list), got[i]
        for (ta, la, ra), (tb, lb, rb) in zip(got[i], want, strict=True):
            assert ta == tb and ra == rb and la == pytest.approx(lb, abs=2e-2)


def test_to_device_on_cuda_copies_what_the_arrays_held():
    """backends/local/transfer.py's CUDA branch (pinned memory, non-blocking copies; on the CPU it never runs): the
    device tensors hold the arrays' values, dtypes and shapes as they were when copied, even when the arrays are
    overwritten at once and a large copy is still in flight."""
    from backends.local import transfer

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 9, 5), rng.random((3, 4)).astype(np.float32), np.array([True, False, True]),
              rng.integers(0, 1 << 40, (1 << 23,)), np.zeros(0, np.int64), rng.random(2).astype(np.float32)]
    want = [a.copy() for a in arrays]
    out = transfer.to_device(arrays, torch.device("cuda"))
    for a in arrays:
        a[...] = 0  # the sources change before the device has necessarily read them
    torch.cuda.synchronize()
    for w, t in zip(want, out, strict=True):
        assert t.is_cuda and t.shape == w.shape and t.dtype == torch.from_numpy(w).dtype
        assert np.array_equal(t.cpu().numpy(), w)
