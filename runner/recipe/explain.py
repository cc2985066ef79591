"""msgspec's validation errors as one line that says what to fix.

msgspec's errors carry a path (`$.algo.batch_size`) but not the choices or the offending value, so
`explain` walks the schema (msgspec.inspect) along the raw data to add them: "algo.batch_size: expected int
>= 1, got 0", "algo.data.kind: invalid choice 'csv'; expected one of: hf, jsonl, python", "unknown key; did
you mean `batch_size`?". It knows no field by name: new variants of any union get the same messages.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import re
import threading
from collections.abc import Sequence
from typing import Any, TypeVar, overload

import msgspec
import msgspec.inspect as mi

from backends.errors import UserError
from runner.recipe.common import REF_DESCRIPTION, TARGET_PATTERN

T = TypeVar("T")
# Recipe names and override keys: plain names (a recipe name becomes a run directory, runs/<name>).
NAME = re.compile(r"^[A-Za-z0-9_-]+$")
MISSING = object()  # a key the raw data does not hold


# msgspec (0.22) builds a type's decoding info on its first use, calling back into Python (the class annotations)
# part-way; a second thread converting to the same type meanwhile reads the half-built info and segfaults. `runner
# serve` loads run dirs' recipes on request threads (measured: 32 threads loading one config.toml at once crashed 3
# runs in 4), so every conversion here runs under one lock: a recipe converts in about a millisecond.
_CONVERT_LOCK = threading.RLock()  # re-entrant: a struct's __post_init__ may convert a part of it


def convert(raw: object, type_: type[T], where: str) -> T:
    """msgspec.convert, with a failure turned into a one-line UserError (works for any struct type)."""
    try:
        with _CONVERT_LOCK:
            return msgspec.convert(raw, type_)
    except msgspec.ValidationError as e:
        raise UserError(f"{where}: {explain(str(e), raw, type_)}") from None


# ---------------------------------------------------------------- walking the schema with the data

def resolve(t: mi.Type | None, raw: object) -> mi.Type | None:
    """The concrete type at a node: Metadata unwrapped, None dropped, a tagged union narrowed by the
    raw tag. An unresolvable union comes back as is."""
    if isinstance(t, mi.Metadata):
        return resolve(t.type, raw)
    if isinstance(t, mi.UnionType):
        types = [m for m in t.types if not isinstance(m, mi.NoneType)]
        if len(types) == 1:
            return resolve(types[0], raw)
        structs = [s for s in (resolve(m, raw) for m in types) if isinstance(s, mi.StructType)]
        if isinstance(raw, dict):
            for s in structs:
                if s.tag_field is not None and raw.get(s.tag_field) == s.tag:
                    return s
    return t


def _variants(t: mi.Type | None) -> list[mi.StructType]:
    """The tagged struct choices at a node (one for a lone tagged struct, none if untagged)."""
    if isinstance(t, mi.Metadata):
        return _variants(t.type)
    if isinstance(t, mi.UnionType):
        return [v for m in t.types for v in _variants(m)]
    if isinstance(t, mi.StructType) and t.tag_field is not None:
        return [t]
    return []


def child(t: mi.Type | None, raw: object, key: str | int) -> tuple[mi.Type | None, mi.Field | None]:
    """(type, field) one step down from type `t` holding `raw`; (None, None) if the schema says nothing."""
    t = resolve(t, raw)
    if isinstance(t, mi.StructType) and isinstance(key, str):
        if key == t.tag_field:
            return mi.LiteralType(values=(t.tag,)), None
        for f in t.fields:
            if f.encode_name == key:
                return f.type, f
    if isinstance(t, mi.DictType):
        return t.value_type, None
    if isinstance(t, (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return getattr(t, "item_type", None), None
    return None, None


def is_str(t: mi.Type | None) -> bool:
    t = resolve(t, None)
    return isinstance(t, mi.StrType) or (isinstance(t, mi.LiteralType) and all(isinstance(v, str) for v in t.values))


def _get(raw: object, key: str | int) -> object:
    if isinstance(raw, dict) and isinstance(key, str):
        return raw.get(key, MISSING)
    if isinstance(raw, list) and isinstance(key, int) and key < len(raw):
        return raw[key]
    return MISSING


# ---------------------------------------------------------------- msgspec errors -> one line

def explain(message: str, raw: object, root: object) -> str:
    """'Expected `int` >= 1 - at `$.algo.batch_size`' -> 'algo.batch_size: expected int >= 1, got 0'."""
    text, _, loc = message.partition(" - at `$")
    parts: list[str | int] = []
    t, node, parent_t = info(root), raw, None
    for name, index in re.findall(r"\.([^.\[`]+)|\[(\d+|\.\.\.)\]", loc):
        if name:
            key: str | int = name
        elif index == "...":  # a dict entry, which msgspec does not name
            key = _bad_key(raw, parts, node, root, message)
        else:
            key = int(index)
        parent_t = t
        t, _ = child(t, node, key)
        node = _get(node, key)
        parts.append(key)
    path = dotted(parts)
    where = f"{path}: " if path else ""

    if m := re.fullmatch(r"Object contains unknown field `(.+)`", text):
        key = m.group(1)
        s = resolve(t, node)
        valid = sorted([f.encode_name for f in s.fields] + ([s.tag_field] if s.tag_field else [])) if isinstance(
            s, mi.StructType
        ) else []
        close = difflib.get_close_matches(str(key), valid, n=1)
        hint = f"; did you mean `{close[0]}`?" if close else ""
        # A key of another kind of this table: most often an override switched `kind` (backend.kind=python) and the
        # file's keys for the old kind stayed. Say so, and how to replace the table whole.
        owners = [v for v in _variants(t) if v is not s and key in {f.encode_name for f in v.fields}]
        if not close and owners and isinstance(s, mi.StructType) and s.tag_field:
            table = dotted(parts) or "the table"
            kinds = "kind" if len(owners) == 1 else "kinds"
            hint = (f"; it is a key of {kinds} {_tags(owners)}, and this {table} is kind {s.tag!r}: to change the kind, "
                    f"give the table whole ({table}={{{s.tag_field} = {json.dumps(s.tag)}, ...}})")
        return f"{dotted([*parts, key])}: unknown key{hint} (valid: {', '.join(valid)})"

    if m := re.fullmatch(r"Object missing required field `(.+)`", text):
        key = m.group(1)
        variants = _variants(t)
        if variants and key == variants[0].tag_field:
            return f"{dotted([*parts, key])}: missing key; expected one of: {_tags(variants)}"
        ft, _ = child(t, node, key)
        return f"{dotted([*parts, key])}: missing key; {_expected(ft, key)}"

    # A bad tag (wrong value or wrong type) is a bad choice among the parent's variants.
    pv = _variants(parent_t) if parts else []
    if pv and parts[-1] == pv[0].tag_field:
        return f"{where}invalid choice {_show(node)}; expected one of: {_tags(pv)}"
    if re.fullmatch(r"Invalid (enum )?value .*", text):
        lit = resolve(t, node)
        choices = ", ".join(map(str, lit.values)) if isinstance(lit, mi.LiteralType) else "?"
        return f"{where}invalid choice {_show(node)}; expected one of: {choices}"

    if m := re.fullmatch(r"Expected `([^`]+)`, got `[^`]+`", text):
        names = [n for n in m.group(1).split(" | ") if n != "null"]
        if "object" in names and _variants(t):
            return f"{where}expected a table, got {got(node)}; {_table_hint(t, parts[-1] if parts else '', node)}"
        return f"{where}expected {' or '.join(map(_type_name, names))}, got {got(node)}"

    if m := re.fullmatch(r"Expected `([^`]+)` (.+)", text):
        # A Target declared without our description (same pattern) still reads as 'pkg.mod:fn'.
        desc = _description(t) or ("'pkg.mod:fn'" if is_target(t) else None)
        want = desc or f"{_type_name(m.group(1))} {m.group(2)}"
        shown = got(node) if isinstance(node, (dict, list)) else _show(node)
        return f"{where}expected {want}, got {shown}"

    # __post_init__ ValueErrors and anything new: msgspec's text, with our path.
    return f"{where}{text}"


def _type_name(msgspec_name: str) -> str:
    return "table" if msgspec_name == "object" else msgspec_name


def _bad_key(raw: object, parts: list[str | int], node: object, root: object, message: str) -> str:
    """msgspec reports a dict entry as `[...]`: find the key by re-checking with one entry at a time."""
    if not isinstance(node, dict):
        return "..."
    for key, value in node.items():
        trial: Any = copy.deepcopy(raw)  # the same tables and arrays as `raw`, walked by `parts`
        target = trial
        for p in parts:
            target = target[p]
        target.clear()
        target[key] = value
        try:
            msgspec.convert(trial, root)
        except msgspec.ValidationError as e:
            if str(e) == message:
                return key
    return "..."


def _expected(t: mi.Type | None, key: str | int) -> str:
    if _variants(t):
        return _table_hint(t, key, MISSING)
    desc = _description(t)
    if desc:
        return f"expected {desc}"
    r = resolve(t, None)
    if isinstance(r, mi.StructType | mi.DictType):
        return "expected a table"
    if isinstance(r, mi.LiteralType):
        return f"expected one of: {', '.join(map(str, r.values))}"
    # A bound reads as the recipe would write it (msgspec hands back `gt=0` as 0 or 0.0 depending on how the type was
    # first inspected in this process).
    limits = [f"{op} {_bound(getattr(r, name))}" for name, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
              if getattr(r, name, None) is not None]
    return f"expected {' '.join([_type_name(type(r).__name__.removesuffix('Type').lower()), *limits])}"


def _bound(v: float) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def _table_hint(t: mi.Type | None, key: str | int, value: object) -> str:
    variants = _variants(t)
    tags = [v.tag for v in variants]
    tag, field = (value if value in tags else tags[0]), variants[0].tag_field
    return f'write e.g. {key} = {{{field} = "{tag}"}} ({field} one of: {_tags(variants)})'


def _tags(variants: list[mi.StructType]) -> str:
    return ", ".join(sorted(str(v.tag) for v in variants))


def _description(t: mi.Type | None) -> str | None:
    """A `Meta(description=...)` on the type: says what a pattern means better than the regex."""
    t = _non_null(t)
    if isinstance(t, mi.Metadata) and t.extra_json_schema:
        return t.extra_json_schema.get("description")
    return None


def _non_null(t: mi.Type | None) -> mi.Type | None:
    """`X | None` -> X (still wrapped in its Metadata, if any)."""
    if isinstance(t, mi.UnionType):
        types = [m for m in t.types if not isinstance(m, mi.NoneType)]
        return types[0] if len(types) == 1 else t
    return t


def dotted(parts: Sequence[str | int]) -> str:
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            p = p if NAME.match(p) else f'"{p}"'
            out += f".{p}" if out else p
    return out


def _show(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is MISSING:
        return "nothing"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def got(v: object) -> str:
    """A raw value with its TOML type: "str 'fast'", 'table', 'array [1, 2]'."""
    if isinstance(v, dict):
        return "table"
    name = "array" if isinstance(v, list) else type(v).__name__
    return f"{name} {_show(v)}"



_type_info = functools.cache(mi.type_info)


@overload
def info(type_: type[msgspec.Struct]) -> mi.StructType: ...
@overload
def info(type_: object) -> mi.Type: ...
def info(type_: object) -> mi.Type:
    """msgspec.inspect's view of a type (a struct's: its StructType), built once per type."""
    return _type_info(type_)


def is_ref(t: mi.Type | None) -> bool:
    """A RecipeRef field (runner/recipe/schema.py): another run's weights, resolved by runner/engine/chain.py."""
    return _description(t) == REF_DESCRIPTION


def is_target(t: mi.Type | None) -> bool:
    """A Target field ("pkg.mod:fn"), alone or as the string choice of a union (a judge: a target or a table)."""
    if isinstance(t, mi.UnionType):
        return any(is_target(m) for m in t.types if not isinstance(m, mi.NoneType))
    t = t.type if isinstance(t, mi.Metadata) else t
    return isinstance(t, mi.StrType) and t.pattern == TARGET_PATTERN
