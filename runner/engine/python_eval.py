"""The `python` pinned eval (runner/recipe/pinned.py PythonPinned): the user's fn(sampler, tokenizer, **args) ->
{metric: number}, sync or async. `runner check` has imported it and bound its args already (a `Target` field:
runner/recipe/load.py check_recipe, with TARGET_LEADING)."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from backends.errors import UserError
from runner.engine.evals import EvalContext, EvalKind, Metrics
from runner.engine.python_eval_config import PythonPinned
from runner.recipe.targets import import_target
from runner.rl.rollouts import describe_error


async def python_eval(e: PythonPinned, ctx: EvalContext) -> Metrics:
    where = f"python eval {e.target!r}"
    fn: Callable[..., object] = import_target(e.target)
    try:
        out = fn(ctx.sampler, ctx.tokenizer, **e.args)
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


EVAL = EvalKind(python_eval)
