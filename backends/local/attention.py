"""Attention over a whole packed chunk in one FlexAttention call per layer (the CUDA training path of packed.py).

A packed chunk (backends/local/tree.py's Layout) is lone sequences one after another and prefix trees (a shared
prompt once, then what continues it). Every row attends causally to its own segment (a lone sequence or a tree
node) and to all rows of its segment's ancestors. As a FlexAttention mask_mod that is

    kv <= q  and  visible[segment[q], segment[kv]]

with `segment` the row's segment index and `visible` the (segments x segments) ancestor-or-self table: ancestors
are placed before their descendants, so "kv <= q" is causal within a segment and lets every ancestor row through.
Lone sequences are segments without ancestors (a document mask). The block mask is built once per chunk, on the
device, from two small tensors (no Python loop over sequences or nodes, no host sync); all layers reuse it.

Token counts are bucketed (`bucket`): the chunk is padded to a bucket size with rows in a segment of their own,
so the shapes the compiled kernel sees repeat from step to step. On the CPU FlexAttention has a forward only (no
backward), so CPU training keeps packed.py's own attention (the C tree kernel, or SDPA per block); the tests
compare this path's forward with it on the CPU (tests/test_attention.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from backends.local.tree import Layout

# FlexAttention's block size: the bucket granularity never goes below it.
BLOCK = 128


def available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def bucket(n: int) -> int:
    """n rounded up to a size from a short list (at most 8 per power of two, multiples of BLOCK): a padded chunk
    wastes at most 1/8 of its rows, and a run's chunks reuse a few compiled shapes."""
    step = max(BLOCK, 1 << max(0, n.bit_length() - 4))  # 2 ** (floor(log2 n) - 3)
    return -(-n // step) * step


def segment_tables(layout: Layout, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment index per row, padded to `rows`; visible (S + 1, S + 1) bool: [i, j] = segment j is i or an
    ancestor of i). The padding rows are segment S, visible to itself only."""
    seg, anc, _ = layout.segments()
    index = {first: i for i, (first, _, _, _) in enumerate(seg)}
    s = len(seg)
    visible = np.eye(s + 1, dtype=bool)
    for i, (_, _, a0, a1) in enumerate(seg):
        for first, _ in anc[a0:a1]:
            visible[i, index[first]] = True
    seg_of_row = np.full(rows, s, dtype=np.int64)
    seg_of_row[: len(layout.tokens)] = np.repeat(np.arange(s), [n for _, n, _, _ in seg])
    return seg_of_row, visible


@dataclass
class FlexMask:
    """One chunk's block mask: `rows` real rows, padded to `padded`."""

    block_mask: Any
    rows: int
    padded: int


def flex_mask(layout: Layout, device: torch.device, padded: int | None = None) -> FlexMask:
    """The chunk's block mask at `padded` rows (default: bucket(rows))."""
    from torch.nn.attention.flex_attention import create_block_mask

    n = len(layout.tokens)
    padded = padded or bucket(n)
    seg_np, vis_np = segment_tables(layout, padded)
    seg = torch.as_tensor(seg_np, device=device)
    vis = torch.as_tensor(vis_np, device=device)

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv <= q) & vis[seg[q], seg[kv]]

    block = create_block_mask(mask_mod, None, None, padded, padded, device=str(device), BLOCK_SIZE=BLOCK)
    return FlexMask(block, n, padded)


@functools.cache
def _compiled() -> Any:
    # One kernel per bucketed size (static shapes: dynamic ones failed to build on the CPU with torch 2.13's
    # inductor template); a run sees a few buckets, all of them below the recompile limit raised here.
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    if getattr(dynamo_config, "recompile_limit", 64) < 64:
        dynamo_config.recompile_limit = 64
    return torch.compile(flex_attention, dynamic=False)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
                compiled: bool = True) -> torch.Tensor:
    """q (T, H, D), k/v (T, K, D) of the padded chunk -> (T, H*D), one FlexAttention call. compiled=False runs
    FlexAttention's eager reference (a test's CPU forward: slow, materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled() if compiled else flex_attention
    T, H, D = q.shape
    o = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask.block_mask,
           scale=scale, enable_gqa=H != k.shape[1])
    return o[0].transpose(0, 1).reshape(T, H * D)
