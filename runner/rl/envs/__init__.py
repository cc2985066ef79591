"""Environment datasets: `build_datasets(cfg, ctx)` is the one place an env config becomes objects.

An env is two files here: NAME_config.py, its recipe struct (a subclass of EnvBase, found by the schema's `Env` union:
backends/configs.py `found`), and NAME.py, which declares `ENV = EnvKind(build, headline)`
(runner/rl/envs/common.py). Nothing lists envs: `kind_of` imports the module beside the struct's. User environments
come through `{kind = "python", target = "pkg.mod:fn", args = {...}}` (runner/rl/envs/python.py). The contract:

    def fn(**args) -> builder                      # called once, with the recipe's args
    def builder(ctx: EnvContext) -> (train, test)  # train: RLDataset; test: RLDataset or None

`ctx` carries the renderer (tokenizer + chat template + stop tokens), group_size, test_group_size,
groups_per_batch and the recipe seed. Datasets hand out `EnvGroupBuilder`s (runner/rl/types.py);
`envs.common` has `ChatEnv`, `RepeatGroupBuilder`, `ListDataset` and `group_datasets` to build them from.
"""

from __future__ import annotations

from collections.abc import Iterable

from backends.errors import UserError
from runner.recipe.envs import Env
from runner.recipe.targets import declared
from runner.rl.envs.common import EnvContext, EnvKind
from runner.rl.rollouts import describe_error
from runner.rl.types import EnvGroupBuilder, RLDataset

__all__ = ["EnvContext", "EnvKind", "build_datasets", "get_batch", "headline_of", "kind_of"]


def kind_of(cfg: Env) -> EnvKind:
    """The `ENV` declared by the module beside an env config's (runner/rl/envs/math_config.py -> math.py)."""
    return declared(type(cfg), "ENV", EnvKind)


def build_datasets(cfg: Env, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    return kind_of(cfg).build(cfg, ctx)


def headline_of(cfg: Env) -> list[tuple[str, str]]:
    return list(kind_of(cfg).headline)


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
