"""Evals pinned in the recipe (`[[recipes.x.evals]]`): fixed benchmarks run on the sampler weights of the moment, the
same way at every eval step (eval_every), after the last step (in the final row) and by `runner eval`.

Kinds (runner/recipe/schema.py): `math` (accuracy with the `math` env's loading, prompt and grading, at fixed
sampling params), `nll` (per-token NLL of conversations via compute_logprobs), `python` (`pkg.mod:fn`), `inspect` (an
inspect_ai task through a model provider over the sampler: runner/engine/inspect_eval.py). Each needs only a
SamplingClient and the tokenizer, so every algorithm gets them. Metrics: test/eval/<name>/<metric> (held-out numbers, as every test/ metric).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable
from typing import Any

from backends.base import SamplingClient
from backends.errors import UserError
from backends.types import SamplingParams
from runner.data.conversations import load_conversations
from runner.engine.inspect_eval import default_name, inspect_eval
from runner.recipe.schema import InspectPinned, Jsonl, Math, MathPinned, NLLPinned, PinnedEval, PythonPinned
from runner.recipe.targets import import_target
from runner.renderers import Renderer, get_renderer, render_row
from runner.renderers.base import Tokenizer
from runner.renderers.chat import ChatRenderer
from runner.rl.envs.math import MathEnv, load_problems
from runner.rl.rollouts import describe_error

Metrics = dict[str, float]


def names(evals: list[PinnedEval]) -> list[str]:
    """Each eval's metric prefix: its `name`, else its kind ("math"; an inspect eval: its task's name, "gsm8k"), with
    the position when that repeats."""
    bases = [default_name(e.task) if isinstance(e, InspectPinned) else str(type(e).__struct_config__.tag)
             for e in evals]
    out = []
    for i, (e, base) in enumerate(zip(evals, bases, strict=True)):
        out.append(e.name or (base if bases.count(base) == 1 else f"{base}_{i}"))
    if len(set(out)) != len(out):
        raise UserError(f"evals: two pinned evals are named the same ({', '.join(out)}); set distinct `name`s")
    return out


async def run_evals(evals: list[PinnedEval], sampler: SamplingClient, tokenizer: Tokenizer, renderer: str = "auto",
                    model_name: str | None = None) -> Metrics:
    """Every pinned eval on `sampler`'s weights, one after another: test/eval/<name>/<metric> (+ time/eval/<name>).
    `math` and `nll` render with the recipe's renderer (runner/renderers/), as its algorithm does."""
    out: Metrics = {}
    chat = get_renderer(renderer, tokenizer, model_name=model_name)
    loop = asyncio.get_running_loop()
    for name, e in zip(names(evals), evals, strict=True):
        t = loop.time()
        match e:
            case MathPinned():
                metrics = await math_eval(e, sampler, chat)
            case NLLPinned():
                metrics = await nll_eval(e, sampler, chat)
            case PythonPinned():
                metrics = await python_eval(e, sampler, tokenizer)
            case InspectPinned():
                metrics = await inspect_eval(e, sampler, chat, model_name)
            case _:
                raise TypeError(f"pinned eval {type(e).__name__} has no case here (runner/engine/evals.py run_evals)")
        out.update({f"test/eval/{name}/{k}": v for k, v in metrics.items()})
        out[f"time/eval/{name}"] = loop.time() - t
    return out


def as_math_env(e: MathPinned) -> Math:
    return Math(data=e.data, question_field=e.question_field, answer_field=e.answer_field,
                answer_format=e.answer_format, question_suffix=e.question_suffix, few_shot=e.few_shot,
                grader=e.grader)  # fmt: skip


async def math_eval(e: MathPinned, sampler: SamplingClient, chat: Renderer) -> Metrics:
    problems = load_problems(e.data, e.question_field, e.answer_field)[: e.max_problems]
    cfg, renderer = as_math_env(e), ChatRenderer(chat)

    async def one(i: int) -> tuple[list[float], list[float]]:
        envs = [MathEnv(renderer, problems[i], cfg) for _ in range(e.samples)]
        prompt, stop = await envs[0].initial_observation()
        # Problem i's samples are seeded seed .. seed + samples - 1 (sample k of a request seeded s samples as a
        # request seeded s + k), so problems' seeds are spaced by `samples` to keep their draws apart.
        seed = None if e.temperature == 0 else (e.seed * 1_000_003 + i * e.samples) % 2**31
        params = SamplingParams(max_tokens=e.max_tokens, temperature=e.temperature, stop=stop, seed=seed)
        out = await sampler.sample(prompt, e.samples, params)
        correct, fmt = [], []
        for env, seq in zip(envs, out.sequences, strict=True):
            await env.initial_observation()
            step = await env.step(list(seq.tokens), seq.stop_reason)
            correct.append(step.metrics["correct"])
            fmt.append(step.metrics["format"])
        return correct, fmt

    results = await asyncio.gather(*(one(i) for i in range(len(problems))))
    n = len(problems) * e.samples
    metrics = {
        "accuracy": sum(sum(c) for c, _ in results) / n,
        "format": sum(sum(f) for _, f in results) / n,
        "problems": float(len(problems)),
    }
    if e.samples > 1:
        metrics[f"pass@{e.samples}"] = sum(max(c) for c, _ in results) / len(problems)
    return metrics


async def nll_eval(e: NLLPinned, sampler: SamplingClient, chat: Renderer) -> Metrics:
    convs, where = load_conversations(e.data)
    convs, where = convs[: e.max_rows], where[: e.max_rows]
    rendered = [render_row(chat, c, e.train_on_what, w) for c, w in zip(convs, where, strict=True)]
    logprobs = await asyncio.gather(*(_awaited(sampler.compute_logprobs(tokens)) for tokens, _ in rendered))
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


async def _awaited(x: Awaitable[Any]) -> Any:
    return await x


async def python_eval(e: PythonPinned, sampler: SamplingClient, tokenizer: Tokenizer) -> Metrics:
    where = f"python eval {e.target!r}"
    fn: Callable[..., Any] = import_target(e.target)
    try:
        out = fn(sampler, tokenizer, **e.args)
        if inspect.isawaitable(out):
            out = await out
    except UserError:
        raise
    except Exception as ex:  # noqa: BLE001 - user code: one line naming it
        raise UserError(f"{where} raised {describe_error(ex)}") from None
    if not isinstance(out, dict) or not all(isinstance(k, str) for k in out):
        raise UserError(f"{where} returned {type(out).__name__}, expected a dict of metric name -> number")
    bad = [k for k, v in out.items() if isinstance(v, bool) or not isinstance(v, (int, float))]
    if bad:
        raise UserError(f"{where}: metric {bad[0]!r} is {type(out[bad[0]]).__name__}, expected a number")
    return {k: float(v) for k, v in out.items()}


async def pinned_metrics(evals: list[PinnedEval], sampler: Awaitable[SamplingClient] | SamplingClient,
                         tokenizer: Tokenizer, renderer: str = "auto", model_name: str | None = None) -> Metrics:  # fmt: skip
    """run_evals on a sampler or the future of one; {} (nothing awaited) when there are no pinned evals."""
    if not evals:
        return {}
    client = await sampler if inspect.isawaitable(sampler) else sampler
    return await run_evals(evals, client, tokenizer, renderer, model_name)
