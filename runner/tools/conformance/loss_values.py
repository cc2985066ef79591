"""Every built-in loss's `loss:sum` against its documented formula (docs/losses.md "Formulas"), computed here from the
learner's logprobs that a cross_entropy forward returns. Each loss is checked through `forward` and through
`forward_backward` (a server may compute them on different paths); the sampler logprobs q are the learner's
shifted per token, so ratios r = exp(lp - q) range over ~[0.6, 1.6] and the clips engage."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from runner.tools.conformance.core import Ctx, Fail, Skip, check, logprobs_of, loss_sum

SHIFTS = (0.5, -0.3, 0.0, 0.15, -0.45, 0.05, 0.25, -0.1)  # q_t = lp_t + shift: r_t = exp(-shift)
ADVS = (1.0, -0.5, 2.0, -1.5, 0.75, 1.25, -2.0, 0.5)

Formula = Callable[[float, float, float, dict[str, float]], float]  # (lp, q, A, config) -> per-token loss


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _is(lp: float, q: float, a: float, c: dict[str, float]) -> float:
    return -math.exp(lp - q) * a


def _ppo(lp: float, q: float, a: float, c: dict[str, float]) -> float:
    r = math.exp(lp - q)
    return -min(r * a, _clip(r, c["clip_low_threshold"], c["clip_high_threshold"]) * a)


def _cispo(lp: float, q: float, a: float, c: dict[str, float]) -> float:
    r = math.exp(lp - q)
    return -_clip(r, c["clip_low_threshold"], c["clip_high_threshold"]) * lp * a


def _dro(lp: float, q: float, a: float, c: dict[str, float]) -> float:
    return -(lp * a - 0.5 * c["beta"] * (lp - q) ** 2)


# name -> (loss_fn, the loss_fn_config sent (None: the server's defaults), the config the formula uses, formula)
CASES: dict[str, tuple[str, dict[str, float] | None, dict[str, float], Formula]] = {
    "importance_sampling": ("importance_sampling", None, {}, _is),
    "ppo": ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
            {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, _ppo),
    "ppo_defaults": ("ppo", None, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, _ppo),
    "cispo": ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
              {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, _cispo),
    "cispo_defaults": ("cispo", None, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, _cispo),
    "dro": ("dro", {"beta": 0.05}, {"beta": 0.05}, _dro),
}


def _texts(ctx: Ctx) -> list[list[int]]:
    return [ctx.tokens("Two plus two equals four, said the", [3, 4, 5, 6, 7, 8, 9, 10]),
            ctx.tokens("A small model learns", [11, 12, 13, 14, 15])]


def _learner_logprobs(ctx: Ctx, seqs: Sequence[list[int]]) -> list[list[float]]:
    """lp from a cross_entropy forward, whose own loss:sum is checked against -sum(w * lp) on the way."""
    tc = ctx.training_client("losses")
    weights = [[0.5 + (i % 3) for i in range(len(ids) - 1)] for ids in seqs]
    out = ctx.wait(tc.forward([ctx.datum(ids, weights=w) for ids, w in zip(seqs, weights, strict=True)],
                              "cross_entropy"))
    lps = logprobs_of(out)
    for ids, lp in zip(seqs, lps, strict=True):
        if len(lp) != len(ids) - 1:
            raise Fail(f"loss_fn_outputs logprobs have {len(lp)} entries for {len(ids) - 1} targets")
        if any(x > 1e-4 or math.isnan(x) for x in lp):
            raise Fail(f"target logprobs must be <= 0, got {lp}")
    want = -sum(w * x for ws, lp in zip(weights, lps, strict=True) for w, x in zip(ws, lp, strict=True))
    got = loss_sum(out)
    if not ctx.close_enough(got, want):
        raise Fail(f"cross_entropy loss:sum {got:.5f} != -sum(w * lp) = {want:.5f}")
    return lps


@check("losses", "loss/cross_entropy", timeout_s=120)
def cross_entropy(ctx: Ctx) -> str:
    seqs = _texts(ctx)
    lps = _learner_logprobs(ctx, seqs)
    tc = ctx.training_client("losses")
    out = ctx.wait(tc.forward_backward([ctx.datum(ids, weights=[1.0] * (len(ids) - 1)) for ids in seqs],
                                       "cross_entropy"))
    want = -sum(sum(lp) for lp in lps)
    got = loss_sum(out)
    if not ctx.close_enough(got, want):
        raise Fail(f"forward_backward cross_entropy loss:sum {got:.5f} != -sum(lp) = {want:.5f}")
    return f"loss:sum {got:.4f} (forward and forward_backward)"


def _rl_case(name: str) -> Callable[[Ctx], str]:
    loss_fn, sent, used, formula = CASES[name]

    def run(ctx: Ctx) -> str:
        seqs = _texts(ctx)
        lps = _learner_logprobs(ctx, seqs)
        data, want = [], 0.0
        for ids, lp in zip(seqs, lps, strict=True):
            q = [x + SHIFTS[i % len(SHIFTS)] for i, x in enumerate(lp)]
            adv = [ADVS[i % len(ADVS)] for i in range(len(lp))]
            data.append(ctx.datum(ids, logprobs=q, advantages=adv))
            want += sum(formula(a, b, c, used) for a, b, c in zip(lp, q, adv, strict=True))
        tc = ctx.training_client("losses")
        for how in ("forward", "forward_backward"):
            out = ctx.wait(getattr(tc, how)(data, loss_fn, sent))
            got = loss_sum(out)
            if not ctx.close_enough(got, want):
                ratio = f", {got / want:.3g}x" if want else ""
                raise Fail(f"{how} {loss_fn} loss:sum {got:.5f}, documented formula gives {want:.5f}{ratio} "
                           f"(config {sent or 'server defaults'})")
            back = logprobs_of(out)
            if any(not ctx.close_enough(x, y) for b, lp in zip(back, lps, strict=True) for x, y in zip(b, lp, strict=True)):
                raise Fail(f"{how} {loss_fn}: its loss_fn_outputs logprobs differ from cross_entropy's on the same tokens")
        return f"loss:sum {want:.4f} (forward and forward_backward)"

    run.__name__ = name
    return run


for _name in CASES:
    check("losses", f"loss/{_name}", timeout_s=120)(_rl_case(_name))


@check("losses", "loss/gspo", timeout_s=120)
def gspo(ctx: Ctx) -> str:
    """GSPO-token with explicit clips: s = exp(mean_M(lp - q)), L = -sum_t min(s A_t, clip(s, lo, hi) A_t)."""
    loss_types = getattr(ctx.types, "LossFnType", None)
    if loss_types is not None and "gspo" not in getattr(loss_types, "__args__", ("gspo",)):
        raise Skip("this SDK version has no gspo loss")
    seqs = _texts(ctx)
    lps = _learner_logprobs(ctx, seqs)
    cfg = {"clip_low_threshold": 0.95, "clip_high_threshold": 1.02}
    data, want = [], 0.0
    for ids, lp in zip(seqs, lps, strict=True):
        q = [x + SHIFTS[i % len(SHIFTS)] for i, x in enumerate(lp)]
        adv = [ADVS[i % len(ADVS)] for i in range(len(lp))]
        mask = [0.0 if i == 0 else 1.0 for i in range(len(lp))]
        data.append(ctx.datum(ids, logprobs=q, advantages=adv, sequence_ratio_mask=mask))
        m = [i for i in range(len(lp)) if mask[i]]
        s = math.exp(sum(lp[i] - q[i] for i in m) / len(m))
        want += -sum(min(s * a, _clip(s, cfg["clip_low_threshold"], cfg["clip_high_threshold"]) * a) for a in adv)
    got = loss_sum(ctx.wait(ctx.training_client("losses").forward(data, "gspo", cfg)))
    if not ctx.close_enough(got, want):
        raise Fail(f"forward gspo loss:sum {got:.5f}, documented formula gives {want:.5f}")
    return f"loss:sum {want:.4f}"


@check("losses", "loss/cross_entropy_topk", timeout_s=120)
def cross_entropy_topk(ctx: Ctx) -> str:
    """(N, K) targets and weights (top-K distillation): logprobs come back (N, K), loss = -sum(w * lp), and
    column 0 (the sequence's own next tokens) matches the 1-D logprobs."""
    import numpy as np

    ids = _texts(ctx)[0]
    lp1 = _learner_logprobs(ctx, [ids])[0]
    n, k = len(ids) - 1, 3
    targets = np.stack([np.asarray(ids[1:])] + [np.asarray([(t + j) % 7 + 1 for t in ids[1:]]) for j in (1, 2)], 1)
    weights = np.tile(np.asarray([0.6, 0.3, 0.1], np.float32), (n, 1))
    datum = ctx.types.Datum(model_input=ctx.types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
        "target_tokens": ctx.types.TensorData.from_numpy(targets.astype(np.int64)),
        "weights": ctx.types.TensorData.from_numpy(weights)})
    out = ctx.wait(ctx.training_client("losses").forward([datum], "cross_entropy"))
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    if tuple(lp.shape) != (n, k):
        raise Fail(f"(N, K) = ({n}, {k}) targets gave logprobs shaped {tuple(lp.shape)}")
    if any(not ctx.close_enough(float(a), b) for a, b in zip(lp[:, 0], lp1, strict=True)):
        raise Fail("column 0 of the (N, K) logprobs differs from the 1-D logprobs of the same tokens")
    want = -float((weights * lp).sum())
    got = loss_sum(out)
    if not ctx.close_enough(got, want):
        raise Fail(f"(N, K) cross_entropy loss:sum {got:.5f} != -sum(w * lp) = {want:.5f}")
    return f"({n}, {k}) logprobs, loss:sum {got:.4f}"
