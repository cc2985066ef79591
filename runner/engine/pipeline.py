"""Running a recipe with what it needs first: the unfinished runs of its init_from chain and the runs it samples
from (teachers, judges), each resumed or skipped when finished, then the recipe itself (runner/engine/chain.py
walks the references; runner/engine/loop.py trains one run)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from backends.errors import UserError
from runner.engine.chain import Upstream, _status, dependencies, resolved_inputs, upstreams
from runner.engine.context import InitWeights
from runner.engine.rundir import LOCK, MARKER
from runner.recipe.refs import run_dir_path
from runner.recipe.schema import Recipe

if TYPE_CHECKING:
    from runner.engine.estimate import Stage  # imported by the dry run only


def run_chain(recipe: Recipe, name: str, where: str, *, dry_run: bool = False, force: bool = False) -> None:
    """`runner run`: the unfinished runs this recipe needs first (the init_from chain, teachers, judges), then this
    one, from the last upstream's final weights and with every referenced run resolved to its final sampler weights.
    `force`: this recipe resumes although its data changed (upstreams never do)."""
    from runner.engine.loop import run  # at call time: tests stand a recorder in for the loop module

    chain = upstreams(recipe, where)
    deps = dependencies(recipe, where)
    if dry_run:
        if deps:
            print(f"runs this recipe samples from: {', '.join(f'{d.label} ({_status(d)})' for d in deps)}")
        if chain:
            print(f"chain: {' -> '.join([*(f'{s.label} ({_status(s)})' for s in chain), name])}")
        init = InitWeights.planned(chain[-1]) if chain else None
        pending = [s.label for s in [*deps, *chain] if s.runnable and _status(s) != "finished"]
        try:
            run(recipe, name, dry_run=True, init=init, weights={d.ref: "" for d in deps})
        except UserError:
            if pending:  # its data may be what an upstream has yet to write: still price the stages that can be
                print_costs(recipe, name, where, [*deps, *chain])
            raise
        print_costs(recipe, name, where, [*deps, *chain])
        return
    for stage in [*deps, *chain]:
        if stage.runnable:  # a finished one is a no-op (and a changed one is reported, never silently reused)
            print(f"chain: {stage.label} ({_status(stage)}) in {stage.run_dir}", file=sys.stderr)
            run_stage(stage)
    with naming(where), no_empty_run_dir(run_dir_path(recipe, name)):
        run(recipe, name, force=force, **resolved_inputs(recipe, where))


def run_stage(stage: Upstream) -> None:
    """One upstream run, itself after its own init_from chain (already run: dependencies come in order)."""
    from runner.engine.loop import run

    with naming(stage.ref), no_empty_run_dir(run_dir_path(stage.recipe, stage.name)):
        run(stage.recipe, stage.name, **resolved_inputs(stage.recipe, stage.ref))


@contextmanager
def no_empty_run_dir(path: Path) -> Iterator[None]:
    """A run that fails before writing anything (a model folder that is not there, a tokenizer its renderer cannot
    write for) leaves no run dir behind: one this run made that holds only its lock file and marker is removed. (One that is
    left anyway, say by kill -9, is reused silently by the next run: runner/engine/rundir.py.)"""
    existed = path.exists() or path.is_symlink()
    made = [p for p in [path, *path.parents] if not (p.exists() or p.is_symlink())]  # runs/ too, if it is new
    try:
        yield
    except BaseException:
        if not existed and path.is_dir() and not path.is_symlink() and {e.name for e in path.iterdir()} <= {LOCK, MARKER}:
            with suppress(OSError):  # best effort: what is left is an empty run dir, which a rerun reuses
                for name in (LOCK, MARKER):
                    (path / name).unlink(missing_ok=True)
                for folder in made:  # innermost first; stops at one that is not empty
                    folder.rmdir()
        raise


# A message that already names a recipe ('FILE#name: ...', a sweep point's 'FILE#name [lr=...]: ...').
_NAMED = re.compile(r"^\S+#[A-Za-z0-9_-]+[:\s\[]")


@contextmanager
def naming(where: str) -> Iterator[None]:
    """A UserError raised while recipe `where` ('FILE#name') runs names it, as `runner check`'s errors do."""
    try:
        yield
    except UserError as e:
        if not _NAMED.match(str(e)):
            e.args = (f"{where}: {e}", *e.args[1:])  # the same error (a subclass keeps what it carries)
        raise


def print_costs(recipe: Recipe, name: str, where: str, stages: list[Upstream]) -> None:
    """The dry run's tokens and cost of every stage still to run and of this recipe (runner/engine/estimate.py)."""
    from runner.engine.estimate import print_chain_estimate

    planned = [_planned(s.recipe, s.name, s.ref, s.label, _status(s) == "finished") for s in stages if s.runnable]
    print_chain_estimate([*planned, _planned(recipe, name, where, f"#{name}", False)])


def _planned(recipe: Recipe, name: str, where: str, label: str, finished: bool) -> Stage:
    """A stage as its dry run sees it: upstream weights planned, not yet resolved."""
    from runner.engine.estimate import Stage
    from runner.engine.rundir import open_run_dir
    from runner.engine.spec import make_algo

    chain = upstreams(recipe, where)
    init = InitWeights.planned(chain[-1]) if chain else None
    run_dir = open_run_dir(recipe, name, dry_run=True, init=init.record() if init is not None else None)
    weights = {d.ref: "" for d in dependencies(recipe, where)}
    return Stage(label, recipe, run_dir.start_step, finished, lambda tok: make_algo(recipe, init, weights)(tok),
                 run_dir.has_row)
