"""backends/local/transfer.py: arrays reach the device as they were (values, dtypes, shapes, order), several of a
dtype in one copy; on the CPU without a copy at all."""

from __future__ import annotations

import numpy as np
import torch

from backends.local import transfer

CPU = torch.device("cpu")


def _arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 9, 5), rng.random((3, 4)).astype(np.float32), np.array([True, False, True]),
            rng.integers(0, 9, (2, 3)), np.zeros(0, np.int64), rng.random(2).astype(np.float32)]


def test_the_batched_copy_keeps_every_array():
    arrs = _arrays()
    out = transfer._batched(arrs, CPU)  # the path a GPU takes, run to the CPU
    assert len(out) == len(arrs)
    for a, t in zip(arrs, out):
        assert t.shape == a.shape and t.dtype == torch.from_numpy(a).dtype
        assert np.array_equal(t.numpy(), a)
    assert out[0].untyped_storage().data_ptr() == out[3].untyped_storage().data_ptr()  # int64s: one buffer


def test_on_the_cpu_nothing_is_copied_and_dtype_casts():
    arrs = _arrays()
    out = transfer.to_device(arrs, CPU)
    assert all(np.shares_memory(t.numpy(), a) for a, t in zip(arrs, out) if a.size)
    t = transfer.h2d([1, 2, 3], CPU, np.int64)
    assert t.dtype == torch.int64 and t.tolist() == [1, 2, 3]
