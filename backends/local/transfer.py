"""Host arrays to the training device without a host sync (issue #29: no sync inside a training step).

torch's plain host-to-device copy from pageable memory (`torch.as_tensor(array, device="cuda")`) waits for the
device to finish everything queued before it: inside a step, each one stalls the host until the GPU drains its
queue, and a per-datum copy makes that one stall per datum. Here the arrays go through pinned memory with
non_blocking copies (the caching host allocator keeps the pinned buffer until its copy has run), several small
arrays of one dtype as one copy. On the CPU the arrays are wrapped as they are (torch.from_numpy: no copy), so CPU
numbers are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch


def to_device(arrays: Sequence[npt.ArrayLike], device: torch.device, dtype: npt.DTypeLike | None = None) -> list[torch.Tensor]:
    """Each array (anything np.asarray takes, cast to the numpy `dtype` if given) as a tensor on `device`, in one
    non-blocking copy per dtype."""
    arrs = [np.ascontiguousarray(a if dtype is None else np.asarray(a, dtype=dtype)) for a in arrays]
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrs]
    return _batched(arrs, device)


def _batched(arrs: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """to_device's copy off the CPU: the arrays of each dtype concatenated, pinned (CUDA), copied non-blocking
    and split into views shaped as they were (tests run it to the CPU)."""
    out: list[torch.Tensor | None] = [None] * len(arrs)
    groups: dict[np.dtype, list[int]] = {}
    for i, a in enumerate(arrs):
        groups.setdefault(a.dtype, []).append(i)
    for idx in groups.values():
        host = torch.from_numpy(np.concatenate([arrs[i].reshape(-1) for i in idx]))
        if device.type == "cuda":
            host = host.pin_memory()
        flat = host.to(device, non_blocking=True)
        for i, part in zip(idx, flat.split([arrs[i].size for i in idx])):
            out[i] = part.view(arrs[i].shape)
    return [t for t in out if t is not None]


def h2d(array: npt.ArrayLike, device: torch.device, dtype: npt.DTypeLike | None = None) -> torch.Tensor:
    """One array as a tensor on `device` (to_device of one)."""
    return to_device([array], device, dtype)[0]
