"""Many LoRA clients, one base: every training client of a local backend (and so of `runner serve`, which keeps one
backend per served model) trains its adapters over the same frozen base tensors (backends/local/model.py shared_copy),
so an extra client costs its adapters and their optimizer state, not another copy of the model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from backends.local import LocalBackend
from backends.local.config import Local
from backends.types import AdamParams, Datum, LoraSpec


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


def test_eight_training_clients_share_one_base(tmp_path: Path) -> None:
    be = LocalBackend(Local(), "tiny", None, tmp_path, seed=0)
    try:
        seq = list(range(1, 18))
        datum = Datum(seq[:-1], np.array(seq[1:]), weights=np.ones(16))
        clients = []
        for i in range(8):
            tc = be.create_training_client(LoraSpec("tiny", rank=8, seed=i)).result()
            # One step each, so every client holds its Adam moments too.
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(AdamParams(learning_rate=1e-3)).result()
            clients.append(tc)
        one, eight = sum(_storages(clients[:1]).values()), sum(_storages(clients).values())
        base = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in (*be.base().parameters(), *be.base().buffers())}.values())
        own = one - base  # one client's adapters and Adam moments
        # Eight clients hold one base and eight adapter sets: no client copies the base. (On tiny, rank-8 adapters on
        # every module plus Adam are ~30% of the 3.3 MB base, so 8 clients are ~2.6x one; on a billion-parameter model
        # the same adapters are well under 1% of it.)
        assert eight == base + 8 * own, (one, eight, base)
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
