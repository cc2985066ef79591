"""Running a recipe with what it needs first: the unfinished runs of its init_from chain and the runs it samples
from (teachers, judges), each resumed or skipped when finished, then the recipe itself (runner/engine/chain.py
walks the references; runner/engine/loop.py trains one run)."""

from __future__ import annotations

import sys
from typing import Any

from backends.errors import UserError
from runner.engine.chain import Upstream, _status, dependencies, resolved_inputs, upstreams
from runner.engine.context import InitWeights
from runner.recipe.schema import Recipe


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
    run(recipe, name, force=force, **resolved_inputs(recipe, where))


def run_stage(stage: Upstream) -> None:
    """One upstream run, itself after its own init_from chain (already run: dependencies come in order)."""
    from runner.engine.loop import run

    run(stage.recipe, stage.name, **resolved_inputs(stage.recipe, stage.ref))


def print_costs(recipe: Recipe, name: str, where: str, stages: list[Upstream]) -> None:
    """The dry run's tokens and cost of every stage still to run and of this recipe (runner/engine/estimate.py)."""
    from runner.engine.estimate import print_chain_estimate

    planned = [_planned(s.recipe, s.name, s.ref, s.label, _status(s) == "finished") for s in stages if s.runnable]
    print_chain_estimate([*planned, _planned(recipe, name, where, f"#{name}", False)])


def _planned(recipe: Recipe, name: str, where: str, label: str, finished: bool) -> Any:
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
