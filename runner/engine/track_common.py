"""What the trackers (runner/engine/track.py and track_*.py) share: the extras they need, and how a recipe and a
metrics row become what a tool shows."""

from __future__ import annotations

import json
import os
from pathlib import Path

from runner.recipe.common import Json

# The `log` table's trackers, in the order they start: (what the user reads, the module imported only when a recipe
# asks for it, how to install it).
EXTRAS: dict[str, tuple[str, str, str]] = {
    "wandb": ("W&B", "wandb", "pip install wandb (or pip install 'runner[wandb]')"),
    "tensorboard": ("TensorBoard", "tensorboardX", "pip install 'runner[tensorboard]' (or pip install tensorboardX)"),
    "mlflow": ("MLflow", "mlflow", "pip install 'runner[mlflow]' (or pip install mlflow)"),
    "trackio": ("Trackio", "trackio", "pip install 'runner[trackio]' (or pip install trackio)"),
}


def missing(name: str) -> str:
    _, module, pip = EXTRAS[name]
    return f"log.{name}: the {module} package is not installed; {pip}, or remove the log.{name} table"


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


# ---------------------------------------------------------------- shared by the trackers


def flatten(config: Json, prefix: str = "") -> Json:
    """{"lora": {"rank": 8}} -> {"lora.rank": 8}; an empty table stays as its key ({}), arrays stay whole."""
    out: Json = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def scalars(row: Json) -> dict[str, float]:
    """A metrics row's numbers (booleans as 0/1), `step` aside: what the trackers plot."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


def read_json(path: Path) -> Json:
    """A tracker's record in the run dir ({} when absent or unreadable: a new tracker run)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_json(path: Path, value: Json) -> None:
    path.write_text(json.dumps(value) + "\n")


def default_name(path: Path) -> str:
    """runs/sl_basic -> "sl_basic", runs/sl_basic/lr=0.001 -> "sl_basic/lr=0.001"; elsewhere the dir's own name."""
    try:
        rel = path.resolve().relative_to(Path(os.getcwd()).resolve())
    except ValueError:
        return path.name
    parts = rel.parts[1:] if rel.parts[:1] == ("runs",) and len(rel.parts) > 1 else rel.parts
    return "/".join(parts) or path.name
