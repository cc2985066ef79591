"""Target logprobs straight from the final hidden states, in chunks of rows: never a [tokens x vocab] float32 tensor.

For packed training (backends/local/packed.py) the unembedding is the largest single tensor of a step: Qwen3's
vocab of 151,936 makes a float32 logits row 0.6 MB, so 17k tokens would be 10 GB before logsumexp and its
backward add as much again. `target_logprobs` computes, for chunks of at most `chunk_rows(vocab)` rows,
`hidden @ W^T` in the compute dtype (bf16 on CUDA), the logsumexp in float32, and gathers the target logits; it
keeps only the per-row logsumexp. Its backward recomputes each chunk's logits and forms
d logits = g * (onehot(target) - softmax) in float32, then d hidden = d logits @ W (and d W, if W is trained)
in the compute dtype, one chunk at a time.

Every loss gets per-token logprobs (shaped like target_tokens, (N,) or (N, K) for top-K cross entropy): the
registry's losses (backends/losses.py) and forward_backward_custom run on them unchanged. Rows are computed once
even when several datums read them (a shared prompt's rows in a prefix tree); the backward only recomputes the
rows some target of which can have a gradient (`Plan.grad`: positions whose loss is identically zero, e.g.
weight 0 under cross_entropy or advantage 0 under the policy-gradient losses, see losses.inert_positions).

Everything index-like is planned on the host (numpy) before the step and moved to the device in non-blocking
copies (backends/local/transfer.py); the chunk loop has Python-int bounds only, so nothing waits on the device (no
host sync) inside forward or backward.
tests/test_logprobs.py checks logprobs and gradients against the full-logits path and the peak memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from backends.local.device import AutogradCtx
from backends.local.transfer import h2d, to_device

# float32 logits per chunk: 2**26 floats (256 MiB; ~440 rows at Qwen3's vocab), at most MAX_CHUNK_ROWS rows.
CHUNK_FLOATS = 2**26
MAX_CHUNK_ROWS = 8192


def chunk_rows(vocab: int) -> int:
    return max(16, min(MAX_CHUNK_ROWS, CHUNK_FLOATS // max(1, vocab)))


@dataclass
class _Pass:
    """One pass over rows in chunks: `rows` (U,) the hidden rows (sorted, unique; None: all rows 0..U-1 in
    order, read as slices), the targets they serve grouped by row: `pair` (P,) the target's index in the
    flattened output, `local` (P,) its row's index in `rows`, `tok` (P,) the token; `bounds` per chunk: (first
    row, end row, first pair, end pair), host ints."""

    rows: torch.Tensor | None
    n: int
    pair: torch.Tensor
    local: torch.Tensor
    tok: torch.Tensor
    bounds: list[tuple[int, int, int, int]]


@dataclass
class Plan:
    """The host-side plan of one target_logprobs call (see `plan`)."""

    n_out: int  # targets in all (datum tokens x K)
    fwd: _Pass
    grad: _Pass  # the rows whose targets may have a gradient (a subset of fwd's rows, in fwd's row numbering)
    grad_index: torch.Tensor | None  # grad's rows as indices into fwd.rows (for the saved logsumexp); None: same


def _make_pass(rows: np.ndarray, out_idx: np.ndarray, tok: np.ndarray, n_hidden: int, chunk: int,
               device: torch.device) -> tuple[_Pass, np.ndarray]:
    """rows (P,) hidden row of each target, out_idx (P,) its output index, tok (P,) its token."""
    uniq, local = np.unique(rows, return_inverse=True)
    order = np.argsort(local, kind="stable")
    local, out_idx, tok = local[order], out_idx[order], tok[order]
    starts = np.arange(0, len(uniq), chunk)
    ends = np.minimum(starts + chunk, len(uniq))
    pstart = np.searchsorted(local, starts)
    pend = np.searchsorted(local, ends)
    whole = len(uniq) == n_hidden  # every row, in order: chunks are slices of hidden, no gather
    t_uniq, t_out, t_local, t_tok = to_device([uniq, out_idx, local, tok], device, np.int64)
    p = _Pass(None if whole else t_uniq, len(uniq), t_out, t_local, t_tok,
              [(int(a), int(b), int(c), int(d)) for a, b, c, d in zip(starts, ends, pstart, pend)])
    return p, uniq


def plan(rows: np.ndarray, targets: np.ndarray, n_hidden: int, vocab: int, device: torch.device,
         grad: np.ndarray | None = None, chunk: int | None = None) -> Plan:
    """rows (N,) the hidden row of each output position, targets (N,) or (N, K) token ids, n_hidden the rows of
    hidden; grad (N,) bool: which positions may get a gradient (None: all)."""
    t2 = targets.reshape(len(rows), -1)
    k = t2.shape[1]
    chunk = chunk or chunk_rows(vocab)
    rows_k = np.repeat(np.asarray(rows, dtype=np.int64), k)
    out_idx = np.arange(len(rows) * k)
    fwd, uniq = _make_pass(rows_k, out_idx, t2.reshape(-1), n_hidden, chunk, device)
    if grad is None:
        return Plan(len(out_idx), fwd, fwd, None)
    g = np.repeat(np.asarray(grad, dtype=bool), k)
    # grad's rows are numbered by their place in fwd's unique rows (fwd's lse is indexed that way)
    local_all = np.searchsorted(uniq, rows_k)
    gp, guniq = _make_pass(local_all[g], out_idx[g], t2.reshape(-1)[g], -1, chunk, device)
    gp.rows = h2d(uniq[guniq], device, np.int64) if fwd.rows is not None or len(guniq) != len(uniq) else None
    index = None if gp.rows is None else h2d(guniq, device, np.int64)
    return Plan(len(out_idx), fwd, gp, index)


def _rows(h: torch.Tensor, p: _Pass, a: int, b: int) -> torch.Tensor:
    return h[a:b] if p.rows is None else h.index_select(0, p.rows[a:b])


def _logits(hc: torch.Tensor, w: torch.Tensor, uc: torch.Tensor | None, b: torch.Tensor | None, s: float
            ) -> torch.Tensor:
    """float32 logits of rows hc: hc @ w^T in the compute dtype, plus a LoRA term s * uc @ b^T (uc = hc @ A^T)
    added in the adapter's dtype and cast back, as peft computes it."""
    z = F.linear(hc, w)
    if uc is not None and b is not None:
        z = torch.addmm(z.to(b.dtype), uc, b.t(), alpha=s).to(z.dtype)
    return z.float()


