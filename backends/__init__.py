"""Backend dispatch: the one place a recipe's backend variant becomes an object.

Imports are lazy so that `runner check` and dry runs never import torch or the tinker SDK.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.base import Backend
from runner.errors import UserError
from runner.recipe import Local, Recipe, Tinker


def make_backend(recipe: Recipe, run_dir: Path) -> Backend:
    match recipe.backend:
        case Local() as cfg:
            from backends.local import LocalBackend

            # Saved states live in the run dir, next to the checkpoints.jsonl rows that point at them.
            return LocalBackend(cfg, recipe.model, recipe.tokenizer, run_dir / "checkpoints", seed=recipe.seed)
        case Tinker() as cfg:
            from backends.tinker import TinkerBackend

            return TinkerBackend(cfg, recipe.model, recipe.tokenizer)
    raise TypeError(f"unknown backend {recipe.backend!r}")


def load_tokenizer(recipe: Recipe) -> Any:
    """The recipe's tokenizer alone, with no model, client or service (dry runs). The embedded "tiny"
    model's tokenizer is built in code; anything else is a local folder or a cached hub id."""
    name = recipe.tokenizer or recipe.model
    if name == "tiny":
        from backends.local.tiny import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - missing folder, no cache and no network, bad files: all one fix
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot load tokenizer {name!r} ({first}); set tokenizer = \"<local folder>\"") from None
