"""Attention over a whole packed chunk in one FlexAttention call per layer (the CUDA training path of packed.py).

A packed chunk (backends/local/tree.py's Layout) is lone sequences one after another and prefix trees (a shared
prompt once, then what continues it). Every row attends causally to its own segment (a lone sequence or a tree
node) and to all rows of its segment's ancestors. tree.py places a tree in pre-order (a node, then each child's
subtree), so a segment's descendants are exactly the rows from its end to its subtree's end, and the visibility
rule is one comparison per side, with `ends[row]` the end of the subtree of the row's segment:

    kv <= q  and  q < ends[kv]

(kv's segment is q's or an ancestor of it). Lone sequences are segments without children (a document mask).
The block mask is built once per chunk on the device from that one vector of row indices (its shape is the
bucket's, so the compiled mask builder is reused too) and every layer uses it; no Python loop over sequences or
nodes runs in the step.

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


def subtree_ends(layout: Layout, rows: int) -> np.ndarray:
    """Per row (padded to `rows`), the end row of its segment's subtree: a lone sequence's own end; a tree node's
    last descendant's end (tree.py places a tree in pre-order, so a node's descendants are the rows right after
    it). Padding rows get `rows` (they see each other, never a real row)."""
    end = np.full(rows, rows, dtype=np.int64)
    for start, count, n in layout.runs:
        for i in range(count):
            end[start + i * n:start + (i + 1) * n] = start + (i + 1) * n
    for nodes in layout.trees:
        ends = [first + length for first, length, _ in nodes]
        for i in range(len(nodes) - 1, 0, -1):
            parent = nodes[i][2]
            ends[parent] = max(ends[parent], ends[i])
        for (first, length, _), e in zip(nodes, ends):
            end[first:first + length] = e
    return end


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
    ends = torch.as_tensor(subtree_ends(layout, padded), device=device)

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        return (kv <= q) & (q < ends[kv])

    # On CUDA the mask is evaluated block by block by a compiled kernel (eagerly it would materialise padded^2
    # booleans and their index tensors: gigabytes at 16k rows); the CPU (tests, small chunks) builds it eagerly.
    block = create_block_mask(mask_mod, None, None, padded, padded, device=str(device), BLOCK_SIZE=BLOCK,
                              _compile=device.type == "cuda")
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
