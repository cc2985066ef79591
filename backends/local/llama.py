"""The Llama-family decoder's math on plain tensors, shared by packed training and decoding.

Llama, Mistral, Qwen2 and Qwen3 decoders (`LLAMA_FAMILY`) are, per layer, exactly: RMSNorm, q/k/v projections
(optional bias; Qwen3 adds a per-head RMSNorm on q and k), rotary embedding, attention, o projection, residual,
RMSNorm, act(gate) * up, down, residual. This module holds those pieces once:
- which models qualify (`llama_family_problem`), for packed.py (training) and the sampler (decoding);
- `rope` (HF's apply_rotary_pos_emb for one tensor) and the RMSNorms: `rms_norm` with a hand-written backward
  (training: two saved tensors instead of five) and `rms_norm_eval` (decoding: torch's fused op in float32);
- `LlamaDecoder`, the forward the sampler decodes with (CPU, and CUDA at static shapes: `step_static`, which
  backends/local/static_decode.py captures as CUDA graphs): the same layers on plain tensors instead of
  HF's modules, with matmul weights in the layouts MKL and oneDNN run fastest (`packs_for_onednn`, which
  model.sampling_snapshot also reads), prompt tokens packed without padding for the prefill, and no per-step
  module or cache machinery. bench/bench_sampling.py measures it against `model.generate`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from backends.local.device import ADAPTER_DTYPE, AutogradCtx, add_adapter_term

# Decoders whose layers backends/local/packed.py (training) and sampler.py (decoding) compute on plain tensors.
LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def llama_family_problem(cfg: object, rotary: object) -> str | None:
    """Why a model (its text config and rotary module) is outside what the plain-tensor paths compute exactly,
    or None if it is inside."""
    if getattr(cfg, "model_type", None) not in LLAMA_FAMILY:
        return f"model_type {getattr(cfg, 'model_type', None)!r}"
    rope_type = getattr(rotary, "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        # Their tables depend on the longest position in the forward (a packed short sequence would get the
        # longest one's scaling, a decode step the prompt's).
        return f"rope_type {rope_type!r} depends on the sequence length"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "not every layer is full attention"
    return None


# ---------------------------------------------------------------- rotary and norms


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor (rotate_half convention), the same operations. cos/sin broadcast
    against x (..., head_dim)."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


class _RMSNormCtx(AutogradCtx, Protocol):
    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x * rstd (float32), rstd, w


class _RMSNorm(torch.autograd.Function):
    """y = w * (x * rsqrt(mean(x^2) + eps)) over the last dim, computed in float32 as HF's RMSNorm does (the
    normalised x is cast back to x's dtype before the weight); w is frozen (never trained here)."""

    @staticmethod
    def forward(ctx: _RMSNormCtx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        xhat = xf * rstd
        ctx.save_for_backward(xhat, rstd, w)
        return w * xhat.to(x.dtype)

    @staticmethod
    def backward(ctx: _RMSNormCtx, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (dy,) = grad_outputs
        xhat, rstd, w = ctx.saved_tensors  # xhat: x * rstd (before w), float32
        g = (dy * w).float()
        # d/dx of x*rstd: rstd * (g - xhat * mean(g * xhat))
        dx = g.sub_(xhat * (g * xhat).mean(-1, keepdim=True)).mul_(rstd)
        return dx.to(dy.dtype), None, None


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _RMSNorm.apply(x, w, eps)  # type: ignore[no-any-return]


def rms_norm_eval(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's RMSNorm computes in fp32 and casts before the weight; torch's fused rms_norm gives the same fp32
    # result bit for bit (measured) in about 3/4 of the time.
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


# ---------------------------------------------------------------- the decoding forward

class Slots:
    """What the cache layers of one decode batch share: where each row writes its next token (None during
    the prefill, which fills slots 0.. of every row) and how many slots the attention sees."""

    def __init__(self) -> None:
        self.write: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.view = 0


# Weights derived once from a source weight (transposed, or packed for oneDNN), kept as long as the source
# lives: the samplers of one base model share one copy of its frozen weights. Keyed by (id, kind); the weak
# reference tells a live entry from one whose id was reused.
_DERIVED: dict[tuple[int, str], tuple[weakref.ref, torch.Tensor]] = {}
# Reentrant: a garbage collection while the lock is held may run a weak reference's callback (_forget) on
# the same thread.
_DERIVED_LOCK = threading.RLock()

# Weights of at least this many bytes use oneDNN's prepacked fp32 matmul. Streaming a large weight from
# memory, it beats MKL's sgemm: 8 rows x 512 -> 1536: 341 us vs 501 (transposed) and 540 (F.linear's
# layout); 32 rows: 595 vs 692. On cache-resident weights its ~15 us per call overhead loses (tiny's
# 128 -> 384 at 8 rows: 21 us vs 5), and at 1 MiB (512 x 512) it is a draw. Measured on this project's
# CPU box (2 cores of a Xeon, one thread); its row results are batch-invariant like sgemm's.
_ONEDNN_MIN_BYTES = 2 << 20


def packs_for_onednn(w: torch.Tensor) -> bool:
    """Whether the fast path runs this Linear weight through oneDNN (which wants it (out, in) contiguous, as
    stored by default) rather than as a transposed matrix (see _transposed): model.sampling_snapshot writes
    merged weights in the layout their use wants, so the sampler need not copy them again."""
    big = w.dtype == torch.float32 and w.numel() * w.element_size() >= _ONEDNN_MIN_BYTES
    return big and torch.backends.mkldnn.is_available()


def _derived(w: torch.Tensor, kind: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    key = (id(w), kind)
    with _DERIVED_LOCK:
        hit = _DERIVED.get(key)
        if hit is not None and hit[0]() is w:
            return hit[1]
        out = make()
        _DERIVED[key] = (weakref.ref(w, lambda _ref, key=key: _forget(key)), out)
        return out


def _forget(key: tuple[int, str]) -> None:
    with _DERIVED_LOCK:
        hit = _DERIVED.get(key)
        if hit is not None and hit[0]() is None:
            del _DERIVED[key]


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """A Linear weight (out, in) as a contiguous (in, out) matrix, for `x @ it`. MKL's sgemm runs that layout
    2.3x faster than F.linear's (out, in) one at 8 rows and 1.3x at 32 on cache-resident weights (measured:
    one thread, fp32, 512x1536), and it keeps 4-row matmuls batch-invariant where F.linear's layout does not
    (see LlamaDecoder). A weight already stored that way (the merged snapshots of model.sampling_snapshot) is used
    as is; any other is copied once (see _derived)."""
    d = w.detach()
    if d.t().is_contiguous():
        return d.t()
    return _derived(w, "t", lambda: d.t().contiguous())


def _bias(linear: nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


class LoraDelta(nn.Module):
    """An adapted Linear layer of an unmerged sampling snapshot: y = base(x) + scale * (x @ A^T) @ B^T, the order
    peft's forward computes it in. `base` is the frozen base model's own Linear (shared, never written); A and B
    are private copies, stored transposed ((in, r) and (r, out), the layout `x @ m` multiplies fastest), so the
    snapshot stays what it was when taken while training goes on. A sampling client made of these costs its
    adapters, not a copy of the adapted weights (see model.sampling_snapshot). Under a bfloat16 base the adapters
    stay float32 and their term is added in float32, as peft's forward does (device.add_adapter_term)."""

    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.base = base
        # In ADAPTER_DTYPE (float32) whatever the base's dtype, as trained (backends/local/device.py).
        self.a_t = nn.Parameter(a.detach().t().to(ADAPTER_DTYPE, copy=True).contiguous(), requires_grad=False)
        self.b_t = nn.Parameter(b.detach().t().to(ADAPTER_DTYPE, copy=True).contiguous(), requires_grad=False)
        self.scale = scale

    @property
    def weight(self) -> torch.Tensor:  # what HF code reads of an output embedding (dtype, device, shape)
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_adapter_term(self.base(x), x, self.a_t, self.b_t, self.scale)


class FastLinear:
    """y = x @ W.T (+ b): oneDNN's prepacked matmul for large fp32 weights, else x @ wt with wt the contiguous
    (in, out) matrix (see _ONEDNN_MIN_BYTES and _transposed). Off the CPU, F.linear on the weight as stored
    (cuBLAS takes either layout; a copy would double the weights' memory)."""

    __slots__ = ("a_t", "b", "b_t", "packed", "scale", "w", "wt")

    def __init__(self, linear: nn.Linear | LoraDelta):
        # An unmerged adapter: the base layer's fast matmul plus scale * (x @ A^T) @ B^T (LoraDelta's math).
        self.a_t = self.b_t = None
        self.scale = 1.0
        if isinstance(linear, LoraDelta):
            self.a_t, self.b_t, self.scale = linear.a_t.detach(), linear.b_t.detach(), linear.scale
            linear = linear.base
        # Cached under the parameter itself (a .detach() is a new object each time, and would never hit).
        w, self.b = linear.weight, _bias(linear)
        self.packed: torch.Tensor | None = None
        self.wt: torch.Tensor | None = None
        self.w: torch.Tensor | None = None
        if w.device.type != "cpu":
            self.w = w.detach()
        elif packs_for_onednn(w):
            # The batch-size hint (8) only picks the packed layout; any row count runs (and is batch-invariant).
            d = w.detach()
            self.packed = _derived(w, "onednn", lambda: torch.ops.mkldnn._reorder_linear_weight(d.contiguous(), 8))
        else:
            self.wt = _transposed(w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # torch.ops.mkldnn's linear ops are the ones inductor's CPU weight prepacking emits; were they ever
        # missing (or failing), FastLinear's constructor raises and LlamaDecoder.of falls back to HF's modules.
        if self.w is not None:
            y = F.linear(x, self.w, self.b)
        elif self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")
        else:
            assert self.wt is not None
            y = torch.mm(x, self.wt) if self.b is None else torch.addmm(self.b, x, self.wt)
        if self.a_t is None:
            return y
        assert self.b_t is not None
        return add_adapter_term(y, x, self.a_t, self.b_t, self.scale)


@dataclass
class _Layer:
    ln1: torch.Tensor
    q: FastLinear
    k: FastLinear
    v: FastLinear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: FastLinear
    ln2: torch.Tensor
    gate: FastLinear
    up: FastLinear
    down: FastLinear
    act: Callable[[torch.Tensor], torch.Tensor]


class DecodeCache:
    """The KV cache of the fast path: per layer a zeroed (rows, kv heads, capacity, head dim) buffer for keys
    and one for values, each row holding its tokens at slots 0..n-1 (the batch-invariant layout of
    _GrowingLayer)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], slots: Slots):
        self.keys, self.values, self.slots = keys, values, slots
        self.filled = 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        end = self.filled
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                new = old.new_zeros((len(indices), *old.shape[1:]))
                new[:, :, :end] = old[:, :, :end].index_select(0, indices)
                bufs[i] = new

    def grow(self, extra: int) -> None:
        """`extra` more rows, zeroed (a request joining a running batch: the sampler's continuous batching)."""
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                bufs[i] = torch.cat((old, old.new_zeros((extra, *old.shape[1:]))))

    def put(self, rows: torch.Tensor, src: DecodeCache, index: torch.Tensor) -> None:
        """Row rows[j] := row index[j] of `src` (a joining request's prefill), in place; its slots past what
        `src` holds are zeroed (masked slots are read, so they must be finite)."""
        width = src.keys[0].shape[2]
        for dst, part in zip(self.keys + self.values, src.keys + src.values, strict=True):
            fresh = dst.new_zeros((len(rows), *dst.shape[1:]))
            fresh[:, :, :width] = part.index_select(0, index)
            dst[rows] = fresh
        self.filled = max(self.filled, width)


class LlamaDecoder:
    """The forward of a Llama-family decoder (`model.LLAMA_FAMILY`) on plain tensors, for decoding: what HF's
    modules compute, in fewer and cheaper operations. Linear weights are used in the layouts that multiply
    fastest (see FastLinear),
    the rotary tables are computed once by the model's own rotary module (so every rope_type whose table
    does not depend on the sequence length works), the KV cache is written in place, and only the rows
    whose logits are needed reach the final norm and the unembedding. `of` returns None for any model it
    does not recognise exactly; the Sampler then runs HF's modules."""

    @classmethod
    def of(cls, model: Any) -> LlamaDecoder | None:
        cfg = model.config.get_text_config(decoder=True)
        if getattr(cfg, "model_type", None) not in LLAMA_FAMILY:
            return None
        try:
            return cls(model, cfg)
        except (AttributeError, TypeError, ValueError, RuntimeError):  # RuntimeError: oneDNN refused a weight
            return None

    def __init__(self, model: Any, cfg: Any):
        inner = model.model
        rope = inner.rotary_emb
        problem = llama_family_problem(cfg, rope)
        if problem is not None:
            raise ValueError(problem)
        self.rotary = rope
        if type(inner.embed_tokens) is not nn.Embedding:
            raise TypeError("scaled or custom embedding")
        # Called as a module (a few us) so that forward hooks on the input embeddings see every forward.
        self.embed_tokens = inner.embed_tokens
        self.embed = inner.embed_tokens.weight.detach()
        if type(model.lm_head) is not nn.Linear and type(model.lm_head) is not LoraDelta:
            raise TypeError("custom lm_head")
        # Transposed too (a copy of the embeddings when tied): F.linear's layout gives 4-row matmuls other
        # results than 8-row ones on some shapes (tiny's 128 -> 259), which would break batch invariance.
        self.lm_head = FastLinear(model.lm_head)
        self.norm, self.eps = inner.norm.weight.detach(), float(inner.norm.variance_epsilon)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            linears = (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            if any(type(m) is not nn.Linear and type(m) is not LoraDelta for m in linears):
                raise TypeError("not plain Linear layers (a peft adapter?)")
            qn, kn = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
            self.layers.append(_Layer(
                ln1=layer.input_layernorm.weight.detach(),
                q=FastLinear(att.q_proj),
                k=FastLinear(att.k_proj),
                v=FastLinear(att.v_proj),
                q_norm=None if qn is None else qn.weight.detach(),
                k_norm=None if kn is None else kn.weight.detach(),
                o=FastLinear(att.o_proj),
                ln2=layer.post_attention_layernorm.weight.detach(),
                gate=FastLinear(mlp.gate_proj),
                up=FastLinear(mlp.up_proj),
                down=FastLinear(mlp.down_proj),
                act=mlp.act_fn,
            ))
        att = inner.layers[0].self_attn
        self.head_dim = int(att.head_dim)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.scaling = float(att.scaling)
        self.cos = self.sin = self.embed.new_zeros((0, self.head_dim))

    def _table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (positions, head_dim) for positions 0..n-1, grown by doubling."""
        if self.cos.shape[0] < n:
            m = max(n, 2 * self.cos.shape[0], 256)
            pos = torch.arange(m, device=self.embed.device)[None]
            cos, sin = self.rotary(self.embed[:1][None], pos)
            self.cos, self.sin = cos[0], sin[0]
        return self.cos, self.sin

    def new_cache(self, rows: int, capacity: int, slots: Slots) -> DecodeCache:
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        return DecodeCache(
            [self.embed.new_zeros(shape) for _ in self.layers], [self.embed.new_zeros(shape) for _ in self.layers], slots
        )

    def _qkv(self, layer: _Layer, h: torch.Tensor, lead: tuple[int, ...]):
        q = layer.q(h).view(*lead, self.heads, self.head_dim)
        k = layer.k(h).view(*lead, self.kv_heads, self.head_dim)
        v = layer.v(h).view(*lead, self.kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q = rms_norm_eval(q, layer.q_norm, self.eps)
        if layer.k_norm is not None:
            k = rms_norm_eval(k, layer.k_norm, self.eps)
        return q, k, v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm_eval(x, layer.ln2, self.eps)
        return x + layer.down(layer.act(layer.gate(h)) * layer.up(h))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(rms_norm_eval(x, self.norm, self.eps))

    def prefill(self, prompts: list[list[int]], width: int, pad_id: int, cache: DecodeCache, row_quantum: int
                ) -> torch.Tensor:
        """Fills cache slots 0..len-1 of row i with prompt i (slots up to `width` stay zero, never attended);
        returns the next-token logits of each prompt. The matmuls run on the prompts' tokens packed one
        after another (no padding: mixed-length prompts cost their own length, not the longest one's); only
        attention works per row, on the padded (rows, heads, width, head_dim) layout. Both are
        batch-invariant: a matmul row's result depends neither on its position nor on the other rows
        (measured, for row counts that are multiples of `row_quantum`, which the packed count is rounded to),
        and each prompt's attention sees its own keys at the same slots."""
        dev, p, t = self.embed.device, len(prompts), width
        lens = [len(q) for q in prompts]
        n = sum(lens)
        rows = -(-n // row_quantum) * row_quantum
        ids = torch.full((rows,), pad_id, dtype=torch.long)
        ids[:n] = torch.tensor([tok for q in prompts for tok in q])
        pos = torch.zeros(rows, dtype=torch.long)
        pos[:n] = torch.cat([torch.arange(k) for k in lens])
        # Packed row -> its slot in the padded (rows * width) layout.
        dest = torch.cat([j * t + torch.arange(k) for j, k in enumerate(lens)]).to(dev)
        last = (torch.tensor(lens).cumsum(0) - 1).to(dev)
        ids, pos = ids.to(dev), pos.to(dev)
        cos, sin = self._table(t)
        cos, sin = cos[pos][:, None], sin[pos][:, None]
        x = self.embed_tokens(ids)
        for layer, kbuf, vbuf in zip(self.layers, cache.keys, cache.values):
            q, k, v = self._qkv(layer, rms_norm_eval(x, layer.ln1, self.eps), (rows,))
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            padded = []
            for a in (q, k, v):
                buf = a.new_zeros((p * t, *a.shape[1:]))
                buf.index_copy_(0, dest, a[:n])
                padded.append(buf.view(p, t, *a.shape[1:]).transpose(1, 2))
            q, k, v = padded
            kbuf[:, :, :t] = k
            vbuf[:, :, :t] = v
            a = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.heads != self.kv_heads
            )
            a = a.transpose(1, 2).reshape(p * t, -1).index_select(0, dest)
            if rows > n:
                a = torch.cat((a, a.new_zeros((rows - n, a.shape[1]))))
            x = x + layer.o(a)
            x = self._mlp(layer, x)
        cache.filled = max(cache.filled, t)
        # The unembedding too runs a multiple of `row_quantum` rows (repeats of the last prompt's), however
        # few prompts there are: a group's one shared prompt gets the logits it would get among others.
        last = torch.cat((last, last[-1:].expand(-(-p // row_quantum) * row_quantum - p)))
        return self._logits(x[last])[:p]

    def step(self, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """One new token per row: tok and pos (rows,), written at cache slot pos of its row; mask (rows, 1, 1,
        view) says which of the first `view` slots each row attends to. The next-token logits."""
        n, s = tok.shape[0], cache.slots
        rows, view = s.rows, s.view
        cos, sin = self._table(int(pos.max()) + 1)
        cos, sin = cos[pos][:, None], sin[pos][:, None]
        x = self.embed_tokens(tok)
        group = self.heads // self.kv_heads
        for layer, kbuf, vbuf in zip(self.layers, cache.keys, cache.values):
            q, k, v = self._qkv(layer, rms_norm_eval(x, layer.ln1, self.eps), (n,))
            kbuf[rows, :, pos] = rope(k, cos, sin)
            vbuf[rows, :, pos] = v
            # One query per row: its heads sharing a key/value head become that head's queries (HF's pack_gqa).
            a = F.scaled_dot_product_attention(
                rope(q, cos, sin).view(n, self.kv_heads, group, self.head_dim),
                kbuf[:, :, :view],
                vbuf[:, :, :view],
                attn_mask=mask,
                scale=self.scaling,
            )
            x = x + layer.o(a.reshape(n, -1))
            x = self._mlp(layer, x)
        cache.filled = max(cache.filled, view)
        return self._logits(x)

    def step_static(self, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: DecodeCache
                    ) -> torch.Tensor:
        """`step` with every shape fixed by the cache and no host synchronisation, so that a CUDA graph can
        capture it (backends/local/static_decode.py): each row writes at its slot `pos` by a scatter, attention
        reads every slot of the cache's capacity under mask (rows, 1, 1, capacity), and the rotary table must
        already cover the capacity (`table`). On the CPU it computes what `step` does, bit for bit: the same
        operations, and sdpa gives a query the same output for any key length that is a multiple of 16 with
        the rest masked (decoding.KV_QUANTUM)."""
        n = tok.shape[0]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        x = self.embed_tokens(tok)
        group = self.heads // self.kv_heads
        where = pos.view(n, 1, 1, 1).expand(n, self.kv_heads, 1, self.head_dim)
        for layer, kbuf, vbuf in zip(self.layers, cache.keys, cache.values):
            q, k, v = self._qkv(layer, rms_norm_eval(x, layer.ln1, self.eps), (n,))
            kbuf.scatter_(2, where, rope(k, cos, sin)[:, :, None])
            vbuf.scatter_(2, where, v[:, :, None])
            a = F.scaled_dot_product_attention(
                rope(q, cos, sin).view(n, self.kv_heads, group, self.head_dim), kbuf, vbuf, attn_mask=mask,
                scale=self.scaling,
            )
            x = x + layer.o(a.reshape(n, -1))
            x = self._mlp(layer, x)
        return self._logits(x)

    def table(self, n: int) -> None:
        """Grows the rotary table to cover positions 0..n-1 (step_static reads it as it is)."""
        self._table(n)
