"""Reading recipe files: TOML text -> a validated `Recipe` (runner/recipe/schema.py), or one line that says what to fix.

A recipe file holds named recipes under `[recipes.<name>]`; `FILE#name` selects one. Each table is decoded
on its own, so an error names the file, the recipe and the key path. Overrides `a.b=value` are merged into
the raw table before decoding, so they get the same checks. Precedence: CLI > recipe > defaults.

Reading: load_recipe("FILE#name", overrides) -> (name, Recipe); load_file(FILE) -> {name: Recipe}; both go
through `resolve`, which also finds data files and user modules next to the recipe file.
Writing: dump_recipe(name, recipe) -> TOML that loads back to an equal Recipe (`runner show`).
Checking what decoding cannot see: check_recipe (data files exist, Python targets import and fit their args, lengths
fit the model's context).
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from datetime import time as dtime
from pathlib import Path
from typing import Any

import msgspec
import tomli_w

from backends.errors import UserError
from runner.recipe.common import TARGET_PATTERN, Json
from runner.recipe.compose import DEFAULTS, EXTENDS, Layer, layers, merge_layers, merged, origin, resolve_tables
from runner.recipe.explain import NAME, child, convert, dotted, got, info, is_ref, is_str, is_target
from runner.recipe.fits import check_context
from runner.recipe.lr import resolve_auto
from runner.recipe.pinned import task_file
from runner.recipe.refs import absolute_ref
from runner.recipe.schema import File, InspectPinned, Jsonl, Recipe
from runner.recipe.targets import args_mismatch, import_target

DEFAULT_FILE = "recipes.toml"
# `[recipes.<name>.sweep]`: the values to sweep (runner/tools/sweep.py); not a recipe field.
SWEEP_KEY = "sweep"


def load_file(path: str, overrides: Sequence[str] = ()) -> dict[str, Recipe]:
    """Every recipe in a file, by name, overrides applied to each; the first bad one raises UserError."""
    return {name: resolve(path, name, raw, overrides) for name, raw in read_tables(path).items()}


def load_recipe(ref: str, overrides: Sequence[str] = ()) -> tuple[str, Recipe]:
    """`FILE#name` (or just FILE when it holds one recipe) with `a.b=value` overrides applied."""
    path, name, raw = pick(ref)
    return name, resolve(path, name, raw, overrides)


def pick(ref: str) -> tuple[str, str, Json]:
    """(file, recipe name, raw table) of 'FILE#name' (or FILE alone when it holds one recipe)."""
    path, name = split_ref(ref)
    data = read_data(path)
    tables = data["recipes"]
    if name is None:
        if len(tables) != 1:
            raise UserError(f"{path}: pick a recipe as {path}#NAME; available: {', '.join(sorted(tables))}")
        name = next(iter(tables))
    if name not in tables:
        raise UserError(no_recipe(path, name, tables))
    return path, name, merged(path, name, data, read_data)


def no_recipe(path: str, name: str, tables: Json) -> str:
    """'FILE: no recipe named 'rl_basc'; did you mean 'rl_basic'? available: ...'."""
    close = difflib.get_close_matches(name, list(tables), n=1)
    hint = f" (did you mean {path}#{close[0]}?)" if close else ""
    return f"{path}: no recipe named {name!r}{hint}; available: {', '.join(sorted(tables))}"


def recipe_names(path: str) -> list[str]:
    """The names of a file's recipes, in order (without resolving them: one bad recipe does not hide the others)."""
    return list(read_data(path)["recipes"])


