"""Pinned evals of kind "inspect" (runner/recipe/pinned.py:InspectPinned): an inspect_ai task run on the sampler's
weights through the "runner" model provider (runner/engine/inspect_model.py), metrics taken from its eval log.

inspect_ai is an optional extra (`pip install 'runner[inspect]'`). This module loads it only inside functions, and
only for a recipe that pins an inspect eval: without it, `runner check`, `run` and `eval` of such a recipe say so in
one line. The eval runs in runner's event loop (eval_async), prints nothing (display "none"), and writes its log to
$INSPECT_LOG_DIR when set, else to a temporary directory removed afterwards. (inspect_ai imports carry a pyright
ignore, so pyright is clean in an environment without the extra too.)
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from backends.base import SamplingClient
from backends.errors import UserError
from runner.engine.evals import EvalContext, EvalKind
from runner.engine.inspect_eval_config import InspectPinned, task_file
from runner.recipe.common import TARGET_PATTERN
from runner.recipe.targets import args_mismatch, import_target
from runner.renderers import Renderer

if TYPE_CHECKING:
    from inspect_ai import Task
    from inspect_ai.log import EvalLog

Metrics = dict[str, float]

MISSING = "kind = \"inspect\" needs the inspect_ai package: pip install 'runner[inspect]' (or pip install inspect_ai)"
NAMES = "a task of an installed package ('inspect_evals/gsm8k'), 'file.py@task', or 'pkg.mod:fn' returning a Task"


def available(package: str = "inspect_ai") -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def require() -> None:
    if not available():
        raise UserError(MISSING)


def task_function(task: str) -> Callable[..., object] | None:
    """The function that builds `task`, found without building it (no dataset is read); None for a file spec (its
    file is checked to exist). UserError when nothing by that name exists."""
    if re.fullmatch(TARGET_PATTERN, task):
        return import_target(task)
    spec = task_file(task)
    if spec is not None:
        file = Path(spec[0])
        if not file.exists():
            raise UserError(f"inspect task file not found: {file} (looked in {os.getcwd()})")
        _check_task_file(file, spec[1].removeprefix("@"))
        return None
    from inspect_ai._util.registry import registry_lookup  # pyright: ignore[reportMissingImports]

    from runner.rl.rollouts import describe_error

    try:
        fn = registry_lookup("task", task)  # loads the package's inspect_ai entry point ("pkg/name")
    except Exception as ex:  # noqa: BLE001 - the package's own import: one line naming it
        raise UserError(f"inspect task {task!r}: loading its package raised {describe_error(ex)}") from None
    if not callable(fn):
        package = task.partition("/")[0] if "/" in task else None
        if package and not available(package):
            raise UserError(f"no inspect task named {task!r}: the package {package!r} is not installed")
        raise UserError(f"no inspect task named {task!r}; name {NAMES}")
    return fn


def _check_task_file(file: Path, name: str) -> None:
    """The file parses and defines the @task functions `name` asks for (read, not run: its imports and dataset
    loading wait for the eval). With no name the file must define at least one."""
    import ast

    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (OSError, SyntaxError, ValueError) as ex:
        raise UserError(f"inspect task file {file}: {type(ex).__name__}: {ex}") from None

    def is_task(d: ast.expr) -> bool:
        d = d.func if isinstance(d, ast.Call) else d
        return (isinstance(d, ast.Name) and d.id == "task") or (isinstance(d, ast.Attribute) and d.attr == "task")

    tasks: list[str] = []
    for f in tree.body:
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for d in f.decorator_list:
            if is_task(d):  # @task(name="other") registers the task under that name
                named = [k.value.value for k in d.keywords if k.arg == "name" and isinstance(k.value, ast.Constant)
                         and isinstance(k.value.value, str)] if isinstance(d, ast.Call) else []
                tasks += named or [f.name]
    if name and name not in tasks:
        known = ", ".join(tasks) if tasks else "none"
        raise UserError(f"no @task function named {name!r} in {file} (its @task functions: {known})")
    if not name and not tasks:
        raise UserError(f"{file} defines no @task function")


def check_task(e: InspectPinned) -> None:
    """What `runner check` can tell without running: the extra is installed, the task exists, its task_args fit."""
    require()
    fn = task_function(e.task)
    problem = args_mismatch(fn, e.task_args) if fn is not None else None
    if problem:
        raise UserError(f"inspect task {e.task!r} cannot be called with task_args {sorted(e.task_args)}: {problem}")


def _check(e: InspectPinned, where: str) -> None:
    """check_task, its errors prefixed with `where` (the eval's key path) and the field they are about."""
    try:
        check_task(e)
    except UserError as ex:
        raise UserError(f"{where}.task: {ex}") from None


def load_task(e: InspectPinned) -> Task:
    """The inspect_ai Task that e names, built with its task_args."""
    from inspect_ai import Task  # pyright: ignore[reportMissingImports]

    from runner.rl.rollouts import describe_error

    check_task(e)
    if re.fullmatch(TARGET_PATTERN, e.task):
        try:
            task = import_target(e.task)(**e.task_args)
        except UserError:
            raise
        except Exception as ex:  # noqa: BLE001 - user code: one line naming it
            raise UserError(f"inspect task {e.task!r} raised {describe_error(ex)}") from None
        if not isinstance(task, Task):
            raise UserError(f"inspect task {e.task!r} returned {type(task).__name__}, not an inspect_ai Task")
        return task
    from inspect_ai._eval.loader import load_task_spec  # pyright: ignore[reportMissingImports]

    try:
        tasks = load_task_spec(e.task, dict(e.task_args))
    except Exception as ex:  # noqa: BLE001 - the task's own code (dataset loading, its arguments)
        raise UserError(f"inspect task {e.task!r}: {describe_error(ex)}") from None
    if len(tasks) != 1:
        found = ", ".join(t.name for t in tasks)
        raise UserError(f"inspect task {e.task!r} names {len(tasks)} tasks ({found}); name one as 'file.py@task'")
    return tasks[0]


async def inspect_eval(e: InspectPinned, sampler: SamplingClient, chat: Renderer, model_name: str | None) -> Metrics:
    """Run e's task on `sampler`'s weights: its scorers' metrics (see metrics_of)."""
    # inspect installs its own excepthook on first use and sets the root logger's level: the runner keeps its own.
    hook, root_level = sys.excepthook, logging.getLogger().level
    require()
    from inspect_ai import eval_async  # pyright: ignore[reportMissingImports]
    from inspect_ai.util._display import init_display_type  # pyright: ignore[reportMissingImports]

    from runner.engine import inspect_model as bridge
    from runner.renderers.chat import ChatRenderer

    key = uuid.uuid4().hex
    try:
        task = load_task(e)
        model = bridge.bridged_model(key, bridge.Bridge(sampler, ChatRenderer(chat), e.temperature, e.max_tokens,
                                                        e.seed, e.max_samples), model_name or "model")
        init_display_type("none")
        with tempfile.TemporaryDirectory(prefix="runner-inspect-") as tmp:
            logs = await eval_async(
                task, model=model, limit=e.limit, log_dir=os.environ.get("INSPECT_LOG_DIR") or tmp,
                log_level="warning", log_realtime=False, score_display=False, ctl_server=False, fail_on_error=True,
                max_samples=e.max_samples, max_connections=e.max_samples,
                temperature=e.temperature, max_tokens=e.max_tokens, seed=e.seed,
            )  # fmt: skip
    except UserError:
        raise
    except Exception as ex:  # noqa: BLE001 - inspect's own refusals (a task it cannot run): one line
        from runner.rl.rollouts import describe_error

        raise UserError(f"inspect eval {e.task!r} failed: {describe_error(ex)}") from None
    finally:
        bridge.BRIDGES.pop(key, None)
        sys.excepthook = hook
        logging.getLogger().setLevel(root_level)
    return metrics_of(e.task, logs[0])


def metrics_of(task: str, log: EvalLog) -> Metrics:
    """An eval log's metrics: <metric> for a task with one scorer, <scorer>/<metric> with several; plus `samples`
    (scored). Non-finite values (a stderr over one sample) are left out. A failed eval is a UserError."""
    if log.status != "success":
        message = log.error.message if log.error is not None else f"status {log.status!r}"
        raise UserError(f"inspect eval {task!r} failed: {' '.join(str(message).split())}")
    scores = log.results.scores if log.results is not None else []
    out: Metrics = {}
    for score in scores:
        scorer = re.sub(r"[^A-Za-z0-9_.-]", "_", score.name)
        for name, metric in score.metrics.items():
            value = metric.value
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out[name if len(scores) == 1 else f"{scorer}/{name}"] = float(value)
    out["samples"] = float(log.results.completed_samples if log.results is not None else 0)
    return out


async def _run(e: InspectPinned, ctx: EvalContext) -> Metrics:
    return await inspect_eval(e, ctx.sampler, ctx.renderer, ctx.model_name)


EVAL = EvalKind(_run, _check)
