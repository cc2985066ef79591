"""Ordering: requests submitted back to back, before waiting on any, run in submission order and each
result belongs to its own request."""

from __future__ import annotations

from runner.tools.conformance.core import Ctx, Fail, check, logprobs_of, loss_sum

N_STEPS = 4


@check("ordering", "results_match_requests", timeout_s=150)
def results_match_requests(ctx: Ctx) -> str:
    """fb(w=1), optim(lr=0), fb(w=2), optim(lr=0), ...: lr 0 leaves the weights alone, so fb i's loss:sum
    must be i+1 times the first one's, whatever order the futures resolve in."""
    tc = ctx.training_client("ordering")
    ids = ctx.tokens("The quick brown fox jumps over the lazy dog", [5, 6, 7, 8, 9, 10, 11, 12])
    n = len(ids) - 1
    zero = ctx.types.AdamParams(learning_rate=0.0)
    fbs, ops = [], []
    for i in range(N_STEPS):
        fbs.append(tc.forward_backward([ctx.datum(ids, weights=[float(i + 1)] * n)], "cross_entropy"))
        ops.append(tc.optim_step(zero))
    losses = [loss_sum(ctx.wait(f)) for f in fbs]
    for op in ops:
        ctx.wait(op)
    for i, got in enumerate(losses):
        if not ctx.close_enough(got, losses[0] * (i + 1)):
            raise Fail(f"forward_backward #{i} (weights x{i + 1}) gave loss:sum {got:.5f}, expected "
                       f"{losses[0] * (i + 1):.5f}: results do not match their requests")
    return f"{N_STEPS} fwd/bwd + {N_STEPS} optim_step, loss:sum {[round(x, 3) for x in losses]}"


@check("ordering", "optim_step_between_passes", timeout_s=150)
def optim_step_between_passes(ctx: Ctx) -> str:
    """forward, fwd/bwd, optim(lr>0), forward, all submitted before any wait: the first two see the old
    weights, the last sees the updated ones."""
    tc = ctx.training_client("ordering")
    ids = ctx.tokens("Once upon a time there was a cat", [13, 14, 15, 16, 17, 18, 19])
    datum = ctx.datum(ids, weights=[1.0] * (len(ids) - 1))
    before = tc.forward([datum], "cross_entropy")
    fb = tc.forward_backward([datum], "cross_entropy")
    op = tc.optim_step(ctx.types.AdamParams(learning_rate=5e-2))
    after = tc.forward([datum], "cross_entropy")
    lp_before, lp_fb = logprobs_of(ctx.wait(before))[0], logprobs_of(ctx.wait(fb))[0]
    ctx.wait(op)
    out_after = ctx.wait(after)
    lp_after = logprobs_of(out_after)[0]
    if any(not ctx.close_enough(a, b) for a, b in zip(lp_before, lp_fb, strict=True)):
        raise Fail("forward_backward submitted before optim_step saw different weights than the forward before it")
    moved = max(abs(a - b) for a, b in zip(lp_before, lp_after, strict=True))
    if moved < 1e-4:
        raise Fail("a forward submitted after optim_step(lr=5e-2) sees the old weights (logprobs unchanged)")
    if loss_sum(out_after) >= -sum(lp_before):
        raise Fail(f"the step did not lower the loss it was trained on ({-sum(lp_before):.4f} -> "
                   f"{loss_sum(out_after):.4f})")
    return f"max |dlogprob| after the step {moved:.4f}"


@check("ordering", "forward_keeps_no_gradient", timeout_s=120)
def forward_keeps_no_gradient(ctx: Ctx) -> str:
    """forward then optim_step(lr>0): forward accumulates no gradient, so the step changes nothing."""
    tc = ctx.training_client("forward-only")
    ids = ctx.tokens("Nothing to learn from a forward pass", [40, 41, 42, 43, 44, 45])
    datum = ctx.datum(ids, weights=[1.0] * (len(ids) - 1))
    first = tc.forward([datum], "cross_entropy")
    op = tc.optim_step(ctx.types.AdamParams(learning_rate=5e-2))
    again = tc.forward([datum], "cross_entropy")
    a, b = logprobs_of(ctx.wait(first))[0], logprobs_of(ctx.wait(again))[0]
    ctx.wait(op)
    moved = max(abs(x - y) for x, y in zip(a, b, strict=True))
    if moved > 1e-5:
        raise Fail(f"an optim_step after only a forward moved the logprobs by {moved:.2e}: forward kept gradients")
    return "unchanged"
