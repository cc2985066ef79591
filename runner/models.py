"""The one table of what runner knows about a model by name (runner/models.toml): the renderer `auto` picks, the
hidden size `lr = "auto"` uses, the Tinker price per million tokens. Readers: runner/renderers/auto.py,
runner/recipe/lr.py, runner/engine/cost.py. A new model is one `[models."NAME"]` table there.

At the bottom of the package order (tests/test_import_graph.py): it imports nothing of runner/.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

TABLE = Path(__file__).with_name("models.toml")


class Model(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    renderer: str | None = None
    hidden_size: int | None = None
    # {prefill, sample, train}: USD per million tokens (checked as a recipe's `price`, runner/recipe/cost.py).
    price: dict[str, float] | None = None


def _load(path: Path = TABLE) -> dict[str, Model]:
    raw = tomllib.loads(path.read_text(encoding="utf-8"))
    return msgspec.convert(raw["models"], dict[str, Model])


MODELS: dict[str, Model] = _load()


def model_info(name: str) -> Model | None:
    """The table's row for a model name (a ":..." checkpoint suffix ignored), or None."""
    return MODELS.get(name.split(":", 1)[0])
