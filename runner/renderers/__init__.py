"""Renderers: chat messages <-> tokens and training weights, one module per model family, equal token for token
to tinker-cookbook 0.6.1's renderers of the same names. `get_renderer(name, tokenizer)`; `names()`; a new one
is a module here with `@register("name")` on a Renderer subclass (registry.py imports every module of the package
at the first lookup: no list to edit). Also here: the
tokenizer's own chat template (`chat_template.py`, the `hf` renderer) and `ChatRenderer` (`chat.py`: the recipe's
renderer as envs and samplers speak it: prompts, stop sequences, parsed replies). The package sits below the recipe
(tests/test_import_graph.py): it imports nothing of runner/ but itself."""

from runner.renderers.auto import pick_renderer
from runner.renderers.base import (
    AUTO,
    TRAIN_ON_WHAT,
    Message,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    TrainOnWhat,
    add_renderer,
    parse_train_on_what,
    register,
    render_row,
    text_of,
)
from runner.renderers.display import colorize
from runner.renderers.registry import get_renderer, names

__all__ = [
    "AUTO",
    "TRAIN_ON_WHAT",
    "Message",
    "RenderContext",
    "Rendered",
    "Renderer",
    "Termination",
    "TrainOnWhat",
    "add_renderer",
    "colorize",
    "get_renderer",
    "names",
    "parse_train_on_what",
    "pick_renderer",
    "register",
    "render_row",
    "text_of",
]