def resolve(path: str, name: str, raw: Json, overrides: Sequence[str] = (),
            where: str | None = None) -> Recipe:
    """One raw table of file `path` as a Recipe: overrides applied, decoded, and what lives next to the recipe
    file found there (every way of loading a recipe goes through here, so `check FILE` sees what `run FILE#x` sees).
    A `sweep` table is not part of the recipe (runner/tools/sweep.py reads it): it is left out here. `where` prefixes
    errors (default 'FILE#name'; a sweep adds the point)."""
    where = where or f"{path}#{name}"
    raw = {k: v for k, v in raw.items() if k != SWEEP_KEY}
    table = apply_overrides(raw, overrides, where)
    refuse_short_renderer(table, where)
    try:
        table, _ = resolve_auto(table)  # lr = "auto" (runner/recipe/lr.py)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    recipe = decode_recipe(table, where)
    # User modules ("pkg.mod:fn" targets) may live next to the recipe file: importable after the working
    # directory (import_target puts that first).
    folder = str(Path(path).parent.resolve())
    if folder not in sys.path:
        sys.path.append(folder)
    return _data_next_to_recipe(_absolute_refs(recipe, where, path), where, Path(path).parent)


def _absolute_refs(recipe: Recipe, where: str, path: str) -> Recipe:
    """Every RecipeRef ("#name" means this file) made absolute, so config.toml names the same runs from anywhere."""
    fixes = [(keys, field.encode_name, new)
             for keys, node in structs(recipe, ()) for field in info(type(node)).fields
             if is_ref(field.type) and isinstance(value := getattr(node, field.name), str)
             and (new := absolute_ref(value, path)) != value]
    if not fixes:
        return recipe
    raw = msgspec.to_builtins(recipe)
    for keys, name, value in fixes:
        table = raw
        for key in keys:
            table = table[key]
        table[name] = value
    return decode_recipe(raw, where)


def _data_next_to_recipe(recipe: Recipe, where: str, base: Path) -> Recipe:
    """A relative data path is relative to the working directory; one that is not there but is next to the
    recipe file (`runner run ~/proj/recipes.toml#x` from elsewhere) becomes that file's absolute path, which
    config.toml then records."""
    def moved(value: object) -> str | None:
        rel = Path(value) if isinstance(value, str) and value else None
        if rel is None or rel.is_absolute() or rel.exists() or not (base / rel).exists():
            return None
        return str((base / rel).resolve())

    fixes: list[tuple[tuple[str | int, ...], str]] = []
    for keys, node in structs(recipe, ()):
        if isinstance(node, (Jsonl, File)) and (value := moved(node.path)) is not None:
            fixes.append(((*keys, "path"), value))
        # Paths handed to user code (`args = {path = "data/x.jsonl"}` of a python data source, env or eval; an
        # inspect eval's task_args) too.
        for field in ("args", "task_args"):
            args = getattr(node, field, None)
            if isinstance(args, dict):
                for k, v in args.items():
                    if isinstance(k, str) and _PATH_ARG.search(k) and (value := moved(v)) is not None:
                        fixes.append(((*keys, field, k), value))
        # An inspect eval's "file.py@task".
        if isinstance(node, InspectPinned) and (task := task_file(node.task)) is not None:
            file, at = task
            if (value := moved(file)) is not None:
                fixes.append(((*keys, "task"), value + at))
    if not fixes:
        return recipe
    raw = msgspec.to_builtins(recipe)
    for keys, value in fixes:
        table = raw
        for key in keys[:-1]:
            table = table[key]
        table[keys[-1]] = value
    return decode_recipe(raw, where)


# The `args` keys taken for file paths (made absolute like data paths when found next to the recipe file).
_PATH_ARG = re.compile(r"(^|_)(path|file|dir)$")


def split_ref(ref: str) -> tuple[str, str | None]:
    """'FILE#name' -> (FILE, name); 'FILE' -> (FILE, None)."""
    path, sep, name = ref.rpartition("#")
    if not sep:
        return ref, None
    if not path or not NAME.match(name):
        raise UserError(f"bad recipe reference {ref!r}: expected FILE#NAME, e.g. {DEFAULT_FILE}#sl_basic")
    return path, name


def read_tables(path: str) -> dict[str, Json]:
    """The raw `[recipes.<name>]` tables of a file, undecoded, each with its `extends` chain and the file's
    `[defaults]` merged in (runner/recipe/compose.py)."""
    return resolve_tables(path, read_data(path), read_data)


