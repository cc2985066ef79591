"""The `nll` pinned eval (runner/recipe/pinned.py NLLPinned): the mean per-token NLL of conversations under the
weights, through the sampler's compute_logprobs, rendered with the recipe's renderer."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable
from typing import TypeVar

from backends.errors import UserError
from runner.data.conversations import load_conversations
from runner.engine.evals import EvalContext, EvalKind, Metrics
from runner.engine.nll_eval_config import NLLPinned
from runner.recipe.sources import File, Jsonl
from runner.renderers import render_row


async def nll_eval(e: NLLPinned, ctx: EvalContext) -> Metrics:
    convs, where = load_conversations(e.data)
    convs, where = convs[: e.max_rows], where[: e.max_rows]
    rendered = [render_row(ctx.renderer, c, e.train_on_what, w) for c, w in zip(convs, where, strict=True)]
    logprobs = await asyncio.gather(*(_awaited(ctx.sampler.compute_logprobs(tokens)) for tokens, _ in rendered))
    total, weight = 0.0, 0.0
    for (_, w), lps in zip(rendered, logprobs, strict=True):
        for wi, lp in zip(w[1:], lps[1:], strict=True):  # the first token has no logprob
            if wi and lp is not None:
                total -= wi * lp
                weight += wi
    if weight == 0:
        src = e.data.path if isinstance(e.data, Jsonl) else where[0] if where else "the data"
        raise UserError(f"nll eval: no weighted tokens in {src} (train_on_what = {e.train_on_what!r})")
    return {"nll": total / weight, "ppl": math.exp(min(total / weight, 50.0)), "tokens": weight}


T = TypeVar("T")


async def _awaited(x: Awaitable[T]) -> T:
    return await x


def check_nll(e: NLLPinned, where: str) -> None:
    """`runner check`: a local file's rows are conversations (or map to them through its `format`), as the run's
    first eval would find them after the model loads. Other sources are read when the eval runs."""
    if isinstance(e.data, (Jsonl, File)):
        try:
            load_conversations(e.data)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None


EVAL = EvalKind(nll_eval, check_nll)
