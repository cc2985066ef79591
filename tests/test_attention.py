"""FlexAttention over a packed chunk (backends/local/attention.py): its mask lets each row see exactly the rows of
its own sequence up to itself (whatever prefix tree the rows sit in), the packed model's forward through it equals
packed.py's own attention, and a run compiles it once whatever its batches' sizes. CPU: FlexAttention's forward
(its backward is CUDA-only); CUDA: training."""

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
    padded = flex.padded_rows(n, 16384)
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
    # padding rows see only their own BLOCK: the block mask skips every other padding block
    blocks = allowed.reshape(padded // flex.BLOCK, flex.BLOCK, padded // flex.BLOCK, flex.BLOCK).any(axis=(1, 3))
    first_pad = -(-n // flex.BLOCK)
    assert blocks[first_pad:, first_pad:].sum() == padded // flex.BLOCK - first_pad


def test_one_padded_size_per_budget():
    """Every chunk of a run is padded to the budget rounded to BLOCK, the smallest too; a chunk longer than the
    budget (a lone sequence) to a multiple of it."""
    assert {flex.padded_rows(n, 16384) for n in range(1, 16385)} == {16384}
    assert {flex.padded_rows(n, 1000) for n in (1, 500, 1000, 1024)} == {1024}
    assert flex.padded_rows(1025, 1000) == 2048 and flex.padded_rows(3000, 1000) == 3072


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
    ref = _forward(packed, data, "auto")
    got = _forward(packed, data, "flex")  # FlexAttention's eager forward on the CPU
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_compiled_flex_forward_matches_on_cpu():
    """The compiled kernel (what CUDA runs, here inductor's CPU template): a minute or more to compile."""
    packed, _ = PackedLM.build(_lora(_model("qwen3")))
    assert packed is not None
    data = _mixed()
    ref = _forward(packed, data, "auto")
    got = _forward(packed, data, "flex", compiled=True)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_training_matches_on_cuda():
    """On CUDA the packed model trains through FlexAttention ("flex"): logprobs and LoRA gradients equal the
    per-block SDPA path's (float32, and float32-accurate on both sides: inductor's FlexAttention follows torch's
    float32 matmul precision, "highest" by default, so no TF32; SDPA in float32 runs the math kernel or the
    memory-efficient one, which on sm80+ emulates float32 with CUTLASS's 3xTF32). Budget 256: the one chunk (180
    rows, trees and runs) is padded to 256, the shape test_flex_training_compiles_once_on_cuda compiles first, so
    that test finds this one's kernels in inductor's caches instead of compiling a third size (the two tests'
    sequence forward-only on the CPU under torch 2.11, 2 threads: 26.6 s for this one's first compile, 1.0 s for
    the same size again after torch._dynamo.reset(), 6.4 s for the next size)."""
    model = _lora(_model("qwen3")).cuda()
    packed, _ = PackedLM.build(model)
    packed.attention = "flex"
    assert packed is not None and packed.use_flex(torch.device("cuda"))
    data = _mixed()

    def run(attention: str):
        packed.attention = attention
        lps = {}
        for idx, lp in packed.chunk_logprobs(data, 256, torch.device("cuda")):
            sum((x * torch.as_tensor(data[i].weights, device="cuda")).sum() for i, x in zip(idx, lp)).backward()
            lps.update({i: x.detach() for i, x in zip(idx, lp)})
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return lps, grads

    ref_lp, ref_g = run("sdpa")
    lp, g = run("flex")
    for i in range(len(data)):
        torch.testing.assert_close(lp[i], ref_lp[i], atol=1e-4, rtol=1e-4)
    for name in g:
        assert float((g[name] - ref_g[name]).norm() / ref_g[name].norm()) < 1e-3, name


def test_sdpa_matches_the_tree_kernel_on_cpu():
    """attention "sdpa" (SDPA per block, what "auto" runs on CUDA) computes what "auto" (the C tree kernel) does."""
    packed, _ = PackedLM.build(_lora(_model("qwen3")))
    assert packed is not None
    data = _mixed()
    for a, b in zip(_forward(packed, data, "sdpa"), _forward(packed, data, "auto")):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


def _batches() -> list[list[Datum]]:
    """Five steps' batches of varied sizes and shapes (lone rows, RL groups, a row longer than the budget)."""
    rng = np.random.default_rng(5)
    out = []
    for rows, lo, hi in ((3, 5, 40), (9, 20, 90), (1, 7, 8), (6, 60, 140), (2, 200, 300)):
        out.append(_data(list(map(int, rng.integers(lo, hi, rows))), seed=rows))
    out[1] += _group(list(map(int, rng.integers(0, 259, 30))), [4, 9, 2], 0)
    return out


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _compiles_per_step(monkeypatch, budget: int) -> tuple[list[int], set[int]]:
    """Dynamo's compiles (each a FlexAttention kernel or a block-mask builder that inductor would generate), counted
    after each of _batches()' steps of a forward-only flex run; and the chunk sizes seen. Backend "eager": Dynamo's
    tracing and guards without code generation, in seconds."""
    import torch._dynamo

    monkeypatch.setattr(flex, "COMPILE_BACKEND", "eager")
    packed, _ = PackedLM.build(_lora(_model("qwen3")))
    assert packed is not None
    packed.attention, packed.flex_compiled = "flex", True
    torch._dynamo.reset()
    before = _graphs()
    per_step = []
    sizes = set()
    for batch in _batches():
        got: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for idx, lps in packed.chunk_logprobs(batch, budget, CPU):
                sizes.add(sum(batch[i].length for i in idx))
                got.update(zip(idx, lps))
        per_step.append(_graphs() - before)
        # every chunk's own mask reached the compiled kernel (nothing of the first chunk's baked in)
        for i, ref in enumerate(_forward(packed, batch, "auto")):
            torch.testing.assert_close(got[i], ref, atol=2e-5, rtol=1e-5)
        packed.attention, packed.flex_compiled = "flex", True
    return per_step, sizes


def test_a_run_compiles_flex_once_whatever_the_batch_sizes(monkeypatch):
    """Five steps of varied sizes, several chunks a step: the kernel and the mask builder compile once each for the
    budget's padded size, once more each for the step with a row longer than the budget, and never again."""
    per_step, sizes = _compiles_per_step(monkeypatch, 256)
    assert len(sizes) >= 6  # the chunks did come in many sizes
    assert per_step[0] == 2  # the kernel and the mask builder, at the budget's padded size
    assert per_step[-1] == 4  # + both at twice it (a 200-300 token row alone in a chunk)
    assert per_step[:-1] == [2] * 4  # nothing recompiles between steps of one size


def test_padding_each_chunk_to_its_own_size_recompiles(monkeypatch):
    """The counter sees what issue #29 hit: the same run with each chunk padded only to the next 128 rows (the
    per-size padding of before, one shape per size class) compiles again at later steps."""
    monkeypatch.setattr(flex, "padded_rows", lambda n, budget: -(-n // flex.BLOCK) * flex.BLOCK)
    per_step, _ = _compiles_per_step(monkeypatch, 1024)
    assert per_step[-1] > per_step[0] >= 2 and per_step[-1] >= 6, per_step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_training_compiles_once_on_cuda():
    """Five training steps of varied sizes through compiled FlexAttention (inductor, forward and backward) on CUDA:
    the kernel and the mask builder compile at the first step, once more each for a row longer than the budget,
    never again (issue #29: per-size compiles kept the first step of Qwen3-0.6B's shape from finishing)."""
    import time

    import torch._dynamo

    model = _lora(_model("qwen3")).cuda()
    packed, _ = PackedLM.build(model)
    assert packed is not None
    packed.attention = "flex"
    torch._dynamo.reset()
    before = _graphs()
    per_step, seconds = [], []
    for batch in _batches():
        t = time.perf_counter()
        for idx, lp in packed.chunk_logprobs(batch, 256, torch.device("cuda")):
            sum((x * torch.as_tensor(batch[i].weights, device="cuda")).sum() for i, x in zip(idx, lp)).backward()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
        per_step.append(_graphs() - before)
    assert per_step == [2, 2, 2, 2, 4], (per_step, seconds)


def test_flex_off_cuda_is_one_line_user_error(tmp_path):
    """attention = "flex" without CUDA: the backend refuses at start (FlexAttention has no CPU backward), naming
    the options that work."""
    from backends.errors import UserError
    from backends.local.backend import LocalBackend
    from backends.local.local_config import Local

    with pytest.raises(UserError, match='attention = "flex" needs CUDA') as err:
        LocalBackend(Local(device="cpu", attention="flex"), "tiny", None, tmp_path)
    assert "\n" not in str(err.value) and '"sdpa"' in str(err.value)
    backend = LocalBackend(Local(device="cpu", attention="sdpa"), "tiny", None, tmp_path)
    from backends.types import LoraSpec

    client = backend.create_training_client(LoraSpec(base_model="tiny", rank=4)).result()
    assert client.packed is not None and client.packed.attention == "sdpa"  # the option reaches the packed model
    backend.close()


def _check(tmp_path, capsys, *overrides: str) -> tuple[int, str]:
    """`runner check` of a one-line SFT recipe (its data file absent) with `overrides`: (exit code, stderr)."""
    from runner.cli import main

    recipe = tmp_path / "r.toml"
    recipe.write_text('[recipes.r]\nalgo = {kind = "sft", data = {kind = "jsonl", path = "x.jsonl"}}\n')
    capsys.readouterr()
    return main(["check", str(recipe), *overrides]), capsys.readouterr().err


def test_flex_without_the_packed_path_is_refused_at_check(tmp_path, capsys):
    """attention = "flex" with packed = false was accepted and silently ignored (the padded chunks never call
    FlexAttention); `runner check` names the conflict, on any machine."""
    rc, err = _check(tmp_path, capsys, "backend.attention=flex", "backend.packed=false")
    assert rc == 2 and err.count("\n") == 1 and 'backend: attention = "flex" runs on the packed path' in err, err
    rc, err = _check(tmp_path, capsys, "backend.attention=sdpa", "backend.packed=false")
    assert rc == 2 and "data file not found" in err  # only the data


def test_flex_where_the_packed_path_is_not_taken_is_refused(tmp_path, capsys):
    """attention = "flex" on a training client the packed path does not take (here a full fine-tune: LoRA rank 0)
    trained through the padded chunks' SDPA without a word; now the client is refused with the packed path's
    reason, and a recipe asking for a full fine-tune with "flex" is refused at `runner check`."""
    import msgspec

    from backends.base import BackendError
    from backends.local.backend import LocalBackend
    from backends.local.local_config import Local
    from backends.types import LoraSpec

    # The device check refuses "flex" on the CPU first; the option is set after it to reach the client's check.
    backend = LocalBackend(Local(device="cpu", attention="sdpa"), "tiny", None, tmp_path / "b")
    try:
        backend.cfg = msgspec.structs.replace(backend.cfg, attention="flex")
        assert backend.create_training_client(LoraSpec(base_model="tiny", rank=4)).result().packed is not None
        with pytest.raises(BackendError, match=r'attention = "flex" runs on the packed path, which this model does '
                                               r'not take \(trainable embeddings\)') as err:
            backend.create_training_client(LoraSpec(base_model="tiny", rank=0)).result()
        assert err.value.user_error and "\n" not in str(err.value)
    finally:
        backend.close()
    rc, err_text = _check(tmp_path, capsys, "backend.attention=flex", "backend.full_finetune=true")
    assert rc == 2 and err_text.count("\n") == 1 and "which trains LoRA adapters only" in err_text, err_text


def test_the_mask_builder_compiles_once_whatever_the_grad_mode(monkeypatch):
    """Training chunks and forward-only ones (forward(), reference logprobs) in one run share the compiled block-mask
    builder: it always runs without gradients (Dynamo guards on grad mode; the kernel compiles once per mode)."""
    import torch._dynamo

    monkeypatch.setattr(flex, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()
    before = _graphs()
    for i, batch in enumerate(_batches()):
        for layout in plan(batch, 256, MIN_SHARED):
            padded = flex.padded_rows(len(layout.tokens), 256)
            ends = torch.as_tensor(flex.subtree_ends(layout, padded))
            with torch.set_grad_enabled(i % 2 == 0):
                mask = flex.flex_mask(layout, ends)
            assert mask.padded == padded
            # each chunk's own mask (its `ends` is an input of the compiled builder, not a constant baked in)
            eager = flex.flex_mask(layout, ends, compiled=False)
            assert torch.equal(mask.block_mask.to_dense(), eager.block_mask.to_dense())
    assert _graphs() - before == 2  # 256 rows and 512 (the long row's chunk)