def read_layers(path: str, name: str) -> list[Layer]:
    """The tables recipe `name` of `path` is merged from, lowest first, each labelled (`runner show --explain`)."""
    data = read_data(path)
    if name not in data["recipes"]:
        raise UserError(no_recipe(path, name, data["recipes"]))
    return layers(path, name, data, read_data)


def read_data(path: str) -> Json:
    """A recipe file parsed and its shape checked: `[recipes.<name>]` tables and an optional `[defaults]` table.
    Each file is parsed once while it is unchanged (_read_cached): the same object comes back, which callers must
    not change (pick, read_tables and merged hand out copies)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: {'not a file' if p.exists() else 'file not found'}{_missing_file_hint(path)}")
    try:
        data = _read_cached(p)
    except PermissionError:
        raise UserError(f"{path}: cannot read it (permission denied)") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: {_toml_error(e)}") from None
    except _TooDeep as e:
        raise UserError(f"{path}: {e}") from None
    return data


def _missing_file_hint(path: str) -> str:
    """`runner run rl_basic`: a recipe name given where a file goes, when ./recipes.toml holds that recipe (or one
    close to it)."""
    if "/" in path or not NAME.match(path) or path == DEFAULT_FILE or not Path(DEFAULT_FILE).is_file():
        return ""
    try:
        names = read_data(DEFAULT_FILE)["recipes"]
    except UserError:
        return ""
    close = [path] if path in names else difflib.get_close_matches(path, list(names), n=1)
    return f"; did you mean {DEFAULT_FILE}#{close[0]}?" if close else ""


def _check_shape(path: str, data: Json) -> None:
    if "recipes" not in data:
        raise UserError(f"{path}: no [recipes] table; write each recipe as [recipes.<name>]")
    for key in data:
        if key not in ("recipes", DEFAULTS):
            raise UserError(f"{path}: {key}: unknown top-level key; write each recipe as [recipes.<name>]")
    defaults = data.get(DEFAULTS, {})
    if not isinstance(defaults, dict):
        raise UserError(f"{path}: {DEFAULTS}: expected a table [{DEFAULTS}], got {got(defaults)}")
    for key in (EXTENDS, SWEEP_KEY):
        if key in defaults:
            raise UserError(f"{path}: {DEFAULTS}.{key}: not allowed in [{DEFAULTS}]; set it on a recipe")
    tables = data["recipes"]
    if not isinstance(tables, dict):
        raise UserError(f"{path}: recipes: expected a table of [recipes.<name>] tables, got {got(tables)}")
    if not tables:
        raise UserError(f"{path}: [recipes] is empty; write each recipe as [recipes.<name>]")
    for name, raw in tables.items():
        if not NAME.match(name):
            raise UserError(f"{path}: recipe name {name!r}: use only letters, digits, '_' and '-'")
        if not isinstance(raw, dict):
            raise UserError(f"{path}#{name}: expected a table [recipes.{name}], got {got(raw)}")


# The deepest nesting of arrays and tables a recipe file (or an override's value) may hold. A recipe needs about 8
# (recipes.NAME.algo.env.judge.backend...); the bound keeps every walk over a table (merging, --explain, decoding)
# far from Python's recursion limit, and a file nested 50,000 deep one line instead of a RecursionError.
MAX_NESTING = 64


class _TooDeep(Exception):
    pass


def toml_loads(text: str) -> Json:
    """tomllib.loads, with nesting deeper than MAX_NESTING refused (_TooDeep; tomllib itself recurses per level of
    arrays and inline tables, so a deep enough file is a RecursionError inside it, turned into the same)."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise _TooDeep(f"arrays or tables nested more than {MAX_NESTING} deep; a recipe needs far fewer") from None
    if (depth := nesting(data)) > MAX_NESTING:
        raise _TooDeep(f"arrays or tables nested {depth} deep, more than {MAX_NESTING}; a recipe needs far fewer")
    return data


