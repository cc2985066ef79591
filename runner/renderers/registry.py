"""Renderers by name: `@register("name")` on a Renderer subclass (or a factory taking the tokenizer) adds one;
`get_renderer(name, tokenizer)` builds it; `names()` lists them (what `runner check` offers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from backends.errors import UserError
from runner.renderers.base import Renderer

Factory = Callable[[Any], Renderer]
_REGISTRY: dict[str, Factory] = {}
_T = TypeVar("_T")

# Names the recipe accepts besides the registered ones: resolved by pick_renderer (runner/renderers/auto.py).
AUTO = "auto"


def register(name: str) -> Callable[[_T], _T]:
    """Class decorator: `name` builds this Renderer subclass from a tokenizer."""

    def add(cls: _T) -> _T:
        add_renderer(name, cls)  # type: ignore[arg-type]
        return cls

    return add


def add_renderer(name: str, factory: Factory) -> None:
    """`name` builds `factory(tokenizer)` (a variant of a class with other arguments). Names are unique."""
    if name in _REGISTRY or name == AUTO:
        raise ValueError(f"renderer {name!r} is registered twice")
    _REGISTRY[name] = factory


def names() -> list[str]:
    """Every renderer name: "auto", "hf", then the rest alphabetically."""
    _load_builtins()
    return [AUTO, *sorted(_REGISTRY, key=lambda n: (n != "hf", n))]


def get_renderer(name: str, tokenizer: Any, model_name: str | None = None) -> Renderer:
    """The renderer `name` over `tokenizer`; "auto" picks one for `model_name` (see pick_renderer)."""
    _load_builtins()
    if name == AUTO:
        from runner.renderers.auto import pick_renderer

        name = pick_renderer(model_name or getattr(tokenizer, "name_or_path", "") or "", tokenizer)
    factory = _REGISTRY.get(name)
    if factory is None:
        raise UserError(f"unknown renderer {name!r}; choose one of: {', '.join(names())}")
    try:
        renderer = factory(tokenizer)
    except UserError as e:
        raise UserError(f"renderer {name!r}: {e}") from None
    renderer.name = name
    return renderer


def _load_builtins() -> None:
    # Importing the package registers every built-in renderer module.
    import runner.renderers  # noqa: F401
