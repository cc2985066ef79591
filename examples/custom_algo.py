"""A user-defined algorithm in one file, run from a recipe with no edit to runner itself (examples/custom_algo.toml):

    [recipes.completions.algo]
    kind = "python"
    target = "custom_algo:SPEC"        # this module (next to the recipe, or anywhere on sys.path)
    args = {path = "data/completions.jsonl", batch_size = 4}

It trains a base model on raw text completions ({"prompt": ..., "completion": ...} rows, no chat template):
cross-entropy on the completion's tokens only. `SPEC` tells the loop how to build it, which metrics head the progress
line and `runner compare`, and which struct validates `args` (`runner check` reports a bad key in one line).
The class implements the loop's Algorithm interface (runner/engine/context.py).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from backends.base import Future, TrainingClient
from backends.errors import UserError
from backends.types import AdamParams, Datum, ForwardBackwardOutput, OptimStepOutput
from runner.engine.context import FinalContext
from runner.engine.spec import AlgoSpec, BuildArgs, custom_args


class CompletionArgs(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    batch_size: int = 4
    epochs: int = 1


@dataclass
class Submitted:
    data: list[Datum]
    fwd_bwd: Future[ForwardBackwardOutput]
    optim: Future[OptimStepOutput]


class Completions:
    def __init__(self, args: CompletionArgs, rows: list[dict[str, str]], tokenizer: Any, max_steps: int | None):
        self.args, self.tokenizer = args, tokenizer
        self.data = [self.datum(r["prompt"], r["completion"]) for r in rows]
        self.per_epoch = len(self.data) // args.batch_size
        if self.per_epoch == 0:
            raise UserError(f"algo.args.batch_size = {args.batch_size} is larger than the {len(self.data)} rows")
        self.total_steps = min(self.per_epoch * args.epochs, max_steps or 10**9)

    def datum(self, prompt: str, completion: str) -> Datum:
        p = self.tokenizer.encode(prompt, add_special_tokens=False)
        c = self.tokenizer.encode(completion, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        tokens = p + c
        weights = np.array([0.0] * (len(p) - 1) + [1.0] * len(c), dtype=np.float32)
        return Datum(model_input=tokens[:-1], target_tokens=np.array(tokens[1:]), weights=weights)

    async def prepare(self, step: int, ctx: Any, /) -> AsyncIterator[list[Datum]]:
        i = step % self.per_epoch * self.args.batch_size
        yield self.data[i : i + self.args.batch_size]

    def submit(self, tc: TrainingClient, step: int, batch: list[Datum], adam: AdamParams, evaluate: bool, /) -> Any:
        return Submitted(batch, tc.forward_backward(batch, "cross_entropy"), tc.optim_step(adam))

    async def finish(self, step: int, submitted: list[Submitted], /) -> dict[str, float]:
        (sub,) = submitted
        out = await sub.fwd_bwd
        await sub.optim
        num = sum(float(np.dot(lp, d.weights)) for d, lp in zip(sub.data, out.logprobs, strict=True)
                  if d.weights is not None)
        den = sum(float(d.weights.sum()) for d in sub.data if d.weights is not None)
        return {"completion_nll": -num / den}

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any], next_step: int, /) -> None:
        pass

    def describe(self) -> list[str]:
        return [f"completions: {len(self.data)} rows, {self.per_epoch} batches of {self.args.batch_size} per epoch"]

    def final_plan(self, evaluate: bool, /) -> str | None:
        return None

    async def final(self, ctx: FinalContext, evaluate: bool, /) -> dict[str, float]:
        return {}

    async def evaluate(self, ctx: FinalContext, /) -> dict[str, float]:
        return {}


def build(cfg: Any, args: BuildArgs) -> functools.partial[Completions]:
    a: CompletionArgs = custom_args(SPEC, cfg)
    path = Path(a.path)
    if not path.is_file():
        raise UserError(f"algo.args.path: data file not found: {a.path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return functools.partial(Completions, a, rows, max_steps=args.recipe.max_steps)


SPEC = AlgoSpec(build=lambda cfg, args: build(cfg, args), headline=[("completion_nll", "nll")],
                config=CompletionArgs)
