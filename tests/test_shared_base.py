"""Many LoRA clients, one base: every training client of a local backend (and so of `runner serve`, which keeps one
backend per served model) trains its adapters over the same frozen base tensors (backends/local/model.py shared_copy),
so an extra client costs its adapters and their optimizer state, not another copy of the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from backends.local import LocalBackend
from backends.local.local_config import Local
from backends.types import AdamParams, Datum, LoraSpec, SamplingParams


def _storages(clients: list) -> dict[int, int]:
    """Bytes of every distinct tensor storage the clients' models and optimizers hold, by storage address."""
    seen: dict[int, int] = {}
    for tc in clients:
        tensors = [*tc.model.parameters(), *tc.model.buffers()]
        for state in tc.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return seen


@pytest.mark.parametrize("rank", [4, 8])
def test_eight_training_clients_share_one_base(tmp_path: Path, rank: int) -> None:
    be = LocalBackend(Local(), "tiny", None, tmp_path, seed=0)
    try:
        seq = list(range(1, 18))
        datum = Datum(seq[:-1], np.array(seq[1:]), weights=np.ones(16))
        clients = []
        for i in range(8):
            tc = be.create_training_client(LoraSpec("tiny", rank=rank, seed=i)).result()
            # One step each, so every client holds its Adam moments too.
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=1e-3)).result()
            clients.append(tc)
        one, eight = sum(_storages(clients[:1]).values()), sum(_storages(clients).values())
        base = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*be.base().parameters(), *be.base().buffers())}.values())
        own = one - base  # one client's adapters and Adam moments
        # Eight clients hold one base and eight adapter sets: no client copies the base. Each costs its adapters
        # and their two Adam moments, 3 x 4 bytes x rank x (in + out) summed over the adapted layers: on tiny
        # (hidden 128) rank 4 is 1/32 of the width, four times the share Tinker's default rank 32 has of an 8B
        # model's 4096, and eight clients cost under 2x one; rank 8 (1/16) costs ~30% of the base per client.
        adapters = sum(p.numel() for n, p in clients[0].model.named_parameters() if "lora_" in n)
        assert own == 3 * 4 * adapters + sum(  # + AdamW's per-parameter step counters
            v.untyped_storage().nbytes() for st in clients[0].optimizer.state.values() for k, v in st.items()
            if k == "step"), (own, adapters)
        assert eight == base + 8 * own, (one, eight, base)
        if rank == 4:
            assert eight < 2 * one, (eight / one)
        assert 0 < own < base / 3, (own, base)
        # The base weights are the very same tensors in every client.
        ptrs = [{p.untyped_storage().data_ptr() for n, p in tc.model.named_parameters() if "lora_" not in n}
                for tc in clients]
        assert all(p == ptrs[0] for p in ptrs)
        # ... and the clients did train apart: their adapters differ.
        a = [next(p for n, p in tc.model.named_parameters() if "lora_A" in n) for tc in clients[:2]]
        assert not torch.equal(a[0], a[1])
    finally:
        be.close()


def _trained(be: LocalBackend, seed: int, steps: int = 3):
    seq = list(range(1, 18))
    datum = Datum(seq[:-1], np.array(seq[1:]), weights=np.ones(16))
    tc = be.create_training_client(LoraSpec("tiny", rank=8, seed=seed)).result()
    for _ in range(steps):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=1e-2)).result()
    return tc


def test_unmerged_sampling_clients_share_the_base_and_sample_what_merged_ones_do(tmp_path: Path) -> None:
    """sampler_weights = "lora": a sampling client holds the base's own tensors plus a copy of its adapters
    (LoraDelta), and computes what a merged one does (same tokens under one seed, logprobs to float rounding),
    on the CPU fast path (llama.LlamaDecoder) and off it."""
    from backends.local.llama import LoraDelta

    merged_be = LocalBackend(Local(sampler_weights="merged"), "tiny", None, tmp_path / "m", seed=0)
    lora_be = LocalBackend(Local(sampler_weights="lora"), "tiny", None, tmp_path / "l", seed=0)
    try:
        assert merged_be.merge_samplers() and not lora_be.merge_samplers()
        assert LocalBackend(Local(), "tiny", None, tmp_path / "a", seed=0).merge_samplers()  # auto: CPU, tiny
        tcs = [_trained(be, seed=3) for be in (merged_be, lora_be)]
        scs = [tc.save_weights_and_get_sampling_client().result() for tc in tcs]
        m_model, l_model = (sc._sampler.model for sc in scs)
        assert sum(isinstance(m, LoraDelta) for m in l_model.modules()) == 4 * 7 + 1  # 7 per layer, and lm_head
        base = {t.untyped_storage().data_ptr() for t in (*lora_be.base().parameters(), *lora_be.base().buffers())}
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in (*l_model.parameters(), *l_model.buffers())}
        extra = sum(n for p, n in own.items() if p not in base)
        adapters = sum(p.numel() * p.element_size() for n, p in tcs[1].model.named_parameters() if "lora_" in n)
        assert extra == adapters, (extra, adapters)  # the adapters, nothing of the base
        merged_own = sum(t.untyped_storage().nbytes() for t in m_model.parameters()
                         if t.untyped_storage().data_ptr() not in
                         {q.untyped_storage().data_ptr() for q in merged_be.base().parameters()})
        assert merged_own > 5 * extra  # a merged client copies the adapted weights
        assert scs[1]._sampler.fast is not None  # the CPU fast path takes unmerged adapters
        prompt = [5, 9, 11, 40, 2]
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, stop=[])
        outs = [sc.sample(prompt, 4, params).result() for sc in scs]
        for a, b in zip(outs[0].sequences, outs[1].sequences):
            assert a.tokens == b.tokens
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        seq = prompt + outs[0].sequences[0].tokens
        lp = [sc.compute_logprobs(seq).result() for sc in scs]
        np.testing.assert_allclose(np.array(lp[0][1:]), np.array(lp[1][1:]), atol=1e-4)
        # The HF-module path (no fast decoder) computes the same through LoraDelta.forward.
        scs[1]._sampler.fast = None
        slow = scs[1].sample(prompt, 4, params).result()
        assert [s.tokens for s in slow.sequences] == [s.tokens for s in outs[1].sequences]
        # A snapshot is immutable: training on does not change what an earlier client samples.
        _ = [tcs[1].forward_backward([Datum(prompt[:-1], np.array(prompt[1:]), weights=np.ones(4))],
                                     "cross_entropy").result(), tcs[1].optim_step(AdamParams(learning_rate=0.1)).result()]
        again = scs[0].sample(prompt, 4, params).result()
        assert [s.tokens for s in again.sequences] == [s.tokens for s in outs[0].sequences]
        scs[1]._sampler.fast = None
        assert [s.tokens for s in scs[1].sample(prompt, 4, params).result().sequences] == \
            [s.tokens for s in outs[1].sequences]
    finally:
        merged_be.close()
        lora_be.close()
