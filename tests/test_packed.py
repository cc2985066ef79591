"""The padding-free packed forward (backends/local/packed.py) computes what the HF model computes on each
sequence alone: logprobs and LoRA gradients, for every family member it accepts; anything else falls back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from backends.local import batching, tree
from backends.local import model as M
from backends.local import packed as packed_mod
from backends.local.packed import MIN_SHARED, PackedLM, plan
from backends.local.tiny import build_tokenizer
from backends.types import Datum

CPU = torch.device("cpu")


def _model(kind: str) -> torch.nn.Module:
    tok = build_tokenizer()
    common = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}
    torch.manual_seed(0)
    if kind in ("qwen3", "qwen3-d64", "qwen3-d128"):  # the C tree attention has a build per head size
        head_dim = {"qwen3": 16, "qwen3-d64": 64, "qwen3-d128": 128}[kind]
        cfg = transformers.Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=True)
    elif kind == "qwen2":  # q/k/v biases
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False)
    elif kind == "llama":  # MHA, llama3 rope scaling, untied head
        cfg = transformers.LlamaConfig(**{**common, "num_key_value_heads": 4}, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    else:
        raise ValueError(kind)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    if kind == "qwen2":
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.requires_grad_(False)
    return model


def _lora(base: torch.nn.Module, unembed: bool = True, mlp: bool = True) -> torch.nn.Module:
    model = M.make_trainable(base, M.TrainSetup(4, 8.0, M.lora_targets(base, True, mlp, unembed)), 0)
    with torch.no_grad():  # B = 0 at init would hide any error in the LoRA terms
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model


def _data(lengths: list[int], k: int = 1, seed: int = 0) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(0, 259, n)
        targets = rng.integers(0, 259, (n, k)) if k > 1 else rng.integers(0, 259, n)
        out.append(Datum(list(map(int, ids)), targets, weights=rng.random(targets.shape).astype(np.float32)))
    return out


def _run(model, data, chunks_iter) -> tuple[dict[int, torch.Tensor], dict[str, torch.Tensor], float]:
    lps: dict[int, torch.Tensor] = {}
    total = 0.0
    for idx, lp in chunks_iter:
        loss = sum((x * torch.as_tensor(data[i].weights)).sum() for i, x in zip(idx, lp))
        assert isinstance(loss, torch.Tensor)
        loss.backward()
        total += float(loss.detach())
        lps.update({i: x.detach() for i, x in zip(idx, lp)})
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lps, grads, total


def _compare(model, data, budget: int = 16384, fused: bool = True) -> None:
    """fused: the packed forward with its fused CPU kernels (backends/local/kernels.py), else torch's eager ops."""
    packed, why = PackedLM.build(model)
    assert packed is not None, why
    if not fused:
        packed.kernels = None
    elif packed.kernels is None:
        pytest.skip("no C compiler: the fused kernels are not built")
    ref_lp, ref_g, ref_loss = _run(model, data, batching.chunk_logprobs(model, data, CPU, 16384))
    lp, g, loss = _run(model, data, packed.chunk_logprobs(data, budget, CPU))
    assert sorted(lp) == list(range(len(data)))
    for i, d in enumerate(data):
        assert lp[i].shape == d.target_tokens.shape
        torch.testing.assert_close(lp[i], ref_lp[i], atol=2e-5, rtol=1e-5)
    assert set(g) == set(ref_g) and len(g) > 0
    for name in g:  # float noise only: a wrong term would be off by O(1) of the gradient's norm
        err = float((g[name] - ref_g[name]).norm() / ref_g[name].norm())
        assert err < 1e-5, (name, err)
    assert loss == pytest.approx(ref_loss, rel=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "qwen3-d64", "qwen3-d128"])
def test_packed_matches_hf_per_sequence(kind, fused):
    model = _lora(_model(kind))
    data = _data([37, 5, 64, 1, 19, 19, 19, 40])  # equal lengths exercise the batched attention runs
    _compare(model, data, fused=fused)


