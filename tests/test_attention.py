"""FlexAttention over a packed chunk (backends/local/attention.py): its mask lets each row see exactly the rows of
its own sequence up to itself (whatever prefix tree the rows sit in), and the packed model's forward through it
equals packed.py's own attention. CPU: FlexAttention's forward (its backward is CUDA-only); CUDA: training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.local import attention as flex
from backends.local.packed import MIN_SHARED, PackedLM, plan
from backends.types import Datum
from tests.test_packed import _data, _group, _lora, _model

CPU = torch.device("cpu")


def _mixed() -> list[Datum]:
    """Lone sequences (two of one length: a run), an RL group, and nested sharing (a system prompt, two turns
    below it, one datum a prefix of another)."""
    rng = np.random.default_rng(11)

    def toks(n: int) -> list[int]:
        return list(map(int, rng.integers(0, 259, n)))

    system, turn = toks(20), toks(18)
    seqs = [system + turn + toks(5), system + turn, system + toks(30), toks(9)]
    data = [Datum(s[:-1], np.array(s[1:]), weights=np.ones(len(s) - 1, np.float32)) for s in seqs]
    return data + _group(toks(24), [3, 7, 1], 0) + _data([13, 13, 40], seed=2)


def test_the_mask_is_each_sequence_causal_whatever_the_tree():
    data = _mixed()
    (layout,) = plan(data, 16384, MIN_SHARED)
    assert layout.trees and layout.runs  # both kinds of block are in the chunk
    n = len(layout.tokens)
    padded = flex.bucket(n)
    ends = flex.subtree_ends(layout, padded)
    q, kv = np.arange(padded)[:, None], np.arange(padded)[None, :]
    allowed = (kv <= q) & (q < ends[None, :])
    expected = np.zeros((padded, padded), dtype=bool)  # row rows[j] of datum i sees rows[:j + 1], nothing else
    for rows in layout.rows.values():
        for j, r in enumerate(rows):
            expected[r, rows[: j + 1]] = True
    assert (allowed[:n, :n] == expected[:n, :n]).all()
    assert not allowed[:n, n:].any() and not allowed[n:, :n].any()  # padding and real rows never meet
    assert allowed[n:, n:].diagonal().all()  # a padding row sees itself (no empty softmax)


def test_buckets_repeat_and_waste_little():
    sizes = {flex.bucket(n) for n in range(1, 20000)}
    assert all(s % flex.BLOCK == 0 for s in sizes)
    assert len(sizes) < 60  # 128 .. 20480: at most 8 per power of two
    for n in (1, 127, 128, 129, 1000, 2049, 17000):
        assert n <= flex.bucket(n) <= max(n + flex.BLOCK - 1, n * 1.125 + 1)  # a block, or an eighth


def _forward(packed: PackedLM, data: list[Datum], attention: str, compiled: bool = False) -> list[torch.Tensor]:
    packed.attention, packed.flex_compiled = attention, compiled
    out: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for idx, lp in packed.chunk_logprobs(data, 16384, CPU):
            out.update(zip(idx, lp))
    return [out[i] for i in range(len(data))]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_flex_forward_matches_the_packed_attention_on_cpu(kind):
    packed, why = PackedLM.build(_lora(_model(kind)))
    assert packed is not None, why
    data = _mixed()
    ref = _forward(packed, data, "torch")
    got = _forward(packed, data, "flex")  # FlexAttention's eager forward on the CPU
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_flex_forward_matches_on_cpu():
    """The compiled kernel (what CUDA runs, here inductor's CPU template): a minute or more to compile."""
    packed, _ = PackedLM.build(_lora(_model("qwen3")))
    assert packed is not None
    data = _mixed()
    ref = _forward(packed, data, "torch")
    got = _forward(packed, data, "flex", compiled=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_training_matches_on_cuda():
    """On CUDA the packed model trains through FlexAttention ("auto"): logprobs and LoRA gradients equal the
    per-block SDPA path's (float32)."""
    model = _lora(_model("qwen3")).cuda()
    packed, _ = PackedLM.build(model)
    assert packed is not None and packed.use_flex(torch.device("cuda"))
    data = _mixed()

    def run(attention: str):
        packed.attention = attention
        lps = {}
        for idx, lp in packed.chunk_logprobs(data, 16384, torch.device("cuda")):
            sum((x * torch.as_tensor(data[i].weights, device="cuda")).sum() for i, x in zip(idx, lp)).backward()
            lps.update({i: x.detach() for i, x in zip(idx, lp)})
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return lps, grads

    ref_lp, ref_g = run("torch")
    lp, g = run("auto")
    for i in range(len(data)):
        torch.testing.assert_close(lp[i], ref_lp[i], atol=1e-4, rtol=1e-4)
    for name in g:
        assert float((g[name] - ref_g[name]).norm() / ref_g[name].norm()) < 1e-3, name
