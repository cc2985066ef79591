"""The Tinker backend: the real `tinker` SDK behind our protocol (see backend.py).

`TinkerBackend` is imported lazily so that `runner check` / `runner list` and the recipe schema (which
imports `backends.tinker.tinker_config`) never import the SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.tinker.backend import TinkerBackend

__all__ = ["TinkerBackend"]


def __getattr__(name: str) -> type[TinkerBackend]:
    if name == "TinkerBackend":
        from backends.tinker.backend import TinkerBackend

        return TinkerBackend
    raise AttributeError(name)
