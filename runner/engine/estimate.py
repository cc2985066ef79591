"""The dry run's estimate of tokens and cost (docs/cost.md): every stage of a chain that is still to run, and the total.

Nothing is trained and nothing is written: the algorithm prepares and submits its first steps against a stand-in
backend (runner/engine/probe.py: a uniform model that trains nothing, and a sampler whose every reply runs to
max_tokens without stopping), wrapped in the same counter as a real run (runner/engine/cost.py). So the tokens are those the algorithm really
submits for replies of max_tokens: an upper bound on sampling (prompts x group size x max_tokens), and on what is
trained and scored on the replies (RL datums, KL reference logprobs, teachers). The probe's per-step counts are
scaled to the steps still to run; an eval step adds what one probed eval step added, and a final() row (RL, DPO, the
reward model: the final eval) one more. Multi-turn envs see truncated replies, which usually end an episode, so
their later turns are not estimated.
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from backends.errors import UserError
from backends.tokenizer import Tokenizer, load_tokenizer
from backends.types import LoraSpec
from runner.engine.context import Algorithm, Context, Part, Sub
from runner.engine.cost import Counter, CountingBackend, Usage, price_of
from runner.engine.probe import ProbeBackend
from runner.engine.schedule import adam_at
from runner.recipe.schema import Recipe

# Training steps probed (then one eval step when the run evaluates).
PROBE_STEPS = 2


@dataclass(frozen=True)
class Estimate:
    usage: Usage
    usd: float | None  # None: no price for the model
    steps: int
    line: str


async def _probe(recipe: Recipe, algo: Algorithm[Part, Sub], tokenizer: Tokenizer, evals: bool) -> tuple[Usage, Usage]:
    """(tokens per training step, what an eval step adds)."""
    counter = Counter()
    probe = ProbeBackend(tokenizer)
    backend = CountingBackend(probe, counter)
    total = algo.total_steps
    train_steps = min(total, PROBE_STEPS)
    try:
        tc = await backend.create_training_client(LoraSpec(base_model=recipe.model, seed=recipe.seed))
        with tempfile.TemporaryDirectory() as tmp:
            ctx = Context(backend, tokenizer, Path(tmp), tc.save_weights_and_get_sampling_client)  # type: ignore[arg-type]
            used: list[Usage] = []
            for step in range(train_steps + (1 if evals and total > train_steps else 0)):
                evaluate = step >= train_steps
                adam = adam_at(recipe, step, total)
                submitted: list[Sub] = []
                async for part in algo.prepare(step, ctx):
                    submitted.append(algo.submit(tc, step, part, adam, evaluate and not submitted))
                await algo.finish(step, submitted)
                used.append(counter.take())
    finally:
        probe.close()
    per_step = sum(used[:train_steps], Usage()) * (1 / max(1, train_steps))
    extra = Usage()
    if len(used) > train_steps:
        e = used[-1]
        extra = Usage(max(0, e.prefill - per_step.prefill), max(0, e.sample - per_step.sample),
                      max(0, e.train - per_step.train))
    return per_step, extra


def estimate(recipe: Recipe, algo: Algorithm, tokenizer: Tokenizer, start: int, final: bool) -> Estimate:
    """The tokens and cost of steps start .. total - 1 (and the final row when `final`)."""
    total = algo.total_steps
    todo = range(start, total)
    n_evals = sum(1 for s in todo if recipe.eval_every > 0 and s % recipe.eval_every == 0) + (1 if final else 0)
    price, why = price_of(recipe)
    if not todo and not final:
        return Estimate(Usage(), 0.0 if price is not None else None, 0, "estimate: nothing left to run")
    per_step, extra = asyncio.run(_probe(recipe, algo, tokenizer, n_evals > 0))
    usage = per_step * len(todo) + extra * n_evals
    usd = usage.usd(price) if price is not None else None
    cost = f"${usd:.4f}" if usd is not None else "unknown"
    bound = " (an upper bound: every reply max_tokens long)" if usage.sample else ""
    line = (f"estimate for {len(todo)} steps{f' + {n_evals} evals' if n_evals else ''}{bound}: prefill "
            f"{usage.prefill:,}, sample {usage.sample:,}, train {usage.train:,} tokens "
            f"(total {usage.total:,}); cost {cost} ({why}); per step: prefill {per_step.prefill:,}, sample "
            f"{per_step.sample:,}, train {per_step.train:,}")
    return Estimate(usage, usd, len(todo), line)


@dataclass(frozen=True)
class Stage:
    """One run of a chain as the dry run sees it."""

    label: str
    recipe: Recipe
    start: int
    finished: bool
    build: Callable[[Tokenizer], Algorithm]  # make_algo's result: an Algorithm from a tokenizer
    has_row: Callable[[int], bool]  # whether the run dir's metrics hold a row for a step (RunDir.has_row)

    def final_due(self, algo: Algorithm) -> bool:
        """Whether the row after the last step (final(), pinned evals) is still to run (as loop.final_due)."""
        total = algo.total_steps
        final = algo.final_plan(self.recipe.eval_every > 0) is not None or bool(self.recipe.evals)
        return final and (self.start < total or (self.start == total and not self.has_row(total)))


def print_chain_estimate(stages: Sequence[Stage]) -> None:
    """One line per stage (a finished one costs nothing more), then the total when there are several."""
    total, usd, unknown = Usage(), 0.0, []
    for st in stages:
        if st.finished:
            print(f"cost of {st.label}: finished, nothing more to run")
            continue
        try:
            tokenizer = load_tokenizer(st.recipe.tokenizer or st.recipe.model)
            algo = st.build(tokenizer)
            est = estimate(st.recipe, algo, tokenizer, st.start, st.final_due(algo))
        except UserError as e:  # e.g. data that an upstream stage has yet to write
            print(f"cost of {st.label}: not estimated ({e})")
            unknown.append(st.label)
            continue
        print(f"cost of {st.label}: {est.line}")
        total += est.usage
        if est.usd is None:
            unknown.append(st.label)
        else:
            usd += est.usd
    if len(stages) > 1:
        rest = f" + what {', '.join(unknown)} cost{'s' if len(unknown) == 1 else ''} (not estimated)" if unknown else ""
        print(f"total cost of the chain: ${usd:.4f}{rest}; {total.total:,} tokens (prefill {total.prefill:,}, "
              f"sample {total.sample:,} at most, train {total.train:,})")
