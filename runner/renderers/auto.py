"""renderer = "auto": the cookbook's recommended renderer for a model it knows (tinker_cookbook.model_info,
as of 0.6.1, restricted to the renderers this project has), else the tokenizer's chat template ("hf"), else
"role_colon" for a tokenizer without one (a base model)."""

from __future__ import annotations

from backends.tokenizer import Tokenizer
from runner.models import model_renderer

# Exact model names (":checkpoint" suffixes are ignored) -> renderer: the `renderer` column of runner/models.toml.


def pick_renderer(model_name: str, tokenizer: Tokenizer | None) -> str:
    """The renderer name `auto` resolves to for `model_name` with `tokenizer`."""
    name = model_renderer(model_name)
    if name is not None:
        return name
    return "hf" if getattr(tokenizer, "chat_template", None) else "role_colon"


def auto_note(renderer: str, model: str) -> str:
    """`runner show`'s comment line saying what renderer = "auto" picks for a model the cookbook knows; '' otherwise
    (a named renderer, or a model whose pick depends on its tokenizer having a chat template)."""
    name = model_renderer(model) if renderer == "auto" else None
    return f"# renderer = {name}: auto: the cookbook's renderer for {model}\n" if name else ""
