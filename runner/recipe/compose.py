"""Recipe reuse: `extends` and a file's `[defaults]` table, merged into one raw recipe table before decoding.

    [defaults]                      # every recipe in this file starts from it
    backend = { kind = "tinker" }

    [recipes.base]
    model = "Qwen/Qwen3-8B"
    [recipes.variant]
    extends = "base"                # or "other.toml#base"; chains allowed, a cycle is an error naming it
    lr = 3e-4

Precedence, lowest first: the schema's defaults, the file's `[defaults]`, the extends chain (the base resolved in its
own file, its own `[defaults]` included), the recipe's own table, CLI overrides. Merging is deep: a table merges key
by key, anything else (a number, a string, a list) replaces; a table whose `kind` differs from the one below replaces
it whole (`backend = {kind = "local"}` over a tinker backend does not keep the tinker keys). A base's `sweep` table
is not inherited (a variant of a sweep is not itself a sweep unless it says so). docs/recipes.md has the rules.

`layers(path, name)` is what --explain reads: each table that went into the recipe with a label saying where it
came from; `merge_layers` merges them and keeps, for each key path, the label of the layer that set it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.errors import UserError

EXTENDS = "extends"
DEFAULTS = "defaults"
SWEEP = "sweep"
TAG = "kind"

KeyPath = tuple[str, ...]
# Reads and parses another recipe file (`extends = "other.toml#base"`): runner/recipe/load.py's read_data.
Reader = Callable[[str], dict[str, Any]]


@dataclass(frozen=True)
class Layer:
    label: str  # "[defaults] of FILE", "FILE#base (extends)", "FILE#name", "override lr=1e-4"
    table: dict[str, Any]


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base` (neither changed): tables merge, anything else replaces (see the module doc)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(value, dict) and isinstance(below, dict) and not _switches(below, value):
            out[key] = deep_merge(below, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _switches(below: dict[str, Any], value: dict[str, Any]) -> bool:
    """A table naming another variant (`kind`) than the one below replaces it instead of merging into it."""
    return TAG in below and TAG in value and below[TAG] != value[TAG]


def merge_layers(layers: list[Layer]) -> tuple[dict[str, Any], dict[KeyPath, str]]:
    """(merged table, {key path: label of the layer that set it}) of `layers`, lowest first."""
    table: dict[str, Any] = {}
    origins: dict[KeyPath, str] = {}
    for layer in layers:
        _note(table, layer.table, (), layer.label, origins)
        table = deep_merge(table, layer.table)
    return table, origins


def _note(below: Any, over: dict[str, Any], at: KeyPath, label: str, origins: dict[KeyPath, str]) -> None:
    for key, value in over.items():
        path = (*at, key)
        under = below.get(key) if isinstance(below, dict) else None
        if isinstance(value, dict) and isinstance(under, dict) and not _switches(under, value):
            _note(under, value, path, label, origins)
            continue
        for p in [p for p in origins if p[: len(path)] == path]:  # a replaced table: what was under it is gone
            del origins[p]
        if isinstance(value, dict) and value:  # a new table: its own keys are set here, the rest are defaults
            _note({}, value, path, label, origins)
        else:
            origins[path] = label


def origin(origins: dict[KeyPath, str], path: KeyPath) -> str | None:
    """The label that set `path` (or a table or list holding it), None for a schema default."""
    for n in range(len(path), 0, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return None


def resolve_tables(path: str, data: dict[str, Any], read: Reader) -> dict[str, dict[str, Any]]:
    """Every recipe of a parsed file with its extends chain and the file's [defaults] merged in.
    `read(path) -> parsed file` reads another file (`extends = "other.toml#base"`)."""
    return {name: merge_layers(layers(path, name, data, read))[0] for name in data["recipes"]}


def layers(path: str, name: str, data: dict[str, Any], read: Reader,
           stack: tuple[tuple[str, str], ...] = ()) -> list[Layer]:
    """The tables that make recipe `name` of parsed file `data` (at `path`), lowest first (module doc).
    `stack` holds the (label, resolved key) of the recipes that extend this one, to name a cycle."""
    where = f"{path}#{name}"
    stack = (*stack, (where, f"{Path(path).resolve()}#{name}"))
    own = data["recipes"][name]
    out: list[Layer] = []
    defaults = data.get(DEFAULTS)
    if defaults:
        out.append(Layer(f"[defaults] of {path}", defaults))
    base = own.get(EXTENDS)
    if base is not None:
        if not isinstance(base, str) or not base:
            raise UserError(f"{where}: extends: expected a recipe name or 'FILE#name', got {base!r}")
        base_path, _, base_name = base.rpartition("#")
        if base_path:
            base_path = base_path if Path(base_path).is_absolute() else str(Path(path).parent / base_path)
            if not Path(base_path).is_file():
                raise UserError(f"{where}: extends {base!r}: file not found: {base_path}")
            base_data = read(base_path)
        else:
            base_path, base_data = path, data
        base_key = f"{Path(base_path).resolve()}#{base_name}"
        keys = [k for _, k in stack]
        if base_key in keys:
            cycle = " -> ".join([*(label for label, _ in stack[keys.index(base_key):]), f"{base_path}#{base_name}"])
            raise UserError(f"{stack[0][0]}: extends makes a cycle: {cycle}")
        if base_name not in base_data["recipes"]:
            raise UserError(f"{where}: extends {base!r}: no recipe named {base_name!r} in {base_path}; "
                            f"available: {', '.join(sorted(base_data['recipes']))}")
        for layer in layers(base_path, base_name, base_data, read, stack):
            if layer.label == f"{base_path}#{base_name}":  # the base's own table: its sweep stays with it
                layer = Layer(f"{layer.label} (extends)", {k: v for k, v in layer.table.items() if k != SWEEP})
            if layer not in out:
                out.append(layer)
    out.append(Layer(where, {k: v for k, v in own.items() if k != EXTENDS}))
    return out
