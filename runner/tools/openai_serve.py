"""`runner serve`'s OpenAI hooks (backends/serve/openai_api.py OpenAIHooks, docs/openai.md): each model's chat format
(runner/rl/openai_chat.py) and the local checkpoints a request's `model` may name (run dirs)."""

from __future__ import annotations

import json
from pathlib import Path

from backends.errors import UserError
from backends.serve.openai_api import LocalModel, OpenAIHooks
from backends.tokenizer import Tokenizer
from runner.rl.openai_chat import RendererChat, chat_format


def local_model(spec: str) -> LocalModel | None:
    """A run dir (its last checkpoint), `RUN_DIR:NAME` (its checkpoint NAME) or a checkpoint folder (a local
    save's sampler weights or state); None when `spec` names none of these. The run's recipe gives the base model
    and the renderer."""
    from runner.engine.rundir import CHECKPOINTS, CONFIG, load_config, read_checkpoints

    path, name = Path(spec).expanduser(), None
    if not path.is_dir():
        head, sep, tail = spec.rpartition(":")
        if not (sep and Path(head).expanduser().is_dir()):
            return None
        path, name = Path(head).expanduser(), tail
    if (path / CHECKPOINTS).is_file():
        rows = [r for r in read_checkpoints(path) if r.get("sampler_path")]
        if not rows:
            raise UserError(f"run dir {spec} has no checkpoint with sampler weights")
        row = rows[-1] if name is None else next((r for r in rows if r.get("name") == name), None)
        if row is None:
            raise UserError(f"run dir {path} has no checkpoint {name!r}; it has: "
                            f"{', '.join(str(r.get('name')) for r in rows)}")
        folder, run = Path(row["sampler_path"]), path
    elif name is None and any((path / f).is_file() for f in ("state.json", "adapter_config.json")):
        folder = path
        run = path.parent.parent.parent if path.parent.parent.name == "checkpoints" else None
    else:
        return None
    if run is not None and (run / CONFIG).is_file():
        recipe = load_config(run / CONFIG)
        return LocalModel(recipe.model, folder, recipe.renderer)
    base = _base_of(folder)
    if base is None:
        raise UserError(f"{folder}: cannot tell its base model (no run dir config.toml above it)")
    return LocalModel(base, folder, None)


def _base_of(folder: Path) -> str | None:
    for name, key in (("state.json", "base_model"), ("adapter_config.json", "base_model_name_or_path")):
        try:
            value = json.loads((folder / name).read_text()).get(key)
        except (OSError, ValueError):
            continue
        if isinstance(value, str):
            return value
    return None


def serve_hooks(renderer: str | None = None) -> OpenAIHooks:
    """`runner serve`'s OpenAI hooks: each model's renderer is `renderer` when given, else a checkpoint's run's,
    else "auto" (the cookbook's for a model it knows, else the tokenizer's chat template)."""

    def chat(model_name: str, tokenizer: Tokenizer, run_renderer: str | None) -> RendererChat:
        return chat_format(model_name, tokenizer, renderer or run_renderer or "auto")

    return OpenAIHooks(chat=chat, local_model=local_model)
