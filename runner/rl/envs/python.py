"""A user's own env, `algo.env = {kind = "python", target = "pkg.mod:fn", args = {...}}`: fn(**args) returns a dataset
builder, builder(ctx: EnvContext) -> (train: RLDataset, test: RLDataset | None) (runner/rl/envs/__init__.py has the
contract); every way it can go wrong is one line naming it."""

from __future__ import annotations

from backends.errors import UserError
from runner.recipe.targets import args_mismatch, import_target
from runner.rl.envs.common import EnvContext, EnvKind
from runner.rl.envs.python_config import PythonEnv
from runner.rl.rollouts import describe_error
from runner.rl.types import RLDataset


def user_datasets(cfg: PythonEnv, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
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
        if ds is None or not (hasattr(ds, "get_batch") and hasattr(ds, "__len__")):
            raise UserError(
                f"{where}: {name} dataset is {type(ds).__name__}, expected an RLDataset (get_batch, __len__)"
            )
        try:
            n = len(ds)  # user code: checked by hasattr above, and any failure is reported
        except Exception as e:  # noqa: BLE001 - user code
            raise UserError(f"{where}: len() of the {name} dataset failed: {describe_error(e)}") from None
        if n == 0 and name == "train":
            raise UserError(f"{where}: the train dataset has no batches")
        if n == 0:  # an empty test set is no test set: no evals (rather than logging reward 0 for zero episodes)
            test = None
    return train, test


ENV = EnvKind(user_datasets)
