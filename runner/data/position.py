"""The resume guard: a checkpoint stores where an algorithm was in its data (`Algorithm.state`), which means
nothing once the data it indexes has changed size. Every built-in algorithm checks it with `check_resume`."""

from __future__ import annotations

from backends.errors import UserError
from runner.recipe.common import Json


def check_resume(state: Json, key: str, now: int, what: str, unit: str = "") -> None:
    """UserError when the checkpoint's `state[key]` (the size of `what` when it was saved) is not `now`."""
    if state.get(key) != now:
        raise UserError(f"{what} changed since the checkpoint ({state.get(key)} -> {now}{unit}), so its data "
                        "position means nothing; use if_exists = \"overwrite\"")