class _TargetLogprobsCtx(AutogradCtx, Protocol):
    saved_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]
    plan: Plan
    s: float


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: _TargetLogprobsCtx, h: torch.Tensor, w: torch.Tensor, u: torch.Tensor | None, b: torch.Tensor | None,
                s: float, plan: Plan) -> torch.Tensor:
        p = plan.fwd
        out = torch.empty(plan.n_out, dtype=torch.float32, device=h.device)
        lse = torch.empty(p.n, dtype=torch.float32, device=h.device)
        for a, e, pa, pb in p.bounds:
            logits = _logits(_rows(h, p, a, e), w, None if u is None else _rows(u, p, a, e), b, s)
            lse[a:e] = torch.logsumexp(logits, dim=-1)
            loc = p.local[pa:pb] - a
            out[p.pair[pa:pb]] = logits[loc, p.tok[pa:pb]] - lse[a:e][loc]
            del logits
        ctx.plan, ctx.s = plan, s
        ctx.save_for_backward(h, w, u, b, lse)
        return out

    @staticmethod
    def backward(ctx: _TargetLogprobsCtx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (g,) = grads
        h, w, u, b, lse_all = ctx.saved_tensors
        plan, s = ctx.plan, ctx.s
        p = plan.grad
        lse = lse_all if plan.grad_index is None else lse_all.index_select(0, plan.grad_index)
        need = ctx.needs_input_grad
        dh = torch.zeros_like(h) if need[0] else None
        dw = torch.zeros_like(w, dtype=torch.float32) if need[1] else None
        du = torch.zeros_like(u) if need[2] and u is not None else None
        db = torch.zeros_like(b) if need[3] and b is not None else None
        g = g.float()

        def add_rows(acc: torch.Tensor, a: int, e: int, part: torch.Tensor) -> None:
            if p.rows is None:
                acc[a:e] += part
            else:
                acc.index_add_(0, p.rows[a:e], part)

        for a, e, pa, pb in p.bounds:
            if pa == pb:
                continue
            hc = _rows(h, p, a, e)
            uc = None if u is None else _rows(u, p, a, e)
            loc = p.local[pa:pb] - a
            gp = g[p.pair[pa:pb]]
            # d lp(t) / d logits = onehot(t) - softmax: over a row's targets, scatter g at t, minus (sum g) * softmax
            gsum = torch.zeros(e - a, dtype=torch.float32, device=h.device).index_add_(0, loc, gp)
            d = _logits(hc, w, uc, b, s).sub_(lse[a:e, None]).exp_().mul_(gsum[:, None].neg())
            d.index_put_((loc, p.tok[pa:pb]), gp, accumulate=True)
            dc = d.to(h.dtype)
            if dh is not None:
                add_rows(dh, a, e, dc @ w)
            if dw is not None:
                dw.addmm_(d.t(), hc.to(dw.dtype))
            if b is not None and uc is not None and (du is not None or db is not None):
                dl = (d if b.dtype == torch.float32 else d.to(b.dtype)).mul_(s)
                if du is not None:
                    add_rows(du, a, e, dl @ b)
                if db is not None:
                    db.addmm_(dl.t(), uc)
            del d, dc
        return dh, None if dw is None else dw.to(w.dtype), du, db, None, None


def target_logprobs(h: torch.Tensor, w: torch.Tensor, plan: Plan, lora: tuple[torch.Tensor, torch.Tensor, float] | None = None
                    ) -> torch.Tensor:
    """log softmax(h[row] @ w^T)[target] for every planned target, float32, flattened (N * K,). lora = (A, B,
    scale): the unembedding has a LoRA adapter, logits + scale * (h @ A^T) @ B^T in the adapter's dtype."""
    if lora is None:
        return _TargetLogprobs.apply(h, w, None, None, 0.0, plan)  # type: ignore[no-any-return]
    a, b, s = lora
    u = h.to(a.dtype) @ a.t()  # (T, rank): cheap, through autograd (A's gradient and h's share come from it)
    return _TargetLogprobs.apply(h, w, u, b, s, plan)  # type: ignore[no-any-return]
