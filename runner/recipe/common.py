"""The recipe's basic types (shared by runner/recipe/schema.py and its parts): number limits, `pkg.mod:fn` targets,
recipe references, the struct base, the data sources a table may name, and TrainOnWhat."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from msgspec import Meta

from backends.backend_config import ConfigStruct
from runner.recipe.sources import HF, DataBase, File, Jsonl

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Frac = Annotated[float, Meta(ge=0, le=1)]
# User code, "pkg.mod:fn". `runner check` imports every field of this type, wherever it appears.
TARGET_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
Target = Annotated[str, Meta(pattern=TARGET_PATTERN, description="'pkg.mod:fn'")]
# Another recipe's run, whose final weights a field uses: "FILE#name", "#name" (this file) or a run dir.
# runner/engine/chain.py finds every field of this type, runs the unfinished ones first and resolves them.
REF_DESCRIPTION = "'FILE#name', '#name' or a run dir"
RecipeRef = Annotated[str, Meta(min_length=1, description=REF_DESCRIPTION)]


class Base(ConfigStruct):  # pyright: ignore[reportGeneralTypeIssues] (see ConfigStruct)
    pass


B = TypeVar("B", bound=type)


def variants(base: B) -> tuple[B, ...]:
    """The subclasses of a tagged struct base, in the order they are declared: the schema's union of them (msgspec
    decodes `kind = ...` into the one with that tag). A variant declares itself once, by subclassing the base
    (algorithms, envs); nothing lists them. A subclass that declares `ABSTRACT = True` (a shared base of several
    variants) is not one: its own subclasses are, in its place."""
    out: list[B] = []
    for sub in base.__subclasses__():
        out.extend(variants(sub) if sub.__dict__.get("ABSTRACT", False) else [sub])
    return tuple(out)


# ---------------------------------------------------------------- data sources

# DataBase and the file/hub sources (jsonl, file, hf: format, fields, streaming) are in runner/recipe/sources.py.


class Python(DataBase):
    """User code: `target = "pkg.mod:fn"`, called as fn(**args); imported and checked by `runner check`."""

    target: Target
    args: dict[str, Any] = {}


class RunOutput(DataBase, tag="run_output"):
    """The rows another run wrote (a `generate` recipe's conversations): run first by `runner run`."""

    run: RecipeRef


DataSource = Jsonl | File | HF | Python | RunOutput


# Which tokens of a conversation carry loss: the cookbook's TrainOnWhat (runner/renderers/base.py, docs/renderers.md).
TrainOnWhat = Literal["last_assistant_message", "last_assistant_turn", "all_assistant_messages", "all_messages",
                      "all_tokens", "all_user_and_system_messages", "customized"]
