"""The `inspect` pinned eval's recipe table (`[[recipes.x.evals]] kind = "inspect"`), implemented by runner/engine/inspect_eval.py."""

from __future__ import annotations

import re
from typing import Annotated

from msgspec import Meta

from runner.recipe.common import Json, NonNegFloat, NonNegInt, PinnedEvalBase, PosInt


class InspectPinned(PinnedEvalBase, tag="inspect"):
    """An inspect_ai task (the `inspect` extra) against the weights, through a model provider backed by the sampler
    and the recipe's renderer (runner/engine/inspect_eval.py): test/eval/<name>/<metric> for its scorer's metrics
    (<scorer>/<metric> when it has several). Default name: the task's own (gsm8k for "inspect_evals/gsm8k")."""

    # A registry name ("inspect_evals/gsm8k": a task of an installed package), "file.py@task", or "pkg.mod:fn"
    # (a function returning a Task, called with task_args).
    task: Annotated[str, Meta(min_length=1)]
    task_args: Json = {}
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