def nesting(value: object) -> int:
    """How deep arrays and tables nest in a parsed TOML value (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_NESTING:  # past the bound the answer is "too deep" already: stop walking
            stack.extend((x, depth + 1) for x in items if isinstance(x, (dict, list)))
    return deepest


@dataclass
class _Parsed:
    stat: tuple[int, int, int, int]  # (device, inode, size, mtime ns) when read
    read_ns: int  # when it was read (time.time_ns)
    content: bytes
    data: Json


# Parsed recipe files by resolved path: one `runner check` reads a file once per recipe and per reference between
# recipes (a chain of 2,000 recipes extending a 20,000-recipe file read it 2,000 times). A file whose stat is
# unchanged and whose mtime is well before the read is taken as unchanged; otherwise its bytes are compared (a
# file rewritten within the clock's granularity keeps its mtime: git's "racily clean" case).
_PARSED: dict[str, _Parsed] = {}
_RACY_NS = 2_000_000_000


def _read_cached(p: Path) -> Json:
    key = os.path.realpath(p)
    st = os.stat(key)
    stat = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    hit = _PARSED.get(key)
    if hit is not None and hit.stat == stat and st.st_mtime_ns + _RACY_NS < hit.read_ns:
        return hit.data
    now = time.time_ns()
    content = p.read_bytes()
    if hit is not None and hit.content == content:
        _PARSED[key] = _Parsed(stat, now, content, hit.data)
        return hit.data
    data = toml_loads(content.decode("utf-8"))
    _check_shape(str(p), data)
    if len(_PARSED) >= 512:  # a long-lived process (serve) reading many files: start over
        _PARSED.clear()
    _PARSED[key] = _Parsed(stat, now, content, data)
    return data


def refuse_short_renderer(table: Json, where: str) -> None:
    """User code is spelled one way for every kind, `{kind = "python", target = "pkg.mod:NAME"}`: a recipe's (or an
    override's) old short `renderer = "pkg.mod:NAME"` is refused, naming that spelling. What runner writes back
    (recipe_dict) is the table; a decoded Recipe holds the target as a string, which is not refused there."""
    value = table.get("renderer")
    if isinstance(value, str) and re.fullmatch(TARGET_PATTERN, value):
        raise UserError(f'{where}: renderer: "{value}" is the old spelling of your own renderer; write '
                        f'renderer = {{kind = "python", target = "{value}"}}')


def decode_recipe(raw: Json, where: str) -> Recipe:
    """Validate one raw recipe table; `where` ('FILE#name') prefixes the error."""
    return convert(raw, Recipe, where)


def _toml_error(e: tomllib.TOMLDecodeError) -> str:
    # tomllib (3.11) only puts the position in the message: "Invalid value (at line 12, column 5)".
    m = re.fullmatch(r"(.*) \(at (line \d+, column \d+|end of document)\)", str(e))
    if m is None:
        return f"TOML syntax error: {e}"
    reason, pos = m.groups()
    pos = "end of file" if pos == "end of document" else pos
    return f"TOML syntax error at {pos}: {reason[:1].lower()}{reason[1:]}"


# ---------------------------------------------------------------- overrides

# The longest value an override may carry (a TOML literal on the command line): parsing 35 MB of it took tomllib
# 93 s here; larger values belong in the recipe file.
MAX_OVERRIDE = 1_000_000


def parse_override(text: str) -> tuple[list[str], object]:
    """'a.b=value' -> (['a', 'b'], value). The value is a TOML literal, else the plain string."""
    key, sep, value = text.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(NAME.match(k) for k in keys):
        raise UserError(f"bad override {text!r}: expected KEY=VALUE, e.g. lr=3e-4 or lora.rank=8")
    if len(value) > MAX_OVERRIDE:
        raise UserError(f"override {key.strip()}=...: {len(value):,} characters, more than {MAX_OVERRIDE:,}; put a "
                        "value that large in the recipe file")
    try:
        doc = toml_loads(f"v = {value}")
    except tomllib.TOMLDecodeError:
        return keys, value.strip()
    except _TooDeep as e:
        raise UserError(f"override {key.strip()}=...: {e}") from None
    # "x\nlr = 1" parses as two keys: that is not one literal, so keep the text.
    return keys, doc["v"] if len(doc) == 1 else value.strip()


def toml_value(v: object) -> str:
    """A value as a TOML inline literal (what an override's right-hand side holds)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (datetime, date, dtime)):
        return v.isoformat()
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{k if NAME.match(k) else json.dumps(k)} = {toml_value(x)}" for k, x in v.items())
        return "{" + items + "}"
    raise TypeError(f"not a TOML value: {v!r}")


def show_value(v: object) -> str:
    """A swept value as a point's dir name shows it: 0.001, 8, true, local; an array's items joined by '+'."""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v:
        return "+".join(show_value(x) for x in v)
    return toml_value(v)


def apply_overrides(raw: Json, overrides: Sequence[str], where: str) -> Json:
    """A copy of `raw` with each override set at its path (CLI > recipe > defaults).

    A value replaces what was there (`backend={kind="tinker"}` switches variant). A missing table on
    the way starts from the field's default, so `schedule.warmup_steps=5` keeps the default schedule."""
    out = copy.deepcopy(raw)
    for text in overrides:
        keys, value = parse_override(text)
        node, t = out, info(Recipe)
        for i, key in enumerate(keys[:-1]):
            t, field = child(t, node, key)
            if key not in node:
                node[key] = _seed(field.default if field is not None else None)
            node = node[key]
            if not isinstance(node, dict):
                at = ".".join(keys[: i + 1])
                raise UserError(f"{where}: {at}: is {got(node)}, not a table, so {text!r} cannot set it")
        t, _ = child(t, node, keys[-1])
        # `model=1e3` or `tokenizer=true` parse as numbers/bools; a str-only field takes the text.
        if not isinstance(value, str) and t is not None and is_str(t):
            value = text.partition("=")[2].strip()
        node[keys[-1]] = value
    return out


def _seed(default: object) -> Json:
    """The raw table of a default struct: its tag and the fields that differ from their own defaults
    (so an override of the tag alone, `backend.kind=tinker`, does not drag the old variant's fields)."""
    if not isinstance(default, msgspec.Struct):
        return {}
    struct = info(type(default))
    out: Json = {struct.tag_field: struct.tag} if struct.tag_field else {}
    for f in struct.fields:
        value = getattr(default, f.name)
        own = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        if value != own:
            out[f.encode_name] = msgspec.to_builtins(value)
    return out


# ---------------------------------------------------------------- writing back, and checking

def recipe_dict(recipe: Recipe) -> Json:
    """Every field, defaults included, as TOML-ready builtins. None is left out: TOML has no null,
    and every optional field defaults to None, so leaving it out reads back the same."""
    out = _drop_none(msgspec.to_builtins(recipe, builtin_types=(datetime, date, dtime)))
    if re.fullmatch(TARGET_PATTERN, recipe.renderer):  # a user's renderer, held as its target: written as user code is
        out["renderer"] = {"kind": "python", "target": recipe.renderer}
    return out


def dump_recipe(name: str, recipe: Recipe) -> str:
    """The fully resolved recipe as TOML, wrapped as [recipes.<name>]; loads back to an equal Recipe. An empty
    table (`log`, all of whose fields are None) is left out when the recipe reads back the same without it."""
    table = recipe_dict(recipe)
    for keys in _empty_tables(table, ()):
        trial = copy.deepcopy(table)
        node = trial
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]
        try:
            same = convert(trial, Recipe, name) == recipe
        except UserError:
            same = False
        if same:
            table = trial
    return tomli_w.dumps({"recipes": {name: table}})


