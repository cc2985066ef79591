"""Evals pinned in a recipe (`[[recipes.x.evals]]`), run by runner/engine/evals.py. Part of the recipe schema
(runner/recipe/schema.py re-exports every name).

A pinned eval kind is its struct here (a subclass of `PinnedEvalBase`: the `PinnedEval` union is every subclass)
whose `implementation` names its module, which declares `EVAL = EvalKind(run, check)` (runner/engine/evals.py):
nothing lists the kinds, as for algorithms and envs."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union

from msgspec import Meta

from runner.recipe.common import Base, DataSource, NonNegFloat, NonNegInt, PosInt, Target, TrainOnWhat, variants

# ---------------------------------------------------------------- pinned evals ([[recipes.x.evals]])


class PinnedEvalBase(Base, tag_field="kind", tag=str.lower, kw_only=True):
    """An eval pinned in the recipe (runner/engine/evals.py): run with eval_every, after the last step and by `runner
    eval`, on the sampler weights of the moment; logged as test/eval/<name>/<metric>."""

    # The metric prefix; default: the kind, with its position when two evals share a kind ("math", "math_1").
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]+$")] | None = None

    # The module that runs this kind: it declares `EVAL = EvalKind(...)` (runner/engine/evals.py), and the engine
    # imports it by this name (the recipe sits below the engine, so it names the module rather than importing it).
    implementation: ClassVar[str] = ""

    def default_name(self) -> str:
        """The metric prefix when `name` is not set: the kind."""
        return str(type(self).__struct_config__.tag)


class MathPinned(PinnedEvalBase, tag="math"):
    """Accuracy on math problems (the `math` env's loading, prompt and grading) at fixed sampling params:
    test/eval/<name>/accuracy, .../format."""

    implementation: ClassVar[str] = "runner.engine.math_eval"

    data: DataSource
    question_field: str | None = None
    answer_field: str | None = None
    answer_format: Literal["boxed", "auto"] = "boxed"
    question_suffix: str | None = None
    few_shot: bool = True
    grader: Literal["auto", "builtin", "math_verify"] = "auto"
    # The first max_problems rows (None: all).
    max_problems: PosInt | None = None
    # 0 = greedy; with samples > 1 accuracy is the mean over samples (and pass@samples is logged).
    temperature: NonNegFloat = 0.0
    max_tokens: PosInt = 256
    samples: PosInt = 1
    seed: NonNegInt = 0


class NLLPinned(PinnedEvalBase, tag="nll"):
    """Mean per-token NLL of conversations (`{"messages": [...]}` rows) under the weights: test/eval/<name>/nll."""

    implementation: ClassVar[str] = "runner.engine.nll_eval"

    data: DataSource
    train_on_what: TrainOnWhat = "last_assistant_message"
    # The first max_rows conversations (None: all).
    max_rows: PosInt | None = None


class PythonPinned(PinnedEvalBase, tag="python"):
    """User code: fn(sampler, tokenizer, **args) -> {metric: float} (sync or async); `sampler` is a backend
    SamplingClient (sample, compute_logprobs)."""

    implementation: ClassVar[str] = "runner.engine.python_eval"

    target: Target
    args: dict[str, Any] = {}
    # fn's positional arguments before the args (sampler, tokenizer): what `runner check` binds them after.
    TARGET_LEADING: ClassVar[int] = 2


class InspectPinned(PinnedEvalBase, tag="inspect"):
    """An inspect_ai task (the `inspect` extra) against the weights, through a model provider backed by the sampler
    and the recipe's renderer (runner/engine/inspect_eval.py): test/eval/<name>/<metric> for its scorer's metrics
    (<scorer>/<metric> when it has several). Default name: the task's own (gsm8k for "inspect_evals/gsm8k")."""

    implementation: ClassVar[str] = "runner.engine.inspect_eval"

    # A registry name ("inspect_evals/gsm8k": a task of an installed package), "file.py@task", or "pkg.mod:fn"
    # (a function returning a Task, called with task_args).
    task: Annotated[str, Meta(min_length=1)]
    task_args: dict[str, Any] = {}
    # The first `limit` samples (None: all).
    limit: PosInt | None = None
    # Fixed sampling, whatever the task's own generate config says; 0 = greedy. A seed per sample (from `seed`, the
    # sample's id and epoch, and the prompt) when temperature > 0.
    temperature: NonNegFloat = 0.0
    max_tokens: PosInt = 256
    seed: NonNegInt = 0
    # Samples in flight at once (the sampler batches them).
    max_samples: PosInt = 32

    def default_name(self) -> str:
        return task_name(self.task)


def task_name(task: str) -> str:
    """The metric prefix of an unnamed inspect eval: the task's own name ("inspect_evals/gsm8k" -> "gsm8k",
    "pkg.mod:fn" -> "fn", "dir/tasks.py@qa" -> "qa", "dir/tasks.py" -> "tasks")."""
    tail = re.split(r"[/:@]", task.rstrip("/"))[-1].removesuffix(".py")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", tail) or "inspect"


def task_file(task: str) -> tuple[str, str] | None:
    """An inspect task spec naming a file, split: ("dir/tasks.py", "@qa"), ("dir/tasks.py", ""); None otherwise."""
    file, at, name = task.partition("@")
    return (file, at + name) if file.endswith(".py") else None


# Every pinned eval, in the order declared above (a new kind: its struct here, naming its module).
PINNED_VARIANTS: tuple[type[PinnedEvalBase], ...] = variants(PinnedEvalBase)
if TYPE_CHECKING:
    PinnedEval = PinnedEvalBase
else:
    PinnedEval = Union[PINNED_VARIANTS]  # noqa: UP007 - built from the variants at import
