"""Evals pinned in the recipe (`[[recipes.x.evals]]`): fixed benchmarks run on the sampler weights of the moment, the
same way at every eval step (eval_every), after the last step (in the final row) and by `runner eval`.

A kind is two files here: NAME_eval_config.py, its recipe struct (the `PinnedEval` union is every one:
runner/recipe/pinned.py), and NAME_eval.py, which declares `EVAL = EvalKind(run, check)`. Nothing here lists kinds:
`kind_of` imports the module beside the struct's (as runner/engine/spec.py does for algorithms). The built-in ones: `math` (runner/engine/math_eval.py: accuracy with the
`math` env's loading, prompt and grading, at fixed sampling params), `nll` (nll_eval.py: per-token NLL of
conversations via compute_logprobs), `python` (python_eval.py: `pkg.mod:fn`), `inspect` (inspect_eval.py: an
inspect_ai task through a model provider over the sampler). Each needs only a SamplingClient and the tokenizer, so
every algorithm gets them. Metrics: test/eval/<name>/<metric> (held-out numbers, as every test/ metric).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from backends.base import SamplingClient
from backends.errors import UserError
from runner.recipe.explain import dotted
from runner.recipe.pinned import PinnedEval
from runner.recipe.targets import declared
from runner.renderers import Renderer, get_renderer
from runner.renderers.base import Tokenizer

Metrics = dict[str, float]
C = TypeVar("C")  # an eval kind's config struct (runner/engine/NAME_eval_config.py)


@dataclass(frozen=True)
class EvalContext:
    """What an eval runs on besides its own config: the sampler of the weights of the moment, the tokenizer, the
    recipe's renderer (built once for all the evals) and the model's name."""

    sampler: SamplingClient
    tokenizer: Tokenizer
    renderer: Renderer
    model_name: str | None = None


@dataclass(frozen=True)
class EvalKind(Generic[C]):
    """What a pinned eval's module declares (`EVAL = EvalKind(run, check)`): run(cfg, ctx) -> {metric: number}, and
    what `runner check` verifies before any model loads, check(cfg, where) raising a UserError that starts with
    `where` ('FILE#name: evals[0]'); None: decoding and the recipe's target check (`Target` fields) are enough."""

    run: Callable[[C, EvalContext], Awaitable[Metrics]]
    check: Callable[[C, str], None] | None = None


def kind_of(e: C) -> EvalKind[C]:
    """The `EVAL` declared by the module beside a pinned eval's config (math_eval_config.py -> math_eval.py), which
    takes that config."""
    return declared(type(e), "EVAL", EvalKind)


def names(evals: list[PinnedEval]) -> list[str]:
    """Each eval's metric prefix: its `name`, else its default (its kind, "math"; an inspect eval: its task's name,
    "gsm8k"), with the position when that repeats."""
    bases = [e.default_name() for e in evals]
    out = []
    for i, (e, base) in enumerate(zip(evals, bases, strict=True)):
        out.append(e.name or (base if bases.count(base) == 1 else f"{base}_{i}"))
    if len(set(out)) != len(out):
        raise UserError(f"evals: two pinned evals are named the same ({', '.join(out)}); set distinct `name`s")
    return out


def check_evals(evals: list[PinnedEval], where: str) -> None:
    """`runner check`: the evals' metric names are distinct (else the run stops at its first eval, the model
    loaded), and each pinned eval's own check (its kind's), errors prefixed with `where` and its key path."""
    try:
        names(evals)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    for i, e in enumerate(evals):
        check = kind_of(e).check
        if check is not None:
            check(e, f"{where}: {dotted(['evals', i])}")


async def run_evals(evals: list[PinnedEval], sampler: SamplingClient, tokenizer: Tokenizer, renderer: str = "auto",
                    model_name: str | None = None) -> Metrics:
    """Every pinned eval on `sampler`'s weights, one after another: test/eval/<name>/<metric> (+ time/eval/<name>).
    Evals that render (`math`, `nll`) use the recipe's renderer (runner/renderers/), as its algorithm does."""
    out: Metrics = {}
    ctx = EvalContext(sampler, tokenizer, get_renderer(renderer, tokenizer, model_name=model_name), model_name)
    loop = asyncio.get_running_loop()
    for name, e in zip(names(evals), evals, strict=True):
        t = loop.time()
        metrics = await kind_of(e).run(e, ctx)
        out.update({f"test/eval/{name}/{k}": v for k, v in metrics.items()})
        out[f"time/eval/{name}"] = loop.time() - t
    return out


async def pinned_metrics(evals: list[PinnedEval], sampler: Awaitable[SamplingClient] | SamplingClient,
                         tokenizer: Tokenizer, renderer: str = "auto", model_name: str | None = None) -> Metrics:  # fmt: skip
    """run_evals on a sampler or the future of one; {} (nothing awaited) when there are no pinned evals."""
    if not evals:
        return {}
    client = await sampler if inspect.isawaitable(sampler) else sampler
    return await run_evals(evals, client, tokenizer, renderer, model_name)
