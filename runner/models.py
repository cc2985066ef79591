"""The one table of what runner knows about a model by name (runner/models.toml): the renderer `auto` picks, the
hidden size `lr = "auto"` uses, the Tinker price per million tokens, the context length (prompt + completion).
Readers: runner/renderers/auto.py, runner/recipe/lr.py, runner/engine/cost.py, runner/recipe/fits.py (`runner
check`), runner/renderers/chat.py (context_window: RL's per-turn cap). A new model is one `[models."NAME"]` table
there.

At the bottom of the package order (tests/test_import_graph.py): it imports nothing of runner/ (backends/errors.py's
UserError only).
"""

from __future__ import annotations

import functools
import json
import tomllib
from pathlib import Path
from typing import Annotated

import msgspec

from backends.errors import UserError

TABLE = Path(__file__).with_name("models.toml")


class Model(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    renderer: str | None = None
    hidden_size: int | None = None
    # {prefill, sample, train}: USD per million tokens (checked as a recipe's `price`, runner/recipe/cost.py).
    price: dict[str, float] | None = None
    # Max tokens of prompt + completion (the published config's max_position_embeddings).
    context: Annotated[int, msgspec.Meta(gt=0)] | None = None


def _load(path: Path = TABLE) -> dict[str, Model]:
    """The table; a UserError naming the model and the field when an edit of it is wrong (a typo'd key, a context of
    0): the table is loaded when runner reads a recipe, so a traceback there would stop every command."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML: {e}") from None
    models = raw.get("models")
    if not isinstance(models, dict):
        raise UserError(f"{path}: expected [models.\"NAME\"] tables")
    out: dict[str, Model] = {}
    for name, row in models.items():
        try:
            out[name] = msgspec.convert(row, Model)
        except msgspec.ValidationError as e:
            raise UserError(f"{path}: [models.{json.dumps(name)}]: {e}") from None
    return out


@functools.cache
def models() -> dict[str, Model]:
    """The table, read at first use (not at import: a broken edit of it is then a one-line error of the command
    that needed it, exit 2, not a traceback at `import runner.cli`)."""
    return _load(TABLE)


def model_info(name: str) -> Model | None:
    """The table's row for a model name (a ":..." checkpoint suffix ignored), or None."""
    return models().get(name.split(":", 1)[0])


def model_renderer(name: str) -> str | None:
    """The renderer `auto` picks for a model the table names (a ":..." suffix ignored), or None."""
    row = model_info(name)
    return None if row is None else row.renderer


def hidden_sizes() -> dict[str, int]:
    """Model name -> hidden size, for the models the table gives one (lr = "auto")."""
    return {name: m.hidden_size for name, m in models().items() if m.hidden_size is not None}


def model_context(name: str) -> int | None:
    """The table's context length for a model name (a ":..." suffix ignored), or None when it has none."""
    row = model_info(name)
    return None if row is None else row.context
