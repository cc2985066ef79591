"""The algorithm interface: what an algorithm module declares (`AlgoSpec`) and how a recipe's `algo` finds it.

An algorithm is two files in runner/algos/: NAME_config.py, its recipe struct (a variant of the schema's `Algo`
union, found by its file name), and NAME.py beside it, which declares `SPEC = AlgoSpec(...)`: how to build it from a
recipe, its headline metrics (the progress line, `runner compare`'s default columns), how `runner render` shows its
data. The loop, progress, compare, render and `runner eval` read the spec; nothing lists algorithms, and the engine
imports no algorithm's code by name (it imports the module beside the recipe struct's, as it imports a user's). A
user's own algorithm needs no edit here at all:
`algo = {kind = "python", target = "pkg.mod:SPEC", args = {...}}` names an `AlgoSpec` in their module, and its
`config` struct (if any) validates `args` at `runner check` (examples/custom_algo.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.errors import UserError
from runner.algos.python_config import PythonAlgo
from runner.engine.context import Algorithm, InitWeights
from runner.recipe.common import AlgoBase, Json
from runner.recipe.schema import ALGO_VARIANTS, Recipe
from runner.recipe.targets import declared
from runner.renderers import Renderer, get_renderer
from runner.renderers.base import Tokenizer


@dataclass(frozen=True)
class BuildArgs:
    """What building an algorithm may use besides its own config."""

    recipe: Recipe
    # A chained recipe's starting weights (its reference model), else None.
    init: InitWeights | None = None
    # The final sampler weights of every other run the recipe names (teachers, judges), by reference.
    weights: Mapping[str, str] = field(default_factory=dict)

    @property
    def reference_path(self) -> str | None:
        return self.init.sampler_path if self.init is not None else None


@dataclass(frozen=True)
class Settings:
    """What every algorithm is built from besides its own config and data, resolved once from the recipe: the model
    name, the tokenizer, the renderer ("auto" picked for the model, runner/renderers/auto.py), the seed and step cap,
    the reference weights and the other runs' weights. Built-in algorithms take one (`Settings.of`)."""

    model: str
    tokenizer: Tokenizer
    renderer: Renderer
    seed: int = 0
    max_steps: int | None = None
    # The reference model's weights (DPO, the RL KL penalty): a chained recipe's starting weights, else None (the
    # base model).
    reference_path: str | None = None
    # The final sampler weights of every other run the recipe names (teachers, judges), by reference.
    weights: Mapping[str, str] = field(default_factory=dict)

    @staticmethod
    def of(args: BuildArgs, tokenizer: Tokenizer) -> Settings:
        """A recipe's settings over the tokenizer the loop loaded."""
        r = args.recipe
        return Settings.make(tokenizer, model=r.model, renderer=r.renderer, seed=r.seed, max_steps=r.max_steps,
                             reference_path=args.reference_path, weights=args.weights)

    @staticmethod
    def make(tokenizer: Tokenizer, *, model: str = "tiny", renderer: str = "auto", seed: int = 0,
             max_steps: int | None = None, reference_path: str | None = None,
             weights: Mapping[str, str] | None = None) -> Settings:
        """Settings from names (the renderer by its recipe name), as a test or a bench builds an algorithm."""
        return Settings(model, tokenizer, get_renderer(renderer, tokenizer, model_name=model), seed, max_steps,
                        reference_path, dict(weights or {}))


# (config, args) -> a function of the tokenizer that returns the algorithm. Building reads and validates the data,
# so the cheapest errors come before any model loads.
Builder = Callable[[Any, BuildArgs], Callable[[Tokenizer], Algorithm]]
# `runner render` (runner/tools/render.py): (config, recipe, renderer, n) -> the first `n` rows of the algorithm's data
# as the trainer sees them: {"where", "tokens", "weights"} (+ "side": which side of a comparison).
Shower = Callable[[Any, Recipe, Renderer, int], Iterable[Json]]


