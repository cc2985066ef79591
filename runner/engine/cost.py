"""Tokens, prices and budgets (docs/cost.md).

Every backend call that the service bills goes through one counting wrapper (`CountingBackend`, around whatever
backend the loop was given), so any algorithm is counted without knowing it:
  prefill  prompt tokens of sample() (once per request, whatever num_samples), every token of compute_logprobs(),
           the datums of forward() (a forward-only pass), and the extra forward pass of forward_backward_custom()
           (Tinker runs a custom loss as forward + forward_backward);
  sample   tokens returned by sample() (counted when the request completes);
  train    the datums' tokens sent to forward_backward() and forward_backward_custom().
A step's counts are what was submitted (and sampled) between the start of its prepare() and the start of the next
step's: its rollouts, its training, and the evals run at it. The loop logs them with the step's row as
`tokens/{prefill,sample,train}`, the running totals as `tokens/total_{prefill,sample,train}` and `tokens/total`,
and, where the model has a price, `cost/step_usd` and `cost/total_usd`. The totals are stored in each checkpoint row
("cost"), so a resumed run continues them.

Prices (USD per million tokens), the first that has the model wins: the recipe's `price = {...}`; its `price_file`;
the file named by $RUNNER_PRICES; the shipped table (the `price` column of runner/models.toml). A local run costs 0 unless its
recipe sets `price` or a `price_file` that lists its model (its tokens are still counted).

`budget = {usd = ..., tokens = ...}`: before each step the loop compares the totals so far (every step submitted,
also those still in flight) with the limits; once one is reached no further step starts, the submitted steps finish,
the last of them is checkpointed and the run ends with a one-line reason (exit code 3, `BudgetReached`). The step
that crosses a limit runs to its end, so a run overshoots by at most its last step (times `depth` + 1 when
pipelined); a budget crossed by the last step simply ends the run. Rerunning with a larger budget resumes there.
"""

from __future__ import annotations

import contextvars
import os
import threading
import tomllib
from dataclasses import dataclass
from pathlib import Path

import msgspec

from backends.base import Backend, CustomLossFn, Future, SamplingClient, TrainingClient
from backends.errors import UserError
from backends.tokenizer import Tokenizer
from backends.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraSpec,
    LossFn,
    OptimStepOutput,
    SampleOutput,
    SamplingParams,
)
from runner.engine.checkpoints import Checkpoint, SavedCost
from runner.models import models
from runner.recipe.common import Json
from runner.recipe.cost import Budget, Price
from runner.recipe.schema import Recipe

KINDS: tuple[str, ...] = ("prefill", "sample", "train")


class BudgetReached(Exception):
    """The recipe's budget was reached: the submitted steps finished and the last was checkpointed (exit code 3)."""


# ---------------------------------------------------------------- tokens

@dataclass(frozen=True)
class Usage:
    prefill: int = 0
    sample: int = 0
    train: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prefill + other.prefill, self.sample + other.sample, self.train + other.train)

    def __mul__(self, k: float) -> Usage:
        return Usage(round(self.prefill * k), round(self.sample * k), round(self.train * k))

    @property
    def total(self) -> int:
        return self.prefill + self.sample + self.train

    def usd(self, price: Price) -> float:
        return (self.prefill * price.prefill + self.sample * price.sample + self.train * price.train) / 1e6

    def to_dict(self) -> dict[str, int]:
        return {"prefill": self.prefill, "sample": self.sample, "train": self.train}


# The step whose work a backend call is (set by the loop around a step's prepare and submit; inherited by the tasks
# they start, such as an RL eval). A call's tokens go to the step that issued it, whenever its result comes back, so a
# row's counts do not depend on timing: the same seed logs the same tokens, and a resumed run the uninterrupted one's.
STEP: contextvars.ContextVar[int | None] = contextvars.ContextVar("runner_cost_step", default=None)


