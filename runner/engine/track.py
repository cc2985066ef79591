"""Experiment tracking: where a run's metrics go besides metrics.jsonl (`[recipes.x.log]` in the recipe).

The run dir (runner/engine/rundir.py) starts a tracker when a training session begins, hands it every row it writes to
metrics.jsonl, and ends it with the session; nothing else knows trackers exist, and nothing here knows which
backend or algorithm runs. Only Weights & Biases for now:

- the rows are metrics.jsonl's, with `step` as their x axis (W&B's own step counter is left to count calls);
- the run's config is the resolved recipe;
- the W&B run id is kept in the run dir (wandb.json), so a resumed session continues the same W&B run
  (resume="allow"); a resumed session re-logs the steps after its checkpoint, which the local backend
  reproduces exactly, so they land on the same points;
- the API key is whatever wandb finds in the environment (WANDB_API_KEY, `wandb login`): never read or
  written here; WANDB_MODE=offline logs to the run dir only (`wandb sync` uploads later).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, Protocol

from backends.errors import UserError
from runner.recipe.load import recipe_dict
from runner.recipe.schema import Recipe, WandB

WANDB_FILE = "wandb.json"


class Tracker(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def finish(self, status: str) -> None:
        """status: "success", "interrupted" or "error" (runner/engine/loop.py)."""
        ...


def start_tracker(recipe: Recipe, path: Path) -> Tracker | None:
    """The tracker the recipe's `log` table asks for (None: none), started for a session in run dir `path`
    (`recipe` as config.toml records it). wandb is imported only when a recipe asks for it."""
    if recipe.log.wandb is None:
        return None
    return WandbTracker(recipe.log.wandb, path, recipe_dict(recipe))


class WandbTracker:
    def __init__(self, cfg: WandB, path: Path, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("log.wandb: the wandb package is not installed; pip install wandb "
                            "(or pip install 'runner[wandb]'), or remove the log.wandb table") from None
        stored_file = path / WANDB_FILE
        stored = json.loads(stored_file.read_text()) if stored_file.exists() else {}
        same = stored.get("project") == cfg.project and stored.get("entity") == cfg.entity and stored.get("id")
        # Another project or entity is another W&B run; the same one continues (a resumed session).
        run_id = stored["id"] if same else secrets.token_hex(4)
        stored_file.write_text(json.dumps({"id": run_id, "project": cfg.project, "entity": cfg.entity}) + "\n")
        try:
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or default_name(path),
                                  group=cfg.group, tags=list(cfg.tags) or None, config=config, id=run_id,
                                  resume="allow", dir=str(path))
        except Exception as e:  # noqa: BLE001 (no key, no network, a bad entity): one line, before the first step
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"log.wandb: could not start the W&B run: {first}") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(row)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "success" else 1)


def default_name(path: Path) -> str:
    """runs/sl_basic -> "sl_basic", runs/sl_basic/lr=0.001 -> "sl_basic/lr=0.001"; elsewhere the dir's own name."""
    try:
        rel = path.resolve().relative_to(Path(os.getcwd()).resolve())
    except ValueError:
        return path.name
    parts = rel.parts[1:] if rel.parts[:1] == ("runs",) and len(rel.parts) > 1 else rel.parts
    return "/".join(parts) or path.name
