"""Environment datasets: `build_datasets(cfg, ctx)` is the one place an env config becomes objects.

A built-in env is its struct in runner/recipe/envs.py, whose `implementation` names its module here; the module
declares `ENV = EnvKind(build, headline)` (runner/rl/envs/common.py). Nothing lists envs: `kind_of` imports the
module the struct names. User environments come through `{kind = "python", target = "pkg.mod:fn", args = {...}}`.
The contract:

    def fn(**args) -> builder                      # called once, with the recipe's args
    def builder(ctx: EnvContext) -> (train, test)  # train: RLDataset; test: RLDataset or None

`ctx` carries the renderer (tokenizer + chat template + stop tokens), group_size, test_group_size,
groups_per_batch and the recipe seed. Datasets hand out `EnvGroupBuilder`s (runner/rl/types.py);
`envs.common` has `ChatEnv`, `RepeatGroupBuilder`, `ListDataset` and `group_datasets` to build them from.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from backends.errors import UserError
from runner.recipe.schema import Env, PythonEnv
from runner.recipe.targets import args_mismatch, declared, import_target
from runner.rl.envs.common import EnvContext, EnvKind
from runner.rl.rollouts import describe_error
from runner.rl.types import EnvGroupBuilder, RLDataset

__all__ = ["EnvContext", "EnvKind", "build_datasets", "get_batch", "headline_of", "kind_of"]


def kind_of(cfg: Env) -> EnvKind:
    """The `ENV` its module declares, for a built-in env's config (its struct's `implementation`)."""
    return declared(type(cfg).implementation, "ENV", EnvKind, f"env config {type(cfg).__name__}")


def build_datasets(cfg: Env, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    if isinstance(cfg, PythonEnv):
        return _user_datasets(cfg, ctx)
    return kind_of(cfg).build(cfg, ctx)


def headline_of(cfg: Env) -> list[tuple[str, str]]:
    return [] if isinstance(cfg, PythonEnv) else list(kind_of(cfg).headline)


def _user_datasets(cfg: PythonEnv, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    where = f"env target {cfg.target!r}"
    fn = import_target(cfg.target)
    problem = args_mismatch(fn, cfg.args)
    if problem:  # wrong args from the recipe
        raise UserError(f"{where}: calling it with args {sorted(cfg.args)} failed: {problem}")
    try:
        builder = fn(**cfg.args)
    except Exception as e:  # noqa: BLE001 - user code: one line naming it, not a traceback
        raise UserError(f"{where}: calling it with args {sorted(cfg.args)} raised {describe_error(e)}") from None
    if not callable(builder):
        raise UserError(
            f"{where} returned {type(builder).__name__}, expected a dataset builder: a callable ctx -> (train, test)"
        )
    try:
        out = builder(ctx)
    except Exception as e:  # noqa: BLE001 - as above
        raise UserError(f"{where}: its dataset builder raised {describe_error(e)}") from None
    if not (isinstance(out, tuple) and len(out) == 2):
        raise UserError(f"{where}: the dataset builder returned {type(out).__name__}, expected a (train, test) pair")
    train, test = out
    for name, ds in (("train", train), ("test", test)):
        if ds is None and name == "test":
            continue
        if not (hasattr(ds, "get_batch") and hasattr(ds, "__len__")):
            raise UserError(
                f"{where}: {name} dataset is {type(ds).__name__}, expected an RLDataset (get_batch, __len__)"
            )
        try:
            n = len(cast(Any, ds))  # user code: checked by hasattr above, and any failure is reported
        except Exception as e:  # noqa: BLE001 - user code
            raise UserError(f"{where}: len() of the {name} dataset failed: {describe_error(e)}") from None
        if n == 0 and name == "train":
            raise UserError(f"{where}: the train dataset has no batches")
        if n == 0:  # an empty test set is no test set: no evals (rather than logging reward 0 for zero episodes)
            test = None
    return train, test


def get_batch(ds: RLDataset, index: int, split: str) -> list[EnvGroupBuilder]:
    """ds.get_batch(index), checked: a non-empty list of EnvGroupBuilders, or one line saying what the dataset did
    (user datasets come from `python` envs)."""
    where = f"the {split} dataset's {type(ds).__name__}.get_batch({index})"
    try:
        out = ds.get_batch(index)
    except Exception as e:  # noqa: BLE001 - user code: one line, not a traceback
        raise UserError(f"{where} raised {describe_error(e)}") from None
    if isinstance(out, (str, bytes, dict)) or not isinstance(out, Iterable):
        raise UserError(f"{where} returned {type(out).__name__}, expected a list of EnvGroupBuilders")
    builders = list(out)
    if not builders:
        raise UserError(f"{where} returned no group builders")
    for b in builders:
        if not (isinstance(b, EnvGroupBuilder) or callable(getattr(b, "make_envs", None))):
            raise UserError(f"{where} returned a {type(b).__name__} in its list, expected EnvGroupBuilders")
    return builders
