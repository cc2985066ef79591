"""The recipe's config structs and the one finder of them.

Every extension kind declares itself the same way (docs/extending.md): a light msgspec struct, tagged by `kind`, in a
`*_config.py` beside its implementation (backends/NAME/NAME_config.py, runner/algos/sft_config.py,
runner/rl/envs/math_config.py, runner/engine/math_eval_config.py, backends/losses/ppo_config.py). `found(base,
package)` lists those files, imports each by its file (no package __init__ runs: a folder's __init__ may import
torch, or the schema that is asking) and returns the subclasses of `base` they declare; the recipe schema's tagged
unions are built from it, so a new variant is new files in one folder, with no list to edit and no re-export line.
Its implementation is the module beside it: the config module's name without `_config` (`implementation_of`).

A config file imports neither torch nor the tinker SDK at module level (a backend's `make()` does, when a run starts),
so validating a recipe imports neither; nor the module that builds its own union (it takes its base from
runner/recipe/common.py), so whichever module a program imports first, each union comes out whole
(tests/test_import_graph.py and tests/test_extending.py check both).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import TypeVar

import msgspec


class ConfigStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A recipe table: unknown keys are errors, values immutable, fields by name.

    Subclasses inherit frozen=True (msgspec). pyright reports "a non-frozen class cannot inherit from a
    frozen class" for each of them: its dataclass_transform model does not inherit the option."""


B = TypeVar("B", bound=type)
SUFFIX = "_config"
_LOCK = threading.RLock()


def variants(base: B) -> tuple[B, ...]:
    """The subclasses of a tagged struct base, in the order they are declared: the members of a tagged union (msgspec
    decodes `kind = ...` into the one with that tag). A subclass that declares `ABSTRACT = True` (a shared base of
    several variants) is not one: its own subclasses are, in its place."""
    out: list[B] = []
    for sub in base.__subclasses__():
        out.extend(variants(sub) if sub.__dict__.get("ABSTRACT", False) else [sub])
    return tuple(out)


def config_files(package: str, suffix: str = SUFFIX) -> list[tuple[str, Path]]:
    """(module name, file) of every config module of `package` (dotted, under runner/ or backends/), in name order:
    each FILE{suffix}.py in its folder and NAME/NAME{suffix}.py one folder down; suffix "": every module of the folder
    (a package whose modules are all light, as runner/renderers/ is)."""
    top, _, rest = package.partition(".")
    folder = Path(importlib.import_module(top).__file__ or "").parent.joinpath(*rest.split(".") if rest else ())
    out = [(f"{package}.{p.stem}", p) for p in folder.glob("*.py")
           if p.stem.endswith(suffix) and not p.stem.startswith("_")]
    if suffix:
        out += [(f"{package}.{p.parent.name}.{p.stem}", p) for p in folder.glob(f"*/*{suffix}.py")
                if p.stem == p.parent.name + suffix]
    return sorted(out)


def config_modules(package: str, suffix: str = SUFFIX) -> tuple[ModuleType, ...]:
    """The config modules of `package` (config_files), imported once each, by file."""
    return tuple(_load(name, path) for name, path in config_files(package, suffix))


def _load(name: str, path: Path) -> ModuleType:
    """The module `name` from `path`, imported without importing the packages it sits in (their __init__ may import
    heavy code, or the schema that is finding it); a later `import name` gets this same module."""
    with _LOCK:
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        parent, _, child = name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)
        return module


def found(base: B, package: str, suffix: str = SUFFIX) -> tuple[B, ...]:
    """The variants of `base` declared in `package`'s config modules: file-name order, then declaration order."""
    rank = {m.__name__: i for i, m in enumerate(config_modules(package, suffix))}
    return tuple(sorted((v for v in variants(base) if v.__module__ in rank), key=lambda v: rank[v.__module__]))


def implementation_of(config: type) -> str:
    """The module that implements a config struct: the one beside its config module (runner/algos/sft_config.py ->
    runner.algos.sft), or its own module when it declares its config itself."""
    return config.__module__.removesuffix(SUFFIX)
