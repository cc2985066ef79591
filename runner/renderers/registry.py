"""Renderers by name: `get_renderer(name, tokenizer)` builds one; `names()` lists them (what `runner check` offers).

A built-in renderer is one module of this package with `@register("name")` (runner/renderers/base.py) on its
Renderer subclass, and nothing else: a renderer module is its own config (it imports nothing heavy, and a renderer has
no recipe fields: a recipe names it, `renderer = "llama3"`), so the first lookup imports every module of the package
with the finder every kind shares (backends/configs.py `config_modules`, every module rather than `*_config.py`
ones), which registers them; no list names them. A user's is `renderer = {kind = "python", target = "pkg.mod:NAME"}`
(the old short `renderer = "pkg.mod:NAME"` is refused in a recipe; a decoded recipe holds the target, "pkg.mod:NAME",
which is what this module is given): NAME is a Renderer subclass (or any factory tokenizer -> Renderer) in their
module (docs/extending.md).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Callable

from backends.configs import config_modules
from backends.errors import UserError, one_line
from runner.renderers.auto import pick_renderer
from runner.renderers.base import AUTO, REGISTRY, Factory, Renderer, Tokenizer
from runner.user_code import import_user_module

# A user's renderer: "pkg.mod:NAME" (the recipe's TARGET_PATTERN; the recipe sits above this package).
USER_RENDERER = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


@functools.cache
def builtin_modules() -> tuple[str, ...]:
    """Import every module of this package, once, at the first lookup: a built-in renderer's module registers itself
    when imported, so adding the file is all it takes. Cheap (the package's modules import nothing heavy: no torch,
    no tokenizer), deterministic (name order), and lazy: importing runner.renderers alone registers nothing more."""
    return tuple(m.__name__.rpartition(".")[2] for m in config_modules(__package__ or "runner.renderers", suffix=""))


def registered() -> dict[str, Factory]:
    """The table of renderers by name (runner/renderers/base.py REGISTRY), every built-in one in it."""
    builtin_modules()
    return REGISTRY


def names() -> list[str]:
    """Every renderer name: "auto", "hf", then the rest alphabetically."""
    return [AUTO, *sorted(registered(), key=lambda n: (n != "hf", n))]


def did_you_mean(name: str) -> str:
    """' (did you mean 'llama3'?)' for a renderer name close to a registered one ('lama3'), else ''."""
    close = difflib.get_close_matches(name, names(), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get_renderer(name: str, tokenizer: Tokenizer, model_name: str | None = None) -> Renderer:
    """The renderer `name` over `tokenizer`; "auto" picks one for `model_name` (see pick_renderer)."""
    if name == AUTO:
        name = pick_renderer(model_name or getattr(tokenizer, "name_or_path", "") or "", tokenizer)
    user = USER_RENDERER.match(name) is not None
    factory = user_factory(name) if user else registered().get(name)
    if factory is None:
        raise UserError(f"unknown renderer {name!r}{did_you_mean(name)}; choose one of: {', '.join(names())}")
    try:
        renderer = factory(tokenizer)
    except UserError as e:
        raise UserError(f"renderer {name!r}: {e}") from None
    except Exception as e:  # a user's factory: its error in one line naming it (a built-in's bug keeps its traceback)
        if not user:
            raise
        raise UserError(f"renderer {name!r}: calling it with the tokenizer raised {one_line(e)}") from None
    if not isinstance(renderer, Renderer):
        raise UserError(f"renderer {name!r} returned {type(renderer).__name__}, not a Renderer "
                        "(runner/renderers/base.py)")
    renderer.name = name
    return renderer


def renderer_mismatch(renderer: str, model: str, tokenizer: str | None) -> str | None:
    """`runner check`: why `renderer` cannot write for the recipe's tokenizer (its special tokens are not single
    tokens there), or None: it can, it needs none, or the tokenizer is not on this machine to look at (a hub id
    not yet downloaded is taken on trust; the run checks it when it loads it)."""
    from backends.tokenizer import local_core_tokenizer, local_has_chat_template
    from runner.models import model_renderer

    name = model_renderer(model) if renderer == AUTO else renderer
    if name == "hf" and local_has_chat_template(tokenizer or model) is False:
        return (f"renderer 'hf': the tokenizer ({tokenizer or model}) has no chat template; set renderer = "
                "\"role_colon\" (a base model) or the model family's renderer")
    required = required_tokens(registered().get(name or ""))
    if not required:
        return None
    tok = local_core_tokenizer(tokenizer or model)
    if tok is None:
        return None
    missing = [t for t in required if len(tok.encode(t, add_special_tokens=False).ids) != 1]
    if not missing:
        return None
    return (f"renderer {name!r}: the tokenizer ({tokenizer or model}) does not have {', '.join(missing)} as single "
            "tokens, which this format writes: pick the renderer of the model's family (or \"hf\": its chat template)")


def required_tokens(factory: object) -> tuple[str, ...]:
    """The special tokens a registered renderer writes (its class's `required_tokens`; a functools.partial of the
    class, a variant with other arguments, is looked through)."""
    while isinstance(factory, functools.partial):
        factory = factory.func
    return tuple(getattr(factory, "required_tokens", None) or ())


def user_factory(target: str) -> Callable[..., object]:
    """The factory a recipe's `renderer = {kind = "python", target = "pkg.mod:NAME"}` names; UserError when it cannot
    be imported (whatever its module raises: a SyntaxError is as much the user's as a missing module) or is not
    callable. `runner check` calls it too (runner/recipe/load.py check_recipe), so a bad one is found before a run."""
    module, _, attr = target.partition(":")
    mod = import_user_module(module, f"renderer {target!r}: cannot import {module}")
    factory = getattr(mod, attr, None)
    if factory is None:
        raise UserError(f"renderer {target!r}: {module} has no {attr}")
    if not callable(factory):
        raise UserError(f"renderer {target!r} is {type(factory).__name__}, not a Renderer class or factory")
    return factory


def smoke_renderer(renderer: str, model: str, stand_in: str) -> str:
    """The renderer a smoke run (runner/tools/smoke.py) of a `model` recipe uses on its `stand_in` model: what
    `renderer` means for the real model ("auto" resolved by the model's name when the cookbook knows it), kept when
    the stand-in has its special tokens (a stand-in built from the model's own tokenizer has them all), else "auto"
    (on the embedded tiny model: its chat template)."""
    from runner.models import model_renderer

    wanted = (model_renderer(model) or AUTO) if renderer == AUTO else renderer
    if wanted == AUTO or stand_in != "tiny":
        return wanted
    from backends.tokenizer import load_tokenizer

    try:
        get_renderer(wanted, load_tokenizer("tiny"))
    except UserError:
        return AUTO
    return wanted
