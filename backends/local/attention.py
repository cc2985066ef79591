"""Attention over a whole packed chunk in one FlexAttention call per layer (`attention = "flex"`, packed.py).

A packed chunk (backends/local/tree.py's Layout) is lone sequences one after another and prefix trees (a shared
prompt once, then what continues it). Every row attends causally to its own segment (a lone sequence or a tree
node) and to all rows of its segment's ancestors. tree.py places a tree in pre-order (a node, then each child's
subtree), so a segment's descendants are exactly the rows from its end to its subtree's end, and the visibility
rule is one comparison per side, with `ends[row]` the end of the subtree of the row's segment:

    kv <= q  and  q < ends[kv]

(kv's segment is q's or an ancestor of it). Lone sequences are segments without children (a document mask).
The block mask is built once per chunk on the device from that one vector of row indices and every layer uses
it; no Python loop over sequences or nodes runs in the step.

One compiled shape per run. Only the attention call is padded (q, k, v get zero rows at the end; every other
layer runs on the chunk's real rows): to `padded_rows(n, budget)`, the chunk token budget rounded up to BLOCK,
the same for every chunk of a run, the last and smaller ones too (a lone sequence longer than the budget: a
multiple of it). So the compiled kernel (forward and backward) and the compiled block-mask builder each compile
once per run, not once per chunk size (a forward without gradients, forward() or reference logprobs, compiles the
kernel once more: Dynamo guards on grad mode): a run whose chunks took a new size at every step recompiled at every step
(issue #29: on an H200 the first training step of Qwen3-0.6B's shape had not finished after 210 s). Padding rows
sit in segments of one BLOCK each, so the block mask skips all but their diagonal blocks and the kernel does
almost no work for them. tests/test_attention.py counts the compiles of a multi-step run with varied batches.

On the CPU FlexAttention has a forward only (no backward), so CPU training keeps packed.py's own attention (the
C tree kernel, or SDPA per block); the tests compare this path's forward with it on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from backends.local.tree import Layout

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

# FlexAttention's block size: the padded sizes are multiples of it.
BLOCK = 128
# The backend torch.compile hands the graphs to: "inductor" (the fused kernels); tests set "eager" to count
# Dynamo's compiles (one per graph it would hand to inductor) in seconds instead of generating kernels.
COMPILE_BACKEND = "inductor"


def available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def padded_rows(n: int, budget: int) -> int:
    """The rows FlexAttention sees for a chunk of n rows planned under a `budget`-token chunk limit: the budget
    rounded up to BLOCK, or the least multiple of that which holds n (a lone sequence longer than the budget)."""
    unit = -(-max(budget, 1) // BLOCK) * BLOCK
    return -(-n // unit) * unit


def subtree_ends(layout: Layout, rows: int) -> np.ndarray:
    """Per row (padded to `rows`), the end row of its segment's subtree: a lone sequence's own end; a tree node's
    last descendant's end (tree.py places a tree in pre-order, so a node's descendants are the rows right after
    it). Padding rows form segments that end at each multiple of BLOCK (and at `rows`): a padding row sees the
    padding rows of its own block up to itself, never a real row, and the mask's off-diagonal padding blocks are
    empty."""
    end = np.minimum((np.arange(rows, dtype=np.int64) // BLOCK + 1) * BLOCK, rows)
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

    block_mask: BlockMask
    rows: int
    padded: int


def flex_mask(layout: Layout, ends: torch.Tensor, compiled: bool = True) -> FlexMask:
    """The chunk's block mask over ends' rows (ends: subtree_ends(layout, padded) on the device). compiled: built
    by the compiled builder (on CUDA eagerly it would materialise padded^2 booleans and their index tensors:
    gigabytes at 16k rows); False: eagerly (the CPU tests' reference)."""
    from torch.nn.attention.flex_attention import create_block_mask

    padded = int(ends.shape[0])

    # A new closure per chunk (each chunk's BlockMask keeps its own `ends`: forward_backward_custom runs every
    # chunk's forward before any backward): Dynamo guards on the code and on ends' shape, not on the objects, so
    # this does not recompile (the test counts).
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (q < ends[kv])

    build = _mask_builder(COMPILE_BACKEND) if compiled else create_block_mask
    with torch.no_grad():  # Dynamo guards on grad mode: forward-only and training calls share one compiled builder
        block = build(mask_mod, None, None, padded, padded, device=str(ends.device), BLOCK_SIZE=BLOCK)
    return FlexMask(block, len(layout.tokens), padded)


@functools.cache
def _mask_builder(backend: str) -> Callable[..., BlockMask]:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=False, backend=backend)


@functools.cache
def _compiled(backend: str = "inductor") -> Callable[..., torch.Tensor]:
    # Static shapes (dynamic ones failed to build on the CPU with torch 2.13's inductor template): one kernel per
    # padded size, and a run has one or two (padded_rows). The recompile limit is raised anyway so that several
    # models in one process (a bench) stay compiled.
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    if getattr(dynamo_config, "recompile_limit", 64) < 64:
        dynamo_config.recompile_limit = 64
    return torch.compile(flex_attention, dynamic=False, backend=backend)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask, scale: float,
                compiled: bool = True) -> torch.Tensor:
    """q (n, H, D), k/v (n, K, D) of the chunk's real rows -> (n, H*D), one FlexAttention call over them padded
    to mask.padded rows. compiled=False runs FlexAttention's eager reference (a test's CPU forward: slow,
    materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    # Any: torch 2.13 types flex_attention's return by overloads (a Tensor here); 2.11 declares only the union of
    # Tensor and its (out, lse) tuples, which would make `o[0, ...]` a type error under 2.11.
    fn: Any = _compiled(COMPILE_BACKEND) if compiled else flex_attention
    n, H, D = q.shape
    pad = mask.padded - n
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    o = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask.block_mask,
           scale=scale, enable_gqa=H != k.shape[1])
    return o[0, :, :n].transpose(0, 1).reshape(n, H * D)