@dataclass(frozen=True)
class AlgoSpec:
    build: Builder
    # The progress line's metrics: (metrics key, label), the training number first, held-out ones after.
    headline: Sequence[tuple[str, str]] = (("loss", "loss"),)
    # `runner compare`'s default metrics; default: the headline's keys, held-out ones first.
    compare: Sequence[str] | None = None
    # Extra headline metrics that depend on the config (RL: its env's), inserted after the first.
    headline_for: Callable[[Any], Sequence[tuple[str, str]]] | None = None
    # A user algorithm's `args` struct (algo.kind = "python"): validated by `runner check`, handed to `build`.
    config: type | None = None
    # How `runner render` shows the data; None: it has none to show.
    show: Shower | None = None

    def progress_keys(self, cfg: AlgoBase) -> list[tuple[str, str]]:
        keys = list(self.headline)
        if self.headline_for is not None:
            keys[1:1] = list(self.headline_for(cfg))
        return keys

    def compare_keys(self) -> list[str]:
        if self.compare is not None:
            return list(self.compare)
        return sorted((k for k, _ in self.headline), key=lambda k: not k.startswith("test/"))


def spec_of(cfg: AlgoBase) -> AlgoSpec:
    """The spec of a recipe's `algo` table."""
    if isinstance(cfg, PythonAlgo):
        return _custom_spec(cfg.target)
    return declared(type(cfg), "SPEC", AlgoSpec)


def spec_of_kind(kind: str, target: str | None = None) -> AlgoSpec | None:
    """The spec of an algorithm by its `kind` tag (a run dir's flattened config); None when unknown or not
    importable (a run written by another version, a custom algorithm whose module is gone)."""
    try:
        if kind in ("python", "custom"):  # "custom": a run dir written before the one spelling of user code
            return _custom_spec(target) if target else None
        for variant in ALGO_VARIANTS:
            if variant.__struct_config__.tag == kind:
                return declared(variant, "SPEC", AlgoSpec)
    except UserError:
        return None
    return None


def make_algo(recipe: Recipe, init: InitWeights | None = None,
              weights: Mapping[str, str] | None = None) -> Callable[[Tokenizer], Algorithm]:
    """The one place a recipe's algo variant becomes an Algorithm (a function of the tokenizer)."""
    return spec_of(recipe.algo).build(recipe.algo, BuildArgs(recipe, init, dict(weights or {})))


def check_algo(cfg: AlgoBase, where: str) -> None:
    """`runner check`: a user's algorithm's target is an AlgoSpec and its args fit the spec's config."""
    if not isinstance(cfg, PythonAlgo):
        return
    spec = _custom_spec(cfg.target, where)
    custom_args(spec, cfg, where)


def custom_args(spec: AlgoSpec, cfg: PythonAlgo, where: str = "") -> Any:  # the caller knows its config type
    """A user's algorithm's `args`, decoded into its spec's config struct (as given when it has none)."""
    if spec.config is None:
        return cfg.args
    from runner.recipe.explain import convert

    return convert(cfg.args, spec.config, f"{where + ': ' if where else ''}algo.args")


def _custom_spec(target: str, where: str = "") -> AlgoSpec:
    from runner.recipe.targets import import_object

    try:
        obj = import_object(target)
    except UserError as e:
        raise UserError(f"{where + ': ' if where else ''}algo.target: {e}") from None
    if not isinstance(obj, AlgoSpec):
        raise UserError(f"{where + ': ' if where else ''}algo.target {target!r} is a {type(obj).__name__}, not an "
                        "AlgoSpec (declare `SPEC = AlgoSpec(build=...)` in your module; see examples/custom_algo.py)")
    return obj


__all__ = ["AlgoSpec", "BuildArgs", "Settings", "check_algo", "custom_args", "make_algo", "spec_of", "spec_of_kind"]
