"""The local backend: an in-process torch + peft LoRA trainer and sampler (see backend.py).

`LocalBackend` is imported lazily so that `runner check` / `runner list` never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]


def __getattr__(name: str) -> type[LocalBackend]:
    if name == "LocalBackend":
        from backends.local.backend import LocalBackend

        return LocalBackend
    raise AttributeError(name)
