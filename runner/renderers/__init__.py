"""Renderers: chat messages <-> tokens and training weights, one module per model family, equal token for token
to tinker-cookbook 0.6.1's renderers of the same names. `get_renderer(name, tokenizer)`; `names()`; a new one
is a module here with `@register("name")` on a Renderer subclass, imported below."""

from runner.renderers import deepseek_v3, gpt_oss, hf, kimi_k2, llama3, qwen3, role_colon  # noqa: F401 - registers
from runner.renderers.auto import pick_renderer
from runner.renderers.base import (
    TRAIN_ON_WHAT,
    Message,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    TrainOnWhat,
    parse_train_on_what,
    text_of,
)
from runner.renderers.display import colorize
from runner.renderers.registry import AUTO, add_renderer, get_renderer, names, register

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
    "text_of",
]
