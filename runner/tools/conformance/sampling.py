"""Sampling options: seeds, greedy decoding, max_tokens, num_samples, stop sequences, top-k/top-p, prompt
logprobs, and agreement between the sampler and the trainer on the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

from backends.tokenizer import decode_text
from runner.tools.conformance.core import Ctx, Fail, Skip, check, logprobs_of

if TYPE_CHECKING:
    from collections.abc import Callable

    import tinker


class SamplingKw(TypedDict, total=False):
    """The SamplingParams fields a check sets (the others keep the SDK's defaults)."""

    max_tokens: int
    temperature: float
    seed: int
    stop: Sequence[int] | Sequence[str]
    top_k: int
    top_p: float


def _sampler(ctx: Ctx) -> tinker.SamplingClient:
    """A sampler over the weights of a training client that took one step (so LoRA is not the identity)."""
    with ctx.lock:
        if ctx.sampler is None:
            tc = ctx.training_client("sampling")
            ids = _prompt(ctx)
            tc.forward_backward([ctx.datum(ids, weights=[1.0] * (len(ids) - 1))], "cross_entropy")
            tc.optim_step(ctx.types.AdamParams(learning_rate=1e-2))
            ctx.sampler = ctx.wait(tc.save_weights_and_get_sampling_client(), timeout=90)
        return ctx.sampler


def _prompt(ctx: Ctx) -> list[int]:
    return ctx.tokens("Once upon a time, in a small village, there", [20, 21, 22, 23, 24, 25])


def _params(ctx: Ctx, **kw: Unpack[SamplingKw]) -> tinker.SamplingParams:
    return ctx.types.SamplingParams(**kw)


def _sample(ctx: Ctx, n: int, prompt: list[int] | None = None, **kw: Unpack[SamplingKw]) -> tinker.SampleResponse:
    p = ctx.types.ModelInput.from_ints(prompt if prompt is not None else _prompt(ctx))
    return ctx.wait(_sampler(ctx).sample(p, n, _params(ctx, **kw)))


def _greedy(ctx: Ctx, n_tokens: int = 8) -> list[int]:
    with ctx.lock:
        cached = ctx.greedy
    if cached is None:
        cached = list(_sample(ctx, 1, max_tokens=n_tokens, temperature=0.0, stop=[], seed=1).sequences[0].tokens)
        with ctx.lock:
            ctx.greedy = cached
    return list(cached)


@check("sampling", "seed_repeats", timeout_s=90)
def seed_repeats(ctx: Ctx) -> str:
    a = [s.tokens for s in _sample(ctx, 2, max_tokens=8, temperature=1.0, seed=1234, stop=[]).sequences]
    b = [s.tokens for s in _sample(ctx, 2, max_tokens=8, temperature=1.0, seed=1234, stop=[]).sequences]
    if a != b:
        raise Fail(f"the same seed gave different samples: {a} vs {b}")
    return f"2 x {len(a[0])} tokens repeat"


@check("sampling", "greedy_is_argmax", timeout_s=90)
def greedy_is_argmax(ctx: Ctx) -> str:
    """temperature 0: the same tokens whatever the seed; each is the argmax (top-1 prompt logprob) when the
    server offers top-k logprobs, and its logprob matches compute_logprobs."""
    g = _greedy(ctx)
    other = list(_sample(ctx, 1, max_tokens=8, temperature=0.0, stop=[], seed=99).sequences[0].tokens)
    if other != g:
        raise Fail(f"temperature 0 depends on the seed: {g} vs {other}")
    prompt = _prompt(ctx)
    full = ctx.types.ModelInput.from_ints(prompt + g)
    lps = ctx.wait(_sampler(ctx).compute_logprobs(full))
    seq = _sample(ctx, 1, max_tokens=8, temperature=0.0, stop=[], seed=1).sequences[0]
    for i, (tok, lp) in enumerate(zip(seq.tokens, seq.logprobs or [], strict=False)):
        ref = lps[len(prompt) + i]
        if ref is None or not ctx.close_enough(lp, ref):
            raise Fail(f"greedy token {i} ({tok}): sampled logprob {lp} != compute_logprobs {ref}")
    try:
        res = ctx.wait(_sampler(ctx).sample(full, 1, _params(ctx, max_tokens=1, temperature=0.0),
                                            include_prompt_logprobs=True, topk_prompt_logprobs=1))
    except TypeError:
        return "seed-independent, logprobs match (this SDK has no top-k logprobs for the argmax check)"
    top = res.topk_prompt_logprobs
    if not top:
        return "seed-independent, logprobs match (the server sent no top-k prompt logprobs)"
    for i, tok in enumerate(g):
        best = top[len(prompt) + i]
        if not best or best[0][0] != tok:
            raise Fail(f"greedy token {i} is {tok}, but the top-1 prompt logprob there is {best}")
    return f"{len(g)} greedy tokens = argmax"


@check("sampling", "max_tokens_and_num_samples", timeout_s=90)
def max_tokens_and_num_samples(ctx: Ctx) -> str:
    res = _sample(ctx, 3, max_tokens=5, temperature=1.0, seed=7, stop=[])
    if len(res.sequences) != 3:
        raise Fail(f"num_samples=3 returned {len(res.sequences)} sequences")
    for s in res.sequences:
        if len(s.tokens) != 5 or s.stop_reason != "length":
            raise Fail(f"max_tokens=5, stop=[]: got {len(s.tokens)} tokens, stop_reason {s.stop_reason!r} "
                       "(expected 5, 'length')")
        if s.logprobs is None or len(s.logprobs) != 5:
            raise Fail("each sampled token needs its logprob")
    ids = [getattr(s, "sequence_id", None) for s in res.sequences]
    if all(ids) and len(set(ids)) != 3:
        raise Fail(f"sequence_ids are not unique: {ids}")
    return "3 sequences x 5 tokens, stop_reason 'length'"


@check("sampling", "seeded_rows_differ", timeout_s=90)
def seeded_rows_differ(ctx: Ctx) -> str:
    """One seeded request with num_samples = 4 draws 4 samples, not one sample 4 times: runner's RL sends a group's
    first turn as one such request (runner/rl/rollouts.py), and copies would give the group equal rewards. Only
    failed when identical rows are implausible for fair draws: each row's probability p = exp(sum of its logprobs),
    and 3 more copies of it had chance p ** 3."""
    import math

    res = _sample(ctx, 4, max_tokens=16, temperature=1.0, seed=2024, stop=[])
    rows = [tuple(s.tokens) for s in res.sequences]
    if len(set(rows)) > 1:
        return f"{len(set(rows))} distinct rows of 4"
    total = sum(res.sequences[0].logprobs or [])
    chance = math.exp(3 * total)
    if chance < 1e-6:
        raise Fail(f"num_samples=4 with one seed returned 4 copies of a {len(rows[0])}-token sample of probability "
                   f"{math.exp(total):.2e} (chance of that {chance:.1e}): the seed is reused for every row")
    return f"4 identical rows, but the model is confident (p = {math.exp(total):.2f} each): not decisive"


def _seeded(ctx: Ctx, stop: Sequence[int] | Sequence[str]) -> tinker.SampledSequence:
    """One seeded temperature-1 sample of up to 12 tokens; the same seed with a stop rule must give a prefix."""
    return _sample(ctx, 1, max_tokens=12, temperature=1.0, seed=4242, stop=stop).sequences[0]


def _fresh_index(ok: Callable[[int], bool], g: list[int]) -> int | None:
    """The first position >= 2 whose token is new to the sequence (so a stop there cannot fire earlier)."""
    return next((i for i in range(2, len(g)) if g[i] not in g[:i] and ok(i)), None)


@check("sampling", "stop_token", timeout_s=90)
def stop_token(ctx: Ctx) -> str:
    g = list(_seeded(ctx, stop=[]).tokens)
    k = _fresh_index(lambda i: True, g)
    if k is None:
        raise Skip(f"the sample {g} has no token that is new after position 2; no stop token to test")
    s = _seeded(ctx, stop=[g[k]])
    if s.stop_reason != "stop" or list(s.tokens) != g[: k + 1]:
        raise Fail(f"stop=[{g[k]}] on seeded sample {g}: got {list(s.tokens)} ({s.stop_reason!r}), expected "
                   f"{g[:k + 1]} ('stop', the stop token included)")
    return f"stopped after token {k} of 12 with stop_reason 'stop'"


@check("sampling", "stop_string", timeout_s=90)
def stop_string(ctx: Ctx) -> str:
    """stop=[text of a sampled token]: the same seeded sample stops there ('stop'), a prefix of the unstopped one."""
    tok = ctx.tokenizer()
    if tok is None:
        raise Skip("needs the tokenizer to write a stop string")
    g = list(_seeded(ctx, stop=[]).tokens)
    k = _fresh_index(lambda i: bool(decode_text(tok, [g[i]]).strip()) and decode_text(tok, [g[i]]) not in decode_text(tok, g[:i]), g)
    if k is None:
        raise Skip(f"no token of the sample {g} decodes to new text")
    word = decode_text(tok, [g[k]])
    s = _seeded(ctx, stop=[word])
    got = list(s.tokens)
    if s.stop_reason != "stop" or got != g[: len(got)] or not k <= len(got) <= k + 1:
        raise Fail(f"stop=[{word!r}] on seeded sample {g}: got {got} ({s.stop_reason!r}), expected {g[:k + 1]} "
                   "(or without the stop text) and 'stop'")
    return f"stopped at {word!r} after {len(got)} of 12 tokens"


@check("sampling", "top_k_top_p", timeout_s=90)
def top_k_top_p(ctx: Ctx) -> str:
    """top_k=1, or a tiny top_p, at temperature 1 leaves only the argmax: the greedy tokens."""
    g = _greedy(ctx)
    k1 = list(_sample(ctx, 1, max_tokens=8, temperature=1.0, top_k=1, stop=[], seed=3).sequences[0].tokens)
    p0 = list(_sample(ctx, 1, max_tokens=8, temperature=1.0, top_p=1e-6, stop=[], seed=3).sequences[0].tokens)
    if k1 != g:
        raise Fail(f"top_k=1 gave {k1}, greedy gives {g}")
    if p0 != g:
        raise Fail(f"top_p=1e-6 gave {p0}, greedy gives {g}")
    return "top_k=1 and top_p=1e-6 equal greedy"


@check("sampling", "prompt_logprobs", timeout_s=90)
def prompt_logprobs(ctx: Ctx) -> str:
    """include_prompt_logprobs: one per prompt token, None first, equal to compute_logprobs and to the
    trainer's forward on the same weights."""
    prompt = _prompt(ctx)
    sampler = _sampler(ctx)
    res = ctx.wait(sampler.sample(ctx.types.ModelInput.from_ints(prompt), 1, _params(ctx, max_tokens=1),
                                  include_prompt_logprobs=True))
    pl = res.prompt_logprobs
    if pl is None or len(pl) != len(prompt) or pl[0] is not None:
        raise Fail(f"prompt_logprobs must have {len(prompt)} entries with None first, got {pl}")
    cl = ctx.wait(sampler.compute_logprobs(ctx.types.ModelInput.from_ints(prompt)))
    got, want = [x for x in pl[1:] if x is not None], [x for x in cl[1:] if x is not None]  # a None here fails
    if (len(cl) != len(prompt) or len(got) != len(want) or len(want) != len(prompt) - 1
            or any(not ctx.close_enough(a, b) for a, b in zip(got, want, strict=True))):
        raise Fail(f"prompt_logprobs {pl} != compute_logprobs {cl}")
    trainer = logprobs_of(ctx.wait(ctx.training_client("sampling").forward(
        [ctx.datum(prompt, weights=[0.0] * (len(prompt) - 1))], "cross_entropy")))[0]
    worst = max(abs(a - b) for a, b in zip(want, trainer, strict=True))
    if worst > max(ctx.atol * 10, 2e-2):
        raise Fail(f"sampler and trainer disagree on the same weights: max |dlogprob| {worst:.4f}")
    return f"sampler vs trainer max |dlogprob| {worst:.2e}"
