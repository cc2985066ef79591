"""A user's own algorithm: `algo = {kind = "python", target = "pkg.mod:SPEC", args = {...}}` names an AlgoSpec
(runner/engine/spec.py) in their module; `args` is validated by the spec's `config` struct (examples/custom_algo.py).
The engine finds the spec by the target (runner/engine/spec.py `spec_of`), as it finds a built-in's by its module."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from runner.recipe.common import AlgoBase

# "pkg.mod:SPEC": an AlgoSpec, not a callable, so not a `Target` (which `runner check` calls with the args);
# runner/engine/spec.py `check_algo` imports it and checks the args against its config.
SpecRef = Annotated[str, Meta(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w]*$", description="'pkg.mod:SPEC'")]


class PythonAlgo(AlgoBase, tag="python"):
    """A user-defined algorithm: `target = "pkg.mod:SPEC"` names an AlgoSpec; `args` is validated by its config struct
    (`runner check`)."""

    target: SpecRef
    args: dict[str, Any] = {}


class Custom(AlgoBase):
    """The old spelling of a user's algorithm, refused with the new one (docs/extending.md)."""

    spec: str = ""
    target: str = ""
    args: dict[str, Any] = {}

    def __post_init__(self) -> None:
        raise ValueError(f'kind "custom" is now spelled {{kind = "python", target = "{self.spec or self.target or "pkg.mod:SPEC"}", '
                         'args = {...}}')
