"""The `math` pinned eval (runner/recipe/pinned.py MathPinned): accuracy on math problems with the `math` env's
loading, prompt and grading (runner/rl/envs/math.py), at fixed sampling params."""

from __future__ import annotations

import asyncio

from backends.errors import UserError
from backends.types import SamplingParams
from runner.engine.evals import EvalContext, EvalKind, Metrics
from runner.engine.math_eval_config import MathPinned
from runner.recipe.sources import File, Jsonl
from runner.renderers.chat import ChatRenderer
from runner.rl.envs.math import MathEnv, load_problems
from runner.rl.envs.math_config import Math


def as_math_env(e: MathPinned) -> Math:
    return Math(data=e.data, question_field=e.question_field, answer_field=e.answer_field,
                answer_format=e.answer_format, question_suffix=e.question_suffix, few_shot=e.few_shot,
                grader=e.grader)  # fmt: skip


async def math_eval(e: MathPinned, ctx: EvalContext) -> Metrics:
    problems = load_problems(e.data, e.question_field, e.answer_field)[: e.max_problems]
    cfg, renderer = as_math_env(e), ChatRenderer(ctx.renderer)

    async def one(i: int) -> tuple[list[float], list[float]]:
        envs = [MathEnv(renderer, problems[i], cfg) for _ in range(e.samples)]
        prompt, stop = await envs[0].initial_observation()
        # Problem i's samples are seeded seed .. seed + samples - 1 (sample k of a request seeded s samples as a
        # request seeded s + k), so problems' seeds are spaced by `samples` to keep their draws apart.
        seed = None if e.temperature == 0 else (e.seed * 1_000_003 + i * e.samples) % 2**31
        params = SamplingParams(max_tokens=e.max_tokens, temperature=e.temperature, stop=stop, seed=seed)
        out = await ctx.sampler.sample(prompt, e.samples, params)
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


def check_math(e: MathPinned, where: str) -> None:
    """`runner check`: a local file's rows are problems with the fields the eval reads (question_field /
    answer_field), as the run's first eval would find them after the model loads. Other sources (a hub dataset, user
    code) are read when the eval runs."""
    if isinstance(e.data, (Jsonl, File)):
        try:
            load_problems(e.data, e.question_field, e.answer_field)
        except UserError as err:
            raise UserError(f"{where}: {err}") from None


EVAL = EvalKind(math_eval, check_math)
