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

from backends.errors import UserError
from runner.recipe.common import Json

EXTENDS = "extends"
DEFAULTS = "defaults"
SWEEP = "sweep"
# The longest extends chain a recipe may have (itself and its bases): a bound, not a style rule.
MAX_EXTENDS = 1000
TAG = "kind"

KeyPath = tuple[str, ...]
# Reads and parses another recipe file (`extends = "other.toml#base"`): runner/recipe/load.py's read_data.
Reader = Callable[[str], Json]


@dataclass(frozen=True)
class Layer:
    label: str  # "[defaults] of FILE", "FILE#base (extends)", "FILE#name", "override lr=1e-4"
    table: Json


def deep_merge(base: Json, over: Json) -> Json:
    """`over` on top of `base` (neither changed): tables merge, anything else replaces (see the module doc)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        below = out.get(key)
        if isinstance(value, dict) and isinstance(below, dict) and not _switches(below, value):
            out[key] = deep_merge(below, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _switches(below: Json, value: Json) -> bool:
    """A table naming another variant (`kind`) than the one below replaces it instead of merging into it."""
    return TAG in below and TAG in value and below[TAG] != value[TAG]


def merge_layers(layers: list[Layer]) -> tuple[Json, dict[KeyPath, str]]:
    """(merged table, {key path: label of the layer that set it}) of `layers`, lowest first."""
    table: Json = {}
    origins: dict[KeyPath, str] = {}
    for layer in layers:
        _note(table, layer.table, (), layer.label, origins)
        table = deep_merge(table, layer.table)
    return table, origins


def _note(below: object, over: Json, at: KeyPath, label: str, origins: dict[KeyPath, str]) -> None:
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


def resolve_tables(path: str, data: Json, read: Reader) -> dict[str, Json]:
    """Every recipe of a parsed file with its extends chain and the file's [defaults] merged in.
    `read(path) -> parsed file` reads another file (`extends = "other.toml#base"`)."""
    return {name: merged(path, name, data, read) for name in data["recipes"]}


def layers(path: str, name: str, data: Json, read: Reader) -> list[Layer]:
    """The tables that make recipe `name` of parsed file `data` (at `path`), lowest first (module doc): the
    [defaults] of each file on the chain (this file's lowest, each once), then the bases' own tables from the root
    up (each labelled `(extends)`, its sweep left out), then the recipe's own table."""
    links = _chain(path, name, data, read)
    out: list[Layer] = []
    seen: set[str] = set()
    for link in links:
        defaults = link.data.get(DEFAULTS)
        label = f"[defaults] of {shown(link.path)}"
        if defaults and label not in seen:
            seen.add(label)
            out.append(Layer(label, defaults))
    for i in range(len(links) - 1, -1, -1):
        link = links[i]
        own = {k: v for k, v in link.data["recipes"][link.name].items() if k != EXTENDS}
        where = f"{shown(link.path)}#{link.name}"
        if i:  # a base's own table: its sweep stays with it
            out.append(Layer(f"{where} (extends)", {k: v for k, v in own.items() if k != SWEEP}))
        else:
            out.append(Layer(where, own))
    return out


def shown(path: str) -> str:
    """A file as --explain names it: relative to the working directory when under it, else absolute, `..` and links
    resolved either way (a base two folders up read 'lib/../../x.toml')."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)


@dataclass(frozen=True)
class _Link:
    """One recipe of an extends chain: where it is written and its file's parsed data."""

    path: str
    name: str
    data: Json
    key: str  # 'FILE#name', FILE resolved

    @property
    def where(self) -> str:
        return f"{self.path}#{self.name}"


def _chain(path: str, name: str, data: Json, read: Reader,
           known: Callable[[str], bool] | None = None) -> list[_Link]:
    """Recipe `name` of `path` and the bases it extends, itself first, the root base last: walked in a loop (a chain
    is as long as the user makes it, the stack is not); a cycle, a missing base or a chain of more than MAX_EXTENDS
    recipes is one line. `known(key)`: stop at the first base it accepts (merged() has that one already)."""
    resolved: dict[str, str] = {}

    def key_of(p: str, n: str) -> str:
        if p not in resolved:
            resolved[p] = str(Path(p).resolve())
        return f"{resolved[p]}#{n}"

    links = [_Link(path, name, data, key_of(path, name))]
    index = {links[0].key: 0}  # resolved 'FILE#name' -> its position, to name a cycle
    while True:
        link = links[-1]
        base = link.data["recipes"][link.name].get(EXTENDS)
        if base is None or (len(links) > 1 and known is not None and known(link.key)):
            return links
        where = link.where
        if not isinstance(base, str) or not base:
            raise UserError(f"{where}: extends: expected a recipe name or 'FILE#name', got {base!r}")
        base_path, _, base_name = base.rpartition("#")
        if base_path:
            base_path = base_path if Path(base_path).is_absolute() else str(Path(link.path).parent / base_path)
            if not Path(base_path).is_file():
                raise UserError(f"{where}: extends {base!r}: file not found: {base_path}")
            base_data = read(base_path)
        else:
            base_path, base_data = link.path, link.data
        key = key_of(base_path, base_name)
        if key in index:
            cycle = " -> ".join([*(x.where for x in links[index[key]:]), f"{base_path}#{base_name}"])
            raise UserError(f"{links[0].where}: extends makes a cycle: {cycle}")
        if base_name not in base_data["recipes"]:
            raise UserError(f"{where}: extends {base!r}: no recipe named {base_name!r} in {base_path}; "
                            f"available: {', '.join(sorted(base_data['recipes']))}")
        if len(links) >= MAX_EXTENDS:
            raise UserError(f"{links[0].where}: extends chain longer than {MAX_EXTENDS} recipes (at {where}); "
                            "make it shorter: let several recipes extend one base instead of each the one before")
        index[key] = len(links)
        links.append(_Link(base_path, base_name, base_data, key))


@dataclass(frozen=True)
class _Merged:
    table: Json  # the recipe's merged table (never handed out: merged() returns copies)
    defaults: tuple[str, ...]  # the labels of the [defaults] tables under it, lowest first
    files: tuple[tuple[str, Json], ...]  # (path, parsed data) of every file on its chain: still current?
    depth: int  # recipes on its chain, itself included


# Merged tables by resolved 'FILE#name': `runner check` of a file resolves each recipe once, a base extended by
# many recipes once (a chain of N recipes is N merges, not N^2). An entry holds while every file on its chain reads
# back as the same parsed object (runner/recipe/load.py's read_data keeps one per unchanged file).
_MERGED: dict[str, _Merged] = {}


def merged(path: str, name: str, data: Json, read: Reader) -> Json:
    """merge_layers(layers(...))[0], remembered per recipe: a recipe whose base is known merges its own table over
    the base's (linear in the chain's length for a whole file). Returns a copy the caller may change."""
    def current(key: str) -> bool:
        entry = _MERGED.get(key)
        return entry is not None and all((data if p == path else read(p)) is d for p, d in entry.files)

    links = _chain(path, name, data, read, known=current)
    if current(links[0].key):
        return copy.deepcopy(_MERGED[links[0].key].table)
    below = _MERGED.get(links[-1].key) if len(links) > 1 and current(links[-1].key) else None
    todo = links[:-1] if below is not None else links
    if below is not None and below.depth + len(todo) > MAX_EXTENDS:
        raise UserError(f"{links[0].where}: extends chain longer than {MAX_EXTENDS} recipes; make it shorter: let "
                        "several recipes extend one base instead of each the one before")
    for link in reversed(todo):
        own = {k: v for k, v in link.data["recipes"][link.name].items() if k != EXTENDS}
        defaults = link.data.get(DEFAULTS)
        label = f"[defaults] of {link.path}"
        if below is None:
            table = deep_merge(defaults, own) if defaults else copy.deepcopy(own)
            labels: tuple[str, ...] = (label,) if defaults else ()
            files: tuple[tuple[str, Json], ...] = ((link.path, link.data),)
            depth = 1
        else:
            files = below.files if any(p == link.path for p, _ in below.files) else (*below.files, (link.path, link.data))
            depth = below.depth + 1
            if not defaults or below.defaults[:1] == (label,):  # this file's [defaults] are under the base already
                labels = below.defaults
                table = deep_merge({k: v for k, v in below.table.items() if k != SWEEP}, own)
            else:  # another file's [defaults] go under the whole chain: merged from the layers
                labels = (label, *(x for x in below.defaults if x != label))
                table = merge_layers(layers(link.path, link.name, link.data, read))[0]
        below = _Merged(table, labels, files, depth)
        _MERGED[link.key] = below
    assert below is not None
    return copy.deepcopy(below.table)
