"""Padding-free training forward for Llama-family decoders (llama, mistral, qwen2, qwen3) with LoRA.

The batch's sequences are packed into one token matrix (T x hidden, no padding at all), with rotary
positions restarting at 0 for each sequence; every Linear layer runs once over all T tokens, and causal
attention runs per sequence (sequences of equal length batched into one SDPA call). Sequences that share a
prompt are packed as a tree, the prompt once (see MIN_SHARED). This computes what the model computes on each
sequence alone, to float rounding (tests/test_packed.py compares it with the HF forward).

Why not the peft modules' own forward over a packed row: measured side by side (bench/bench_train.py), the
HF + peft module path spends much of a step outside the matmuls on small and mid-size models (peft's
per-layer base + lora_A + lora_B + scale + add, HF's RMSNorm in six ops, autograd saving every
intermediate). Measured (bench/bench_train.py: batches of 16 chat rows, fp32, 1 thread, the whole step through
the backend): without prefix sharing 1.28x (tiny) and 1.18x (25M model) the tokens/s of a packed loop through
the peft modules with per-conversation SDPA, the best hand-written peer; 1.50x and 1.44x with it. Per layer:
- the projections that share an input (q/k/v; gate/up) share one x @ A^T for their LoRA A matrices, the
  LoRA term is added in place, and a custom autograd function computes only what a frozen base needs in
  backward (the input gradient, accumulated in place, plus the LoRA A/B gradients). Fusing the frozen q/k/v
  weights into one matmul was measured too: no faster on the CPU (190-200 GFLOP/s either way), and it
  copies the weights, so it went;
- RMSNorm is one function with a hand-written backward (two saved tensors instead of five).
- In float32 on the CPU, the elementwise work runs as fused C kernels (backends/local/kernels.py, built on first
  use): the residual add with the next RMSNorm, Qwen3's per-head q/k norm with the rotary embedding, and SwiGLU,
  each one pass over memory forward and one backward, where torch's eager ops take 3-10 (these tensors do not
  stay in cache). Without a C compiler, or on another device or dtype, torch's eager ops do the same work.
The parameters are still peft's (the same lora_A / lora_B tensors the optimizer steps and checkpoints save);
only the arithmetic is ours, so peft keeps owning adapters, checkpoints and export.

Anything else (another architecture, DoRA, sliding-window layers, a full fine-tune, ...) makes
`PackedLM.build` return None with the reason, and the backend uses the padded path (backends/local/batching.py).
Attention over the chunk is the C tree kernel (float32 on the CPU) or torch's SDPA per block, or with
`attention = "flex"` one FlexAttention call per layer (backends/local/attention.py); on every device the target
logprobs come from a chunked unembedding (backends/local/logprobs.py). Index arrays reach the device without a
host sync (backends/local/transfer.py). docs/local-backend.md says what runs where; docs/gpu.md has the GPU
figures (bench/bench_gpu.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from backends.local import attention as flex
from backends.local import logprobs as LP
from backends.local.batching import chunk_tokens
from backends.local.device import AutogradCtx
from backends.local.kernels import ATTN_HEAD_DIMS, Kernels
from backends.local.kernels import MAX_HEAD_DIM as kernels_max_head_dim
from backends.local.kernels import load as load_kernels
from backends.local.llama import llama_family_problem, rms_norm, rope
from backends.local.model import lora_linear_parts
from backends.local.transfer import h2d, to_device
from backends.local.tree import MIN_SHARED, Layout, ancestors, plan
from backends.types import Datum

# Tokens per packed chunk when the unembedding is chunked (logprobs.py): activations, not logits, bound it
# (PackedLM.token_budget): at most MAX_PACKED_TOKENS, and saved activations within a quarter of the GPU's memory
# or 4 GiB on the CPU (tiny and bench_train's 25M model: 16,384 either way; Qwen3-0.6B on an 80 GB GPU: 16,384;
# Qwen3-1.7B: ~11k).
MAX_PACKED_TOKENS = 16384
ACTIVATION_FRACTION = 0.25
ACTIVATION_BYTES = 4 << 30

# ---------------------------------------------------------------- autograd functions


# The fused forms (backends/local/kernels.py: float32 on the CPU), each one pass over memory each way. Their
# backward recomputes what the eager forms save (x * rstd, silu(g)) from the inputs, which are kept anyway.


class _FusedNormCtx(AutogradCtx, Protocol):
    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x (+ r), w, rstd
    k: Kernels
    added: bool  # r was given


class _FusedNorm(torch.autograd.Function):
    """norm(x) * w, or with r: (x + r, norm(x + r) * w), the residual add and the next norm in one pass; the
    backward adds the residual stream's gradient (of x + r) to the norm's in the same pass."""

    @staticmethod
    def forward(ctx: _FusedNormCtx, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, eps: float, k: Kernels
                ) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        xo, y, rstd = k.rms_fwd(x, w, eps, r)
        ctx.set_materialize_grads(False)  # the last layer's x + r is not used: no zeros to add
        ctx.k, ctx.added = k, r is not None
        ctx.save_for_backward(xo, w, rstd)
        return (xo, y) if r is not None else y

    @staticmethod
    def backward(ctx: _FusedNormCtx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        xo, w, rstd = ctx.saved_tensors
        dres, dy = grads if ctx.added else (None, grads[0])
        if dy is None:
            d = dres
        else:
            d = ctx.k.rms_bwd(dy.contiguous(), xo, w, rstd, None if dres is None else dres.contiguous())
        return d, d if ctx.added else None, None, None, None


class _FusedNormRopeCtx(AutogradCtx, Protocol):
    saved_tensors: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]  # x (None without a norm), cos, sin
    k: Kernels
    w: torch.Tensor | None
    rstd: torch.Tensor | None


class _FusedNormRope(torch.autograd.Function):
    """rotary(norm(x) * w) per head (Qwen3's q/k norms), or rotary(x) when w is None; x (T, H, D)."""

    @staticmethod
    def forward(ctx: _FusedNormRopeCtx, x: torch.Tensor, w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                eps: float, k: Kernels) -> torch.Tensor:
        out, rstd = k.norm_rope_fwd(x, w, cos, sin, eps)
        ctx.k, ctx.w, ctx.rstd = k, w, rstd
        ctx.save_for_backward(x if w is not None else None, cos, sin)
        return out

    @staticmethod
    def backward(ctx: _FusedNormRopeCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, cos, sin = ctx.saved_tensors
        dy = grads[0].contiguous()
        return ctx.k.norm_rope_bwd(dy, x if x is not None else dy, ctx.w, cos, sin, ctx.rstd), None, None, None, None, None


class _FusedSwiGLUCtx(AutogradCtx, Protocol):
    saved_tensors: tuple[torch.Tensor, torch.Tensor]  # g, u
    k: Kernels


class _FusedSwiGLU(torch.autograd.Function):
    """silu(g) * u."""

    @staticmethod
    def forward(ctx: _FusedSwiGLUCtx, g: torch.Tensor, u: torch.Tensor, k: Kernels) -> torch.Tensor:
        ctx.k = k
        ctx.save_for_backward(g, u)
        return k.swiglu_fwd(g, u)

    @staticmethod
    def backward(ctx: _FusedSwiGLUCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        g, u = ctx.saved_tensors
        dg, du = ctx.k.swiglu_bwd(grads[0].contiguous(), g, u)
        return dg, du, None


class _TreeAttentionCtx(AutogradCtx, Protocol):
    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v, o, lse
    plan: _AttnPlan
    scale: float
    kern: Kernels


class _TreeAttention(torch.autograd.Function):
    """Attention over the whole packed chunk in one call per direction (kernels.c, tree attention): every lone
    sequence and every prefix-tree node is a segment that sees its ancestors' rows and its own causally, read in
    place from q (T, H, D), k, v (T, KV, D) -> (T, H*D). The forward keeps the row logsumexp; the backward
    recomputes the probabilities from it (as flash attention does) and forms dk, dv for ancestors' rows as the sum
    over their descendants. Nothing is split, masked or concatenated around it (see _attention for torch's way)."""

    @staticmethod
    def forward(ctx: _TreeAttentionCtx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _AttnPlan, scale: float,
                kern: Kernels) -> torch.Tensor:
        o, lse = kern.tree_attn_fwd(q, k, v, plan.seg, plan.anc, plan.koff, plan.nmax, scale)
        ctx.plan, ctx.scale, ctx.kern = plan, scale, kern
        ctx.save_for_backward(q, k, v, o, lse)
        return o.view(q.shape[0], -1)

    @staticmethod
    def backward(ctx: _TreeAttentionCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        plan = ctx.plan
        do = grads[0].contiguous().view(q.shape)
        dq, dk, dv = ctx.kern.tree_attn_bwd(q, k, v, o, do, lse, plan.seg, plan.anc, plan.koff, plan.nmax, ctx.scale)
        return dq, dk, dv, None, None, None


@dataclass
class _AttnPlan:
    """A Layout's segments for _TreeAttention: seg (nseg, 4) = first row, rows, first and end index into anc;
    anc (x, 2) = an ancestor segment's first row and rows, root first; koff (nseg + 1) = the running count of
    the segments' keys (ancestors' rows and their own); the most rows of a segment."""

    seg: torch.Tensor
    anc: torch.Tensor
    koff: torch.Tensor
    nmax: int


class _LoraGroupCtx(AutogradCtx, Protocol):
    # x (in the adapters' dtype), u = x @ A_cat^T and A_cat (None when no layer of the group is adapted), the B's
    saved_tensors: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, *tuple[torch.Tensor, ...]]
    spec: _Group


class _LoraGroup(torch.autograd.Function):
    """Several LoRA-adapted Linear layers that read the same input x (T x in):

        y_i = x @ W_i^T (+ b_i) + s_i * (x @ A_i^T) @ B_i^T

    The frozen W_i and b_i never get gradients; only x, the A's (passed concatenated: one x @ A^T for the
    group) and the B's do. The LoRA term is added in place (addmm_: measured 1.1-1.5x faster than an
    out-of-place addmm on these shapes, which are memory-bound), and backward accumulates dx in place.

    Adapters in another dtype than the base (peft keeps them float32 under a bfloat16 base) run in their own
    dtype, as peft's forward does: x is cast to it, the LoRA term is added in float32 and the sum cast back."""

    @staticmethod
    def forward(ctx: _LoraGroupCtx, x: torch.Tensor, spec: _Group, a_cat: torch.Tensor | None, *bs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        xa = x if a_cat is None or a_cat.dtype == x.dtype else x.to(a_cat.dtype)
        u = xa @ a_cat.t() if a_cat is not None else None
        outs = []
        bi = 0
        for w, bias, r, s in zip(spec.weights, spec.biases, spec.rank_slices, spec.scales):
            y = F.linear(x, w, bias)
            if r is not None and u is not None:
                if y.dtype == u.dtype:
                    y.addmm_(u[:, r[0]:r[1]], bs[bi].t(), alpha=s)
                else:
                    y = torch.addmm(y.to(u.dtype), u[:, r[0]:r[1]], bs[bi].t(), alpha=s).to(y.dtype)
                bi += 1
            outs.append(y)
        ctx.spec = spec
        ctx.save_for_backward(xa, u, a_cat, *bs)
        return tuple(outs)

    @staticmethod
    def backward(ctx: _LoraGroupCtx, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        spec = ctx.spec
        xa, u, a_cat, *bs = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:  # not for the first layer's projections of the (frozen) embeddings
            dx = dys[0] @ spec.weights[0]
            for d, w in zip(dys[1:], spec.weights[1:]):
                dx.addmm_(d, w)
        da = None
        dbs: list[torch.Tensor | None] = []
        if u is not None and a_cat is not None:  # both or neither
            dus = []
            bi = 0
            for d, r, s in zip(dys, spec.rank_slices, spec.scales):
                if r is None:
                    continue
                ui = u[:, r[0]:r[1]]
                d = d.to(u.dtype)
                # (u^T d)^T, not d^T u: MKL runs the skinny product with the small side first ~2x faster
                # (bench/README.md); the transposed view is B's gradient as is.
                dbs.append(torch.mm(ui.t(), d).mul_(s).t() if ctx.needs_input_grad[3 + bi] else None)
                dus.append(torch.mm(d, bs[bi]).mul_(s))
                bi += 1
            du = torch.cat(dus, dim=1) if len(dus) > 1 else dus[0]
            if dx is not None:
                if dx.dtype == du.dtype:
                    dx.addmm_(du, a_cat)
                else:
                    dx = dx.add_((du @ a_cat).to(dx.dtype))
            if ctx.needs_input_grad[2]:
                da = du.t() @ xa
        return (dx, None, da, *dbs)


@dataclass
class _Group:
    """One _LoraGroup: the frozen Linear weights and where each layer's LoRA sits."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    rank_slices: list[tuple[int, int] | None]  # columns of x @ A_cat^T for each layer (None: not adapted)
    scales: list[float]
    a_params: list[nn.Parameter]
    b_params: list[nn.Parameter]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a_cat = None
        if self.a_params:
            a_cat = torch.cat(list(self.a_params)) if len(self.a_params) > 1 else self.a_params[0]
        return _LoraGroup.apply(x, self, a_cat, *self.b_params)  # type: ignore[no-any-return]


def _lora_parts(layer: nn.Module) -> tuple[nn.Linear, torch.Tensor | None, torch.Tensor | None, float]:
    """(frozen Linear, A, B, scale) of a peft LoRA Linear (model.lora_linear_parts), or (layer, None, None, 0)
    for a plain Linear."""
    if type(layer) is nn.Linear:
        return layer, None, None, 0.0
    parts = lora_linear_parts(layer)
    if isinstance(parts, str):
        raise _Unsupported(parts)
    from peft.tuners.lora import LoraLayer

    assert isinstance(layer, LoraLayer)  # lora_linear_parts checked it is a plain LoRA Linear
    dropout = layer.lora_dropout[layer.active_adapters[0]]
    if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0.0) != 0.0:
        raise _Unsupported("LoRA dropout")
    return parts


def _group(modules: Sequence[nn.Module]) -> _Group:
    parts = [_lora_parts(m) for m in modules]
    weights: list[torch.Tensor] = [p[0].weight for p in parts]
    biases: list[torch.Tensor | None] = [p[0].bias for p in parts]
    if any(w.requires_grad for w in weights) or any(b is not None and b.requires_grad for b in biases):
        raise _Unsupported("trainable base weights (full fine-tune)")
    rank_slices: list[tuple[int, int] | None] = []
    a_params, b_params, scales = [], [], []
    r = 0
    for _, a, b, s in parts:
        if a is None or b is None:
            rank_slices.append(None)
        else:
            rank_slices.append((r, r + a.shape[0]))
            r += a.shape[0]
            a_params.append(a)
            b_params.append(b)
        scales.append(s)
    return _Group(weights, biases, rank_slices, scales, a_params, b_params)


class _Unsupported(Exception):
    pass


# ---------------------------------------------------------------- the model


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: _Group
    o: _Group
    gate_up: _Group
    down: _Group
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class PackedLM:
    """The packed forward of one (peft-wrapped) Llama-family model. Build with `PackedLM.build(model)`, which
    returns None with a reason when the model is outside what this computes exactly."""

    def __init__(self, model: nn.Module):
        wrapped: Any = model
        inner: Any = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else wrapped
        cfg = inner.config
        problem = llama_family_problem(cfg, getattr(getattr(inner, "model", None), "rotary_emb", None))
        if problem is not None:
            raise _Unsupported(problem)
        body = inner.model
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise _Unsupported(f"hidden_act {cfg.hidden_act!r}")
        self.embed = body.embed_tokens
        if self.embed.weight.requires_grad:
            raise _Unsupported("trainable embeddings")
        self.rotary = body.rotary_emb
        self.final_norm = body.norm.weight
        self.eps = float(cfg.rms_norm_eps)
        self.hidden_size = int(cfg.hidden_size)
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        first = body.layers[0].self_attn
        self.head_dim = int(getattr(first, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
        self.scaling = float(first.scaling)
        self.layers = []
        for layer in body.layers:
            att, mlp = layer.self_attn, layer.mlp
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if norm.weight.requires_grad:
                    raise _Unsupported("trainable norms")
            q_norm = getattr(att, "q_norm", None)
            k_norm = getattr(att, "k_norm", None)
            self.layers.append(_Layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                _group([att.q_proj, att.k_proj, att.v_proj]), _group([att.o_proj]),
                _group([mlp.gate_proj, mlp.up_proj]), _group([mlp.down_proj]),
                None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
            ))
        head, self.head_a, self.head_b, self.head_s = _lora_parts(inner.get_output_embeddings())
        self.head_w = head.weight
        # Target logprobs by the chunked unembedding (backends/local/logprobs.py); False: full logits per chunk
        # (the reference path, kept for tests and bench comparisons).
        self.chunked_head = True
        # Attention over a chunk (the Local backend option `attention`, backends/local/local_config.py): "auto"
        # the C tree kernel where it is built (float32 on the CPU), else SDPA per block; "sdpa" SDPA per block
        # always; "flex" FlexAttention (attention.py; forward only on the CPU). flex_compiled=False runs
        # FlexAttention's eager reference (CPU tests).
        self.attention = "auto"
        self.flex_compiled = True
        if self.head_w.requires_grad:
            raise _Unsupported("trainable lm_head")
        if head.bias is not None:
            raise _Unsupported("lm_head bias")
        # Fused elementwise kernels: float32 on the CPU only (load_kernels builds nothing elsewhere).
        w = self.embed.weight
        self.kernels = load_kernels(w.device, w.dtype) if self.head_dim <= kernels_max_head_dim else None

    def min_shared(self) -> int:
        """The shortest run worth sharing for this model. Sharing a run saves its tokens' work in every layer
        but adds an attention call per layer; the saving grows with hidden^2, the call's cost does not.
        Measured (bench_train batches, 1 thread, interleaved): hidden 512 (25M) 3% faster with 6 than with 16;
        hidden 128 (tiny) 1.5% slower. So MIN_SHARED up to hidden 128, scaled by (128 / hidden)^2 above, at
        least 4."""
        return max(4, round(MIN_SHARED * min(1.0, (128 / self.hidden_size) ** 2)))

    @staticmethod
    def build(model: nn.Module) -> tuple[PackedLM | None, str]:
        try:
            return PackedLM(model), ""
        except _Unsupported as exc:
            return None, str(exc)
        except AttributeError as exc:  # a family member laid out differently than expected
            return None, f"unexpected layout ({exc})"

    # ---------------------------------------------------------------- forward

    def hidden(self, ids: torch.Tensor, layout: Layout, budget: int | None = None) -> torch.Tensor:
        """Final-norm hidden states (T x hidden) of the packed tokens `ids` (T,) laid out by `layout`; budget: the
        chunk token limit the layout was planned under (FlexAttention pads every chunk to it: attention.py)."""
        if self.use_flex(ids.device):
            return self._hidden_flex(ids, layout, budget or len(layout.tokens))
        x = self.embed(ids)
        pos = h2d(layout.positions, ids.device, np.int64)
        cos, sin = self.rotary(x[None], pos[None])
        T, H, K, D = ids.shape[0], self.n_heads, self.n_kv, self.head_dim
        kern = self.kernels if self.kernels is not None and Kernels.usable(x, cos, sin) and cos.shape[-1] == D else None
        if kern is None:
            blocks = attention_blocks(layout, ids.device)
            return self._hidden_eager(x, cos[0, :, None, :], sin[0, :, None, :],
                                      lambda q, k, v: _attention(q, k, v, blocks, self.scaling))
        cos, sin, eps = cos[0].contiguous(), sin[0].contiguous(), self.eps
        plan = attention_plan(layout) if D in ATTN_HEAD_DIMS and self.attention != "sdpa" else None
        blocks = attention_blocks(layout, ids.device) if plan is None else []
        h = _FusedNorm.apply(x, None, self.layers[0].ln1, eps, kern)
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(h)
            q = _FusedNormRope.apply(q.view(T, H, D), layer.q_norm, cos, sin, eps, kern)
            k = _FusedNormRope.apply(k.view(T, K, D), layer.k_norm, cos, sin, eps, kern)
            if plan is not None:
                a = _TreeAttention.apply(q, k, v.view(T, K, D), plan, self.scaling, kern)
            else:
                a = _attention(q, k, v.view(T, K, D), blocks, self.scaling)
            (o,) = layer.o(a)
            x, h = _FusedNorm.apply(x, o, layer.ln2, eps, kern)
            g, u = layer.gate_up(h)
            (d,) = layer.down(_FusedSwiGLU.apply(g, u, kern))
            nxt = self.layers[i + 1].ln1 if i + 1 < len(self.layers) else self.final_norm
            x, h = _FusedNorm.apply(x, d, nxt, eps, kern)
        return h

    def use_flex(self, device: torch.device) -> bool:
        """Whether hidden() runs attention as one FlexAttention call per layer (backends/local/attention.py):
        `attention` "flex" only. "auto" does not choose it yet: on an H200 its compiles per chunk size kept
        Qwen3-0.6B's first step from finishing (issue #29); it becomes "auto"'s CUDA path once bench/bench_gpu.py
        measures ours-flex faster than ours-sdpa with the one padded size per run (docs/gpu.md)."""
        return self.attention == "flex"

    def _hidden_flex(self, ids: torch.Tensor, layout: Layout, budget: int) -> torch.Tensor:
        """hidden() with FlexAttention: one block mask for every layer; only the attention call sees padding
        (attention.py: every chunk of a run at one padded size, so it compiles once). The eager reference
        (flex_compiled False, CPU tests) pads to the next BLOCK only: it materialises padded^2 scores."""
        n = ids.shape[0]
        padded = flex.padded_rows(n, budget if self.flex_compiled else n)
        ends = h2d(flex.subtree_ends(layout, padded), ids.device)
        mask = flex.flex_mask(layout, ends, self.flex_compiled)
        x = self.embed(ids)
        cos, sin = self.rotary(x[None], h2d(layout.positions, ids.device, np.int64)[None])
        return self._hidden_eager(x, cos[0, :, None, :], sin[0, :, None, :],
                                  lambda q, k, v: flex.flex_attend(q, k, v, mask, self.scaling, self.flex_compiled))

    def _hidden_eager(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """hidden() in torch's eager ops (no fused kernels: another device or dtype, or no C compiler); attend(q, k,
        v) is the attention over the chunk."""
        T, H, K, D = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        for layer in self.layers:
            h = rms_norm(x, layer.ln1, self.eps)
            q, k, v = layer.qkv(h)
            q, k, v = q.view(T, H, D), k.view(T, K, D), v.view(T, K, D)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = rms_norm(q, layer.q_norm, self.eps), rms_norm(k, layer.k_norm, self.eps)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = attend(q, k, v)
            (o,) = layer.o(a)
            x = x + o
            h = rms_norm(x, layer.ln2, self.eps)
            g, u = layer.gate_up(h)
            (d,) = layer.down(F.silu(g) * u)
            x = x + d
        return rms_norm(x, self.final_norm, self.eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        out = F.linear(h, self.head_w)
        a, b = self.head_a, self.head_b
        if a is not None and b is not None:
            # In the adapter's dtype, then cast back, as peft does.
            out = torch.addmm(out.to(a.dtype), h.to(a.dtype) @ a.t(), b.t(), alpha=self.head_s).to(out.dtype)
        return out

    def token_budget(self, vocab: int) -> int:
        """Tokens per packed chunk. With the chunked unembedding the activations bound a chunk, not the logits:
        as many tokens as keep the saved activations (about 4 hidden + 2 q + 2 kv + 3 intermediate values per
        token and layer) within ACTIVATION_FRACTION of the GPU's memory or ACTIVATION_BYTES on the CPU, at most
        MAX_PACKED_TOKENS, at least batching.chunk_tokens' (the float32 logits budget, the bound without it)."""
        if not self.chunked_head:
            return chunk_tokens(vocab)
        w = self.embed.weight
        q, kv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        inter = int(self.layers[0].gate_up.weights[0].shape[0])
        per_token = len(self.layers) * (4 * self.hidden_size + 2 * q + 2 * kv + 3 * inter) * w.element_size()
        if w.device.type == "cuda":
            limit = int(torch.cuda.get_device_properties(w.device).total_memory * ACTIVATION_FRACTION)
        else:
            limit = ACTIVATION_BYTES
        return max(chunk_tokens(vocab), min(MAX_PACKED_TOKENS, limit // per_token))

    def chunk_logprobs(self, data: list[Datum], budget: int, device: torch.device,
                       trained: Sequence[np.ndarray | None] | None = None
                       ) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
        """As batching.chunk_logprobs: (datum indices, their float32 target logprobs shaped like target_tokens),
        one packed chunk of at most `budget` tokens (a longer segment alone) at a time (see token_budget).
        trained[i] (bool per position of datum i, or None: all) says where a gradient can be nonzero; the
        chunked unembedding (backends/local/logprobs.py) recomputes only those rows in backward."""
        for layout in plan(data, budget, self.min_shared()):
            idx = layout.datums
            ids = h2d(layout.tokens, device, np.int64)
            h = self.hidden(ids, layout, budget)
            if self.chunked_head:
                rows = np.concatenate([layout.rows[i] for i in idx])
                targets = np.concatenate([data[i].target_tokens.reshape(data[i].length, -1) for i in idx])
                grad = None
                if trained is not None and any(trained[i] is not None for i in idx):
                    parts: list[np.ndarray] = []
                    for i in idx:
                        t = trained[i]
                        parts.append(np.ones(data[i].length, bool) if t is None else t)
                    grad = np.concatenate(parts)
                lp_plan = LP.plan(rows, targets, h.shape[0], self.head_w.shape[0], device, grad)
                a, b = self.head_a, self.head_b
                flat = LP.target_logprobs(h, self.head_w, lp_plan, None if a is None or b is None else (a, b, self.head_s))
                sizes = [data[i].target_tokens.size for i in idx]
                yield idx, [x.view(data[i].target_tokens.shape) for i, x in zip(idx, flat.split(sizes))]
                continue
            logits = self.logits(h).float()
            lse = torch.logsumexp(logits, dim=-1)
            if all(data[i].target_tokens.ndim == 1 for i in idx):
                # One gather for the chunk (a datum's rows may include a shared prefix's).
                flat_rows, targets_t = to_device([np.concatenate([layout.rows[i] for i in idx]),
                                                  np.concatenate([data[i].target_tokens for i in idx])], device, np.int64)
                lp_all = logits[flat_rows, targets_t] - lse[flat_rows]
                out = list(lp_all.split([data[i].length for i in idx]))
            else:
                out = []
                moved = to_device([layout.rows[i] for i in idx] + [data[i].target_tokens for i in idx], device, np.int64)
                for i, r, t in zip(idx, moved[:len(idx)], moved[len(idx):]):
                    t = t.view(len(r), -1)
                    out.append((logits[r].gather(-1, t) - lse[r, None]).view(data[i].target_tokens.shape))
            yield idx, out


# ---------------------------------------------------------------- attention work of a planned chunk (tree.py)

# One SDPA call's fixed cost, in units of attention scores (one query x one key), for choosing how a tree runs.
_CALL_COST = 4096


@dataclass
class _Block:
    start: int
    size: int  # rows
    count: int = 1  # a run of `count` causal sequences of size // count rows each
    mask: torch.Tensor | None = None  # a tree in one call
    # a tree node by node, in row order: (rows, ancestor node indices, mask against ancestors' rows + its own)
    nodes: list[tuple[int, list[int], torch.Tensor | None]] | None = None


def attention_plan(layout: Layout) -> _AttnPlan:
    """The chunk's segments for _TreeAttention (Layout.segments as tensors)."""
    seg, anc, keys = layout.segments()
    return _AttnPlan(torch.tensor(seg, dtype=torch.int64).view(-1, 4), torch.tensor(anc or [(0, 0)], dtype=torch.int64),
                     torch.tensor([0, *np.cumsum(keys)], dtype=torch.int64), max(n for _, n, _, _ in seg))


def attention_blocks(layout: Layout, device: torch.device) -> list[_Block]:
    """The attention blocks in row order: runs of lone causal sequences, and trees. A tree whose branches
    are short (an RL group: a prompt and a few answer tokens) is one SDPA call with its mask over all its
    rows; one with long branches would waste most of that square, so it runs node by node: each node's
    rows against its ancestors' rows and its own (a lower-right causal mask; a root alone is causal)."""
    blocks = [_Block(start, c * n, c) for start, c, n in layout.runs]
    for nodes in layout.trees:
        start = nodes[0][0]
        n = sum(length for _, length, _ in nodes)
        chains = ancestors(nodes)
        above = [sum(nodes[a][1] for a in chain) for chain in chains]  # per node, its ancestors' rows
        split_cost = sum(length * (up + length / 2) + _CALL_COST for (_, length, _), up in zip(nodes, above) if length)
        if n * n <= split_cost:
            visible = np.zeros((len(nodes), len(nodes)), dtype=bool)  # [i, j]: node j is i or an ancestor of i
            for i, anc in enumerate(chains):
                visible[i, [*anc, i]] = True
            owner = np.repeat(np.arange(len(nodes)), [length for _, length, _ in nodes])
            mask = h2d(visible[owner[:, None], owner[None, :]], device)
            blocks.append(_Block(start, n, mask=mask & torch.ones(n, n, dtype=torch.bool, device=device).tril()))
        else:
            plan_nodes = []
            for (_, length, _), anc, up in zip(nodes, chains, above):
                mask = None
                if up and length:  # lower-right causal: row r sees every ancestor row and its own rows <= r
                    mask = torch.arange(up + length, device=device)[None, :] <= torch.arange(length, device=device)[:, None] + up
                plan_nodes.append((length, anc, mask))
            blocks.append(_Block(start, n, nodes=plan_nodes))
    return sorted(blocks, key=lambda b: b.start)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: list[_Block], scale: float) -> torch.Tensor:
    """Attention within each block in torch's SDPA (no C kernels, or another head size or device): q (T, H, D),
    k/v (T, K, D) -> (T, H*D). A run of c causal sequences of length n is one SDPA call over (c, heads, n, D).
    torch.split, not slicing: a slice's backward zero-fills a whole-size gradient per piece, split's concatenates
    once."""
    _, H, D = q.shape
    K = k.shape[1]

    def sdpa(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, c: int, mask: torch.Tensor | None) -> torch.Tensor:
        n, m = qs.shape[0] // c, ks.shape[0] // c
        o = F.scaled_dot_product_attention(qs.view(c, n, H, D).transpose(1, 2), ks.view(c, m, K, D).transpose(1, 2),
                                           vs.view(c, m, K, D).transpose(1, 2), attn_mask=mask,
                                           is_causal=mask is None, scale=scale, enable_gqa=H != K)
        return o.transpose(1, 2).reshape(c * n, H * D)

    sizes = [b.size for b in blocks]
    outs = []
    for qs, ks, vs, b in zip(q.split(sizes), k.split(sizes), v.split(sizes), blocks):
        if b.nodes is None:
            outs.append(sdpa(qs, ks, vs, b.count, b.mask))
            continue
        parts = [length for length, _, _ in b.nodes]
        qx, kx, vx = qs.split(parts), ks.split(parts), vs.split(parts)
        for j, (length, anc, mask) in enumerate(b.nodes):
            if not length:
                continue
            if not anc:
                outs.append(sdpa(qx[j], kx[j], vx[j], 1, None))
            else:
                kj = torch.cat([kx[a] for a in anc] + [kx[j]])
                vj = torch.cat([vx[a] for a in anc] + [vx[j]])
                outs.append(sdpa(qx[j], kj, vj, 1, mask))
    return torch.cat(outs) if len(outs) > 1 else outs[0]
