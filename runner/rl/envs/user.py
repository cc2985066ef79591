"""Loading user code named as "pkg.mod:fn" (python envs, preference judges)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from runner.errors import UserError


def load_target(target: str, what: str) -> Callable[..., Any]:
    """The callable at "pkg.mod:fn"; a UserError naming `what` and the target if it can't be imported."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise UserError(f"{what} target {target!r}: expected 'pkg.mod:fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"{what} target {target!r}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise UserError(f"{what} target {target!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise UserError(f"{what} target {target!r}: {attr!r} is not callable")
    return fn