class Counter:
    """Thread-safe token counts per issuing step (STEP; None outside any step), until take() (sample results arrive
    on the backend's threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[int | None, dict[str, int]] = {}

    def add(self, kind: str, n: int, step: int | None = None) -> None:
        step = STEP.get() if step is None else step
        with self._lock:
            self._counts.setdefault(step, dict.fromkeys(KINDS, 0))[kind] += n

    def take(self, step: int | None = None) -> Usage:
        """The counts of every step up to `step` (and of calls outside any step), removed; None: all of them."""
        with self._lock:
            keys = [k for k in self._counts if k is None or step is None or k <= step]
            taken = [self._counts.pop(k) for k in keys]
        return sum((Usage(**c) for c in taken), Usage())

    def peek(self) -> Usage:
        """Everything counted and not yet taken."""
        with self._lock:
            return sum((Usage(**c) for c in self._counts.values()), Usage())


def _tokens(data: list[Datum]) -> int:
    return sum(d.length for d in data)


class CountingSamplingClient:
    def __init__(self, inner: SamplingClient, counter: Counter):
        self.inner, self.counter = inner, counter

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        self.counter.add("prefill", len(prompt))
        step = STEP.get()
        fut = self.inner.sample(prompt, num_samples, params)

        # Once, when the request completes (before any awaiting coroutine resumes: this callback is added first);
        # a failed request samples nothing.
        def done(_: object) -> None:
            try:
                out = fut.result()
            except BaseException:
                return
            self.counter.add("sample", sum(len(s.tokens) for s in out.sequences), step)

        fut.future().add_done_callback(done)
        return fut

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        self.counter.add("prefill", len(tokens))
        return self.inner.compute_logprobs(tokens)

    def __getattr__(self, name: str) -> object:  # a backend's own extras, outside the protocol
        return getattr(self.inner, name)


class CountingTrainingClient:
    def __init__(self, inner: TrainingClient, counter: Counter):
        self.inner, self.counter = inner, counter

    def forward(self, data: list[Datum], loss_fn: LossFn,
                loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        self.counter.add("prefill", _tokens(data))
        return self.inner.forward(data, loss_fn, loss_config)

    def forward_backward(self, data: list[Datum], loss_fn: LossFn,
                         loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        self.counter.add("train", _tokens(data))
        return self.inner.forward_backward(data, loss_fn, loss_config)

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        n = _tokens(data)
        self.counter.add("prefill", n)
        self.counter.add("train", n)
        return self.inner.forward_backward_custom(data, loss_fn)

    def save_weights_and_get_sampling_client(self) -> Future[SamplingClient]:
        return self.inner.save_weights_and_get_sampling_client().map(
            lambda sc: CountingSamplingClient(sc, self.counter))

    # Not billed by token:
    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]:
        return self.inner.optim_step(params)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return self.inner.save_state(name, ttl_seconds)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return self.inner.save_weights_for_sampler(name, ttl_seconds)

    def __getattr__(self, name: str) -> object:  # a backend's own extras, outside the protocol
        return getattr(self.inner, name)


class CountingBackend:
    """`inner` with every training and sampling client it makes counted into `counter`."""

    def __init__(self, inner: Backend, counter: Counter):
        self.inner, self.counter = inner, counter

    def create_training_client(self, spec: LoraSpec) -> Future[TrainingClient]:
        return self.inner.create_training_client(spec).map(lambda tc: CountingTrainingClient(tc, self.counter))

    def create_training_client_from_state(self, path: str, spec: LoraSpec,
                                          with_optimizer: bool = True) -> Future[TrainingClient]:
        return self.inner.create_training_client_from_state(path, spec, with_optimizer).map(
            lambda tc: CountingTrainingClient(tc, self.counter))

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> Future[SamplingClient]:
        return self.inner.create_sampling_client(model_path, base_model).map(
            lambda sc: CountingSamplingClient(sc, self.counter))

    def get_tokenizer(self) -> Tokenizer:
        return self.inner.get_tokenizer()

    def checkpoint_ttl_seconds(self) -> int | None:
        return self.inner.checkpoint_ttl_seconds()

    def close(self, status: str = "success") -> None:
        self.inner.close(status)

    def __getattr__(self, name: str) -> object:  # a backend's own extras, outside the protocol
        return getattr(self.inner, name)


# ---------------------------------------------------------------- prices

def read_prices(path: Path, what: str) -> dict[str, Price]:
    """A price file: `[models."NAME"]` tables of prefill/sample/train (USD per million tokens)."""
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{what}: no such file {path}") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"{what}: {path}: {e}") from None
    models = raw.get("models")
    if not isinstance(models, dict) or set(raw) - {"models"}:
        raise UserError(f'{what}: {path} must hold only [models."NAME"] tables of prefill, sample, train')
    try:
        return {name: msgspec.convert(v, Price) for name, v in models.items()}
    except msgspec.ValidationError as e:
        raise UserError(f"{what}: {path}: {e}") from None


def shipped_price(model: str) -> Price | None:
    """The model's price in runner/models.toml (exact name, as a price file is read), or None."""
    row = models().get(model)
    return msgspec.convert(row.price, Price) if row is not None and row.price is not None else None


