"""User code named in a recipe as "pkg.mod:fn": the one importer of it (data sources, envs, judges)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from backends.configs import implementation_of
from backends.errors import UserError, one_line
from runner.user_code import import_user_module

if TYPE_CHECKING:
    from backends.types import Json

K = TypeVar("K")


def declared(config: type, name: str, kind: type[K]) -> K:
    """What a built-in extension's implementation declares, `name = kind(...)` (ENV, EVAL, SPEC): the module beside
    its config struct's (runner/rl/envs/math_config.py -> runner/rl/envs/math.py; docs/extending.md)."""
    module = implementation_of(config)
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, kind):
        raise TypeError(f"{config.__name__}: its implementation {module} declares no {name} = {kind.__name__}(...)")
    return found


def import_target(target: str) -> Callable[..., object]:
    """The callable named by 'pkg.mod:fn'; UserError if it does not import or is not callable."""
    fn = import_object(target)
    if not callable(fn):
        raise UserError(f"{target!r} is {type(fn).__name__}, not a callable")
    return fn


def import_object(target: str) -> object:
    """Whatever 'pkg.mod:name' names (an AlgoSpec, a loss spec: the caller checks which); UserError if it does not
    import."""
    module, _, attr = target.partition(":")
    mod = import_user_module(module, f"cannot import {target!r}")
    try:
        return getattr(mod, attr)
    except Exception as e:  # noqa: BLE001 - a missing name, or a module __getattr__ of the user's raising
        raise UserError(f"cannot import {target!r}: {one_line(e)}") from None


def args_mismatch(fn: Callable[..., object], args: Json, leading: int = 0,
                  keywords: tuple[str, ...] = ()) -> str | None:
    """Why fn(**args) cannot bind (a missing or unexpected argument), or None when it can or fn has no signature.
    `leading`: positional arguments runner passes before the args (a pinned eval's sampler and tokenizer);
    `keywords`: keyword arguments runner passes with them (a python backend's model, tokenizer, storage_dir, seed)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none: the call will tell
        return None
    try:
        sig.bind(*([None] * leading), **dict.fromkeys(keywords), **args)
    except TypeError as e:
        return str(e)
    return None
