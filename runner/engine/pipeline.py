"""Running a recipe with what it needs first: the unfinished runs of its init_from chain and the runs it samples
from (teachers, judges), each resumed or skipped when finished, then the recipe itself (runner/engine/chain.py
walks the references; runner/engine/loop.py trains one run)."""

from __future__ import annotations

import sys

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
        run(recipe, name, dry_run=True, init=init, weights={d.ref: "" for d in deps})
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