def _empty_tables(v: Json, at: tuple[str, ...]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for key, value in v.items():
        if isinstance(value, dict):
            out.extend(_empty_tables(value, (*at, key)) if value else [(*at, key)])
    return out


def _drop_none(v: object) -> Any:
    if isinstance(v, dict):
        return {k: _drop_none(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_drop_none(x) for x in v]
    return v


def check_recipe(recipe: Recipe, where: str) -> None:
    """What decoding cannot see: data files exist (relative to the working directory) and every
    `Target` field imports and is callable. Raises UserError prefixed with `where` ('FILE#name'). The rows themselves
    are read and checked by runner/data/check.py:check_data (runner check calls both: runner/engine/chain.py).
    Also that its max_length / max_tokens fit its models' context (runner/recipe/fits.py)."""
    check_context(recipe, where)
    from runner.renderers.registry import USER_RENDERER, user_factory  # as the schema does: lazily

    if USER_RENDERER.match(recipe.renderer):  # "pkg.mod:NAME": imported here like a Target (it is not one: a str)
        try:
            factory = user_factory(recipe.renderer)
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        if problem := args_mismatch(factory, {}, leading=1):  # called as factory(tokenizer)
            raise UserError(f"{where}: renderer {recipe.renderer!r} cannot be called with a tokenizer: {problem}")
    for path, node in structs(recipe, ()):
        if isinstance(node, (Jsonl, File)) and not Path(node.path).exists():
            looked = "" if Path(node.path).is_absolute() else f" (looked in {os.getcwd()} and next to the recipe file)"
            raise UserError(f"{where}: {dotted([*path, 'path'])}: data file not found: {node.path}{looked}")
        for field in info(type(node)).fields:
            value = getattr(node, field.name)
            if isinstance(value, str) and is_target(field.type):
                try:
                    fn = import_target(value)
                except UserError as e:
                    raise UserError(f"{where}: {dotted([*path, field.encode_name])}: {e}") from None
                # A target called as fn(**args) (python data sources and envs; a pinned eval's after its sampler and
                # tokenizer, TARGET_LEADING; a python backend's with the model, tokenizer, storage_dir and seed,
                # TARGET_KEYWORDS): the args must fit its signature.
                args = getattr(node, "args", None) if field.name == "target" else None
                leading = getattr(type(node), "TARGET_LEADING", 0)
                keywords = getattr(type(node), "TARGET_KEYWORDS", ())
                problem = args_mismatch(fn, args, leading, keywords) if isinstance(args, dict) else None
                if problem and isinstance(args, dict):
                    raise UserError(f"{where}: {dotted([*path, 'args'])}: {value!r} cannot be called with "
                                    f"args {sorted(args)}: {problem}")



def structs(v: object, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], msgspec.Struct]]:
    """Every struct inside a recipe, with its key path (through fields, lists and dict values)."""
    if isinstance(v, msgspec.Struct):
        yield path, v
        for name in v.__struct_fields__:
            yield from structs(getattr(v, name), (*path, name))
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from structs(x, (*path, i))
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from structs(x, (*path, k))


# ---------------------------------------------------------------- where each value came from (`runner show --explain`)

def explain_recipe(path: str, name: str, recipe: Recipe, overrides: Sequence[str] = ()) -> str:
    """One `key = value  # source` line per value of the resolved recipe; the source is `default` (the schema),
    `[defaults] of FILE`, `FILE#base (extends)`, `FILE#name` or `override KEY=VALUE` (runner/recipe/compose.py)."""
    _, origins = merge_layers(read_layers(path, name))
    for text in overrides:
        keys, _ = parse_override(text)
        at = tuple(keys)
        for p in [p for p in origins if p[: len(at)] == at]:
            del origins[p]
        origins[at] = f"override {text}"
    rows = list(_leaves(recipe_dict(recipe), ()))
    width = min(max((len(line) for line, _ in rows), default=0), 72)
    return "".join(f"{line.ljust(width)}  # {origin(origins, keys) or 'default'}\n" for line, keys in rows)


def _leaves(v: Json, at: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...]]]:
    for key, value in v.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*at, key))
        else:
            yield f"{dotted([*at, key])} = {toml_value(value)}", (*at, key)