def price_of(recipe: Recipe, where: Path | None = None) -> tuple[Price | None, str]:
    """The model's price and where it came from; (None, why) when unknown (tokens are counted, USD is not).
    `where`: the directory a relative price_file is read from (default: the working directory)."""
    if recipe.price is not None:
        return recipe.price, "the recipe's price"
    tables: list[tuple[Path, str]] = []
    if recipe.price_file:
        path = Path(recipe.price_file).expanduser()
        tables.append((path if path.is_absolute() or where is None else where / path, "price_file"))
    if not recipe.backend.billed():  # the local backend: the recipe's own price file only
        if tables and (price := read_prices(*tables[0]).get(recipe.model)) is not None:
            return price, f"price_file ({tables[0][0]})"
        kind = recipe.backend.__struct_config__.tag
        return Price(), f"{kind} backend: free (set price = {{...}} to estimate another backend's)"
    if env := os.environ.get("RUNNER_PRICES"):
        tables.append((Path(env).expanduser(), "$RUNNER_PRICES"))
    for path, what in tables:
        if (price := read_prices(path, what).get(recipe.model)) is not None:
            return price, f"{what} ({path})"
    if (shipped := shipped_price(recipe.model)) is not None:
        return shipped, "the shipped table"
    return None, f"no price for {recipe.model!r} (add price = {{prefill, sample, train}} to the recipe)"


# ---------------------------------------------------------------- the run's ledger

class Ledger:
    """The run's counts: `counter` fills as calls are made; take() closes a step (at submit time), row() logs it
    (at finish time, in order), checkpoint() is what a checkpoint row stores for a resume."""

    def __init__(self, price: Price | None, budget: Budget | None, before: Usage = Usage(), usd_before: float = 0.0):
        self.price, self.budget = price, budget
        self.counter = Counter()
        self.logged, self.usd = before, usd_before  # totals as of the last row logged
        self.submitted, self.usd_submitted = before, usd_before  # ... and of every step submitted

    @staticmethod
    def start(recipe: Recipe, resume: Checkpoint | None) -> Ledger:
        price, why = price_of(recipe)
        if price is None and recipe.budget is not None and recipe.budget.usd is not None:
            raise UserError(f"budget.usd needs a price: {why}")
        saved = resume.cost if resume is not None and resume.cost is not None else SavedCost()
        return Ledger(price, recipe.budget, Usage(saved.prefill, saved.sample, saved.train), saved.usd)

    def wrap(self, backend: Backend) -> Backend:
        return CountingBackend(backend, self.counter)

    def _usd(self, usage: Usage) -> float:
        return usage.usd(self.price) if self.price is not None else 0.0

    def take(self, step: int | None = None) -> Usage:
        """A finished step's counts (every call it issued has come back); None: all that is left (the final row)."""
        usage = self.counter.take(step)
        self.submitted = self.logged + usage + self.counter.peek()
        self.usd_submitted = self.usd + self._usd(usage + self.counter.peek())
        return usage

    def row(self, usage: Usage) -> dict[str, float]:
        self.logged += usage
        self.usd += self._usd(usage)
        row: dict[str, float] = {f"tokens/{k}": v for k, v in usage.to_dict().items()}
        row.update({f"tokens/total_{k}": v for k, v in self.logged.to_dict().items()})
        row["tokens/total"] = self.logged.total
        if self.price is not None:
            row.update({"cost/step_usd": self._usd(usage), "cost/total_usd": self.usd})
        return row

    def checkpoint(self) -> Json:
        return {"cost": {**self.logged.to_dict(), "usd": self.usd}}

    def exhausted(self) -> str | None:
        """Why no further step may start (a limit reached by the steps submitted so far), or None."""
        b = self.budget
        if b is None:
            return None
        pending = self.counter.peek()
        self.submitted, self.usd_submitted = self.logged + pending, self.usd + self._usd(pending)
        if b.tokens is not None and self.submitted.total >= b.tokens:
            return f"token budget reached: {self.submitted.total:,} of {b.tokens:,} tokens"
        if b.usd is not None and self.usd_submitted >= b.usd:
            return f"budget reached: ${self.usd_submitted:.4f} of ${b.usd:g}"
        return None