def test_packed_chunks_and_topk_targets():
    model = _lora(_model("qwen3"), unembed=False, mlp=False)
    data = _data([30, 12, 30, 7], k=3)
    chunks = [layout.datums for layout in plan(data, 40)]  # several chunks (30 + 12 > 40)
    assert len(chunks) == 3 and sorted(i for c in chunks for i in c) == [0, 1, 2, 3]
    _compare(model, data, 40)


def test_plan_packs_fills_to_budget_longest_first():
    assert tree.plan_packs([5, 9, 3, 9], 20) == [[1, 3], [0, 2]]
    assert tree.plan_packs([50, 2], 10) == [[0], [1]]  # a row over the budget goes alone


def _group(prompt: list[int], completions: list[int], seed: int) -> list[Datum]:
    """An RL group: one prompt, completions of the given lengths (datum = prompt + completion, shifted)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in completions:
        seq = prompt + list(map(int, rng.integers(0, 259, n + 1)))
        k = len(seq) - 1
        out.append(Datum(seq[:-1], np.array(seq[1:]), weights=rng.random(k).astype(np.float32)))
    return out


@pytest.mark.parametrize(("kind", "call_cost", "fused"), [("qwen3", None, True), ("qwen3", None, False), ("llama", None, True),
                                                    ("qwen3", 0, True), ("qwen3", 10**9, True), ("qwen3", 0, "torch-attn")])
def test_shared_prompts_pack_as_trees_and_match_hf(kind, call_cost, fused, monkeypatch):
    # call_cost 0: every tree runs member by member; 10**9: every tree is one masked call. "torch-attn": the
    # fused kernels but torch's attention backward (a head size without a C attention kernel).
    if call_cost is not None:
        monkeypatch.setattr(packed_mod, "_CALL_COST", call_cost)
    calls = []
    if fused == "torch-attn":
        monkeypatch.setattr(packed_mod, "ATTN_HEAD_DIMS", ())
    else:
        real = packed_mod._TreeAttention.apply
        monkeypatch.setattr(packed_mod._TreeAttention, "apply", lambda *a: calls.append(a[3]) or real(*a))
    rng = np.random.default_rng(1)
    p1, p2 = list(map(int, rng.integers(0, 259, 40))), list(map(int, rng.integers(0, 259, 25)))
    data = _group(p1, [3, 0, 7, 3], 0) + _data([33, 12]) + _group(p2, [5, 1, 60], 2)
    data.insert(1, Datum(p1[:30], np.array(p1[1:31])))  # shares 30 tokens with the first group
    data[-1] = Datum(data[-1].model_input, data[-1].target_tokens, weights=None, logprobs=None)
    for d in data:  # every datum has weights for _run
        if d.weights is None:
            object.__setattr__(d, "weights", np.ones(d.length, np.float32))
    (layout,) = plan(data, 16384)
    assert sorted(layout.datums) == list(range(len(data)))
    assert len(layout.trees) == 2 and {t[0][1] for t in layout.trees} == {30, 25}  # root runs
    assert len(layout.tokens) == sum(d.length for d in data) - 30 * 4 - 25 * 2  # each prefix packed once
    _compare(_lora(_model(kind)), data, fused=bool(fused))
    # the C tree attention ran where it applies (fused, float32, head size 16), and only there
    assert bool(calls) == (fused is True), calls


@pytest.mark.parametrize("call_cost", [0, 10**9])
def test_nested_sharing_packs_each_shared_run_once_and_matches_hf(call_cost, monkeypatch):
    # A system prompt shared by six datums; below it, two first turns each shared by two of them (one of them
    # also the whole of an earlier turn: a datum that is a prefix of another), a duplicate, and a short
    # common run (< MIN_SHARED) that stays unshared.
    monkeypatch.setattr(packed_mod, "_CALL_COST", call_cost)
    rng = np.random.default_rng(7)

    def toks(n: int) -> list[int]:
        return list(map(int, rng.integers(0, 259, n)))

    system, turn_a, turn_b, short = toks(20), toks(18), toks(24), toks(MIN_SHARED - 2)
    seqs = [system + turn_a + toks(5), system + turn_a, system + turn_b + toks(20), system + turn_b + toks(3),
            system + short + toks(4), system + short + toks(6), toks(33)]
    seqs.append(list(seqs[2]))  # a duplicate
    data = [Datum(s[:-1], np.array(s[1:]), weights=rng.random(len(s) - 1).astype(np.float32)) for s in seqs]
    (layout,) = plan(data, 16384)
    assert sorted(layout.datums) == list(range(len(data)))
    (tree,) = layout.trees
    assert tree[0][1] == 20 and tree[0][2] == -1  # the system prompt is the root
    # tokens: the system prompt once, turn_a once, turn_b once and each tail once (the duplicate shares all
    # of its tokens), the short run once per datum, the lone sequence
    n_inputs = [d.length for d in data]
    expected = 20 + 18 + (n_inputs[0] - 38) + 24 + (n_inputs[2] - 44) + (n_inputs[3] - 44) \
        + (n_inputs[4] - 20) + (n_inputs[5] - 20) + n_inputs[6]
    assert len(layout.tokens) == expected
    for i, d in enumerate(data):  # each datum's rows hold its own tokens at its own positions
        assert [layout.tokens[r] for r in layout.rows[i]] == d.model_input
        assert [layout.positions[r] for r in layout.rows[i]] == list(range(d.length))
    _compare(_lora(_model("qwen3")), data)


def test_short_common_prefixes_are_not_shared():
    rng = np.random.default_rng(3)
    prompt = list(map(int, rng.integers(0, 259, MIN_SHARED - 1)))
    data = _group(prompt, [20, 30], 0)
    (layout,) = plan(data, 16384)
    assert layout.trees == [] and len(layout.tokens) == sum(d.length for d in data)


def test_unsupported_models_fall_back():
    base = _model("qwen3")
    full = M.make_trainable(base, M.TrainSetup(0, 1.0, ()), 0)
    assert PackedLM.build(full)[0] is None and "trainable" in PackedLM.build(full)[1]
    dynamic = _model("llama")
    dynamic.model.rotary_emb.rope_type = "dynamic"  # scaling that depends on the forward's longest position
    assert PackedLM.build(_lora(dynamic))[0] is None
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    packed, why = PackedLM.build(gpt2)
    assert packed is None and "gpt2" in why


def test_bfloat16_base_with_float32_adapters():
    # As on CUDA (dtype auto): a bfloat16 base, and peft keeps the adapters in float32.
    model = _lora(_model("qwen3").to(torch.bfloat16))
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    data = _data([20, 9, 9, 31])
    packed, why = PackedLM.build(model)
    assert packed is not None, why
    ref_lp, ref_g, _ = _run(model, data, batching.chunk_logprobs(model, data, CPU, 16384))
    lp, g, _ = _run(model, data, packed.chunk_logprobs(data, 16384, CPU))
    for i in range(len(data)):  # bfloat16 rounding (measured 0.007; bf16 vs fp32 HF itself differ by 0.009)
        assert float((lp[i] - ref_lp[i]).abs().max()) < 0.03
    for name in g:
        assert g[name].dtype == torch.float32
        assert float((g[name] - ref_g[name]).norm() / ref_g[name].norm()) < 0.03, name  # measured 0.012


def test_the_planner_is_torch_free():
    """backends/local/tree.py plans chunks in pure Python and numpy: importing it (a fresh interpreter) loads no
    torch, and a plan comes out."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, numpy as np; from backends.local.tree import plan; from backends.types import Datum; "
            "d = [Datum(model_input=list(range(20)) + [k], target_tokens=np.zeros(21, dtype=np.int64)) for k in range(3)]; "
            "(lay,) = plan(d, 1000, 4); assert len(lay.tokens) == 23, lay.tokens; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
