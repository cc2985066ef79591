"""The types at the loop's boundary: what an algorithm is (`Algorithm`), what it may use while preparing a step
(`Context`) and after the last one (`FinalContext`), and where a chained recipe starts (`InitWeights`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from backends.base import Backend, Future, SamplingClient, TrainingClient
from backends.types import AdamParams
from runner.recipe.common import Json
from runner.recipe.schema import Recipe
from runner.renderers.base import Tokenizer


@dataclass
class Context:
    """What prepare() may use. There is no training client: calls that train go through submit()."""

    backend: Backend
    tokenizer: Tokenizer
    # The run dir, for what an algorithm writes besides metrics (RL transcripts).
    log_dir: Path
    # A sampling client over the weights as of now in the training FIFO (after every step submitted so
    # far): what RL samples its first step of a session from.
    snapshot: Callable[[], Future[SamplingClient]]


@dataclass
class FinalContext:
    """What final() may use. There is no training client: a run resumed only for final() creates none."""

    backend: Backend
    # The final checkpoint's sampler weights: exactly the weights after the last optim_step.
    sampler_path: str
    log_dir: Path
    # `runner eval` of a checkpoint: the step its weights sample (the checkpoint's next_step), so an eval seeded by
    # step (RL's test rollouts) draws what the run's own eval at that step drew. None: the run's final eval.
    step: int | None = None


# Each algorithm's own types: what prepare() yields and submit() takes (a batch or minibatch: SFT's list[Datum], RL's
# Part), and what submit() returns and finish() awaits (its futures). The loop hands them on without looking inside.
Part = TypeVar("Part")
Sub = TypeVar("Sub")


class Algorithm(Protocol[Part, Sub]):
    total_steps: int

    # Positional-only (`/`): implementations name their parameters after their own types.
    def prepare(self, step: int, ctx: Context, /) -> AsyncIterator[Part]:
        """The batch for `step`, as one or more parts, each handed to submit() the moment it is yielded (a
        streaming algorithm yields minibatches as their rollouts finish, so training overlaps sampling);
        advances the data position (and RNG) past the step."""
        ...

    def submit(self, tc: TrainingClient, step: int, part: Part, adam: AdamParams, evaluate: bool, /) -> Sub:
        """Queue one part's calls without waiting; `evaluate` is true for the first part of an eval step (queue
        the eval first). Return the futures."""
        ...

    async def finish(self, step: int, submitted: list[Sub], /) -> dict[str, float]:
        """Await what submit() queued for every part of the step; the step's metrics."""
        ...

    def state(self) -> Json:
        """JSON-able data position / RNG as of the last prepare(): stored in the checkpoint row."""
        ...

    def load_state(self, state: Json, next_step: int, /) -> None: ...

    def describe(self) -> list[str]:
        """Dry-run plan lines: data, datums and tokens per step, calls per step."""
        ...

    def final_plan(self, evaluate: bool, /) -> str | None:
        """What final() does after the last step, as a dry-run plan line; None when it does nothing (then
        no row is logged for it). `evaluate`: evals are on (eval_every > 0)."""
        ...

    async def final(self, ctx: FinalContext, evaluate: bool, /) -> dict[str, float]:
        """After the last step, on the final weights: the metrics of the row logged at step total_steps
        (RL: the final eval). Called only when final_plan(evaluate) is not None."""
        ...

    async def evaluate(self, ctx: FinalContext, /) -> dict[str, float]:
        """`runner eval`: the held-out evals on ctx's sampler weights, any checkpoint (the same numbers the run
        logs for them); {} when the recipe has none."""
        ...


class AlgorithmBase:
    """What the built-in algorithms (runner/algos/) share: no final step unless `final_plan` names one, and `runner
    eval` is that final eval on any checkpoint's weights (the same numbers the run logs for them)."""

    def final_plan(self, evaluate: bool, /) -> str | None:
        return None

    async def final(self, ctx: FinalContext, evaluate: bool, /) -> dict[str, float]:
        return {}

    async def evaluate(self, ctx: FinalContext, /) -> dict[str, float]:
        return await self.final(ctx, True) if self.final_plan(True) is not None else {}


class ChainStage(Protocol):
    """A stage of a chain as InitWeights.planned reads it (runner/engine/chain.py Upstream)."""

    @property
    def ref(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def recipe(self) -> Recipe: ...


@dataclass(frozen=True)
class InitWeights:
    """Where a chained recipe starts (runner/engine/chain.py): another run's final checkpoint. Training starts from its
    state (weights only: fresh optimizer, step 0), and reference models (DPO, the RL KL penalty) are its sampler
    weights, also after a resume."""

    ref: str
    name: str
    recipe: Recipe
    state_path: str
    sampler_path: str
    checkpoint: str

    @staticmethod
    def planned(stage: ChainStage) -> InitWeights:
        """A dry run's stand-in for an upstream that may not have trained yet."""
        return InitWeights(stage.ref, stage.name, stage.recipe, "", "", "(its final checkpoint)")

    def record(self) -> Json:
        from runner.recipe.load import dump_recipe  # tomli_w: only when recorded

        return {"ref": self.ref, "name": self.name, "checkpoint": self.checkpoint, "state_path": self.state_path,
                "sampler_path": self.sampler_path, "recipe": dump_recipe(self.name, self.recipe)}
