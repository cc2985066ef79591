"""Experiment tracking: where a run's metrics go besides metrics.jsonl (the recipe's `log` table, docs/tracking.md).

The run dir (runner/engine/rundir.py) starts the trackers when a training session begins, hands them every row it
writes to metrics.jsonl, and ends them with the session; nothing else knows trackers exist, and nothing here knows
which backend or algorithm runs. Weights & Biases (here), TensorBoard (track_tensorboard.py), MLflow
(track_mlflow.py) and Trackio (track_trackio.py), any several at once, each imported only when a recipe asks for it
(`runner check` says in one line which extra a recipe's tracker needs). The contract every one keeps:

- the rows are metrics.jsonl's, with `step` as their x axis;
- the run's config is the resolved recipe (flattened to dotted keys where the tool shows flat ones best);
- a resumed session continues the same tracker run (its id kept in the run dir), and the steps it logs again land
  on the same points: no tool ends with two points at one step of one metric (how, per tool, in its module);
- the session's end status ("success", "interrupted", "error") becomes the tool's run status where it has one;
- a sweep's points are grouped (sweep_log, called by runner/tools/sweep.py);
- credentials are whatever each tool finds in the environment: never read or written here.

A tracker that cannot start stops the session before its first step (one line, exit 2); one that raises later is
dropped with one warning and the run goes on (metrics.jsonl is written first and never depends on it).

W&B: W&B's own step counter is left to count calls; the run id is kept in wandb.json and a resumed session
continues it (resume="allow"); a resumed session re-logs the steps after its checkpoint, which the local backend
reproduces exactly, so they land on the same points; WANDB_API_KEY / `wandb login` give the key; WANDB_MODE=offline
logs to the run dir only (`wandb sync` uploads later).
"""

from __future__ import annotations

import importlib.util
import json
import secrets
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import msgspec

from backends.errors import UserError
from runner.engine.metrics import metrics_of
from runner.engine.track_common import EXTRAS, default_name, first_line, missing
from runner.recipe.common import Json
from runner.recipe.load import recipe_dict
from runner.recipe.schema import Log, MLflow, Recipe, TensorBoard, Trackio, WandB

WANDB_FILE = "wandb.json"
# A table of the recipe's `log` (runner/recipe/schema.py Log): one tracker's settings.
TrackerTable = WandB | TensorBoard | MLflow | Trackio


class Tracker(Protocol):
    def log(self, row: Json) -> None: ...

    def finish(self, status: str) -> None:
        """status: "success", "interrupted" or "error" (runner/engine/loop.py)."""
        ...


@dataclass(frozen=True)
class Kind:
    """A tracker the `log` table can name: the module it needs (track_common.EXTRAS) and how it starts."""

    module: str  # imported only when a recipe asks for this tracker
    # (its table, the run dir, the resolved recipe, the metrics rows kept before this session) -> a started Tracker
    start: Callable[[TrackerTable, Path, Json, list[Json]], Tracker]


def _wandb(cfg: TrackerTable, path: Path, config: Json, rows: list[Json]) -> Tracker:
    assert isinstance(cfg, WandB)  # Log.wandb's
    return WandbTracker(cfg, path, config)


def _tensorboard(cfg: TrackerTable, path: Path, config: Json, rows: list[Json]) -> Tracker:
    from runner.engine.track_tensorboard import TensorBoardTracker

    assert isinstance(cfg, TensorBoard)
    return TensorBoardTracker(cfg, path, config, rows)


def _mlflow(cfg: TrackerTable, path: Path, config: Json, rows: list[Json]) -> Tracker:
    from runner.engine.track_mlflow import MlflowTracker

    assert isinstance(cfg, MLflow)
    return MlflowTracker(cfg, path, config, rows)


def _trackio(cfg: TrackerTable, path: Path, config: Json, rows: list[Json]) -> Tracker:
    from runner.engine.track_trackio import TrackioTracker

    assert isinstance(cfg, Trackio)
    return TrackioTracker(cfg, path, config, rows)


# The `log` table's trackers, in the order they start.
_STARTS = {"wandb": _wandb, "tensorboard": _tensorboard, "mlflow": _mlflow, "trackio": _trackio}
KINDS: dict[str, Kind] = {name: Kind(module, _STARTS[name]) for name, (_, module, _) in EXTRAS.items()}


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: in sys.modules as None (a test's "not installed")
        return False


def asked(log: Log) -> list[tuple[str, TrackerTable]]:
    """(name, table) of every tracker the `log` table turns on, in KINDS order."""
    return [(name, getattr(log, name)) for name in KINDS if getattr(log, name) is not None]


def check_trackers(log: Log, where: str) -> None:
    """`runner check`: every tracker the recipe asks for is installed (one line naming the extra otherwise)."""
    for name, _ in asked(log):
        if not installed(KINDS[name].module):
            raise UserError(f"{where}: {missing(name)}")


def start_tracker(recipe: Recipe, path: Path) -> Tracker | None:
    """The trackers the recipe's `log` table asks for (None: none), started for a session in run dir `path`
    (`recipe` as config.toml records it), after begin() has dropped the metrics rows this session logs again."""
    tables = asked(recipe.log)
    if not tables:
        return None
    config = recipe_dict(recipe)
    # The rows a session starts from: begin() (runner/engine/rundir.py) has dropped those at or after its first step.
    rows = [m.row for m in metrics_of(path)]
    started: list[tuple[str, Tracker]] = []
    try:
        for name, cfg in tables:
            if not installed(KINDS[name].module):
                raise UserError(missing(name))
            started.append((name, KINDS[name].start(cfg, path, config, rows)))
    except BaseException:
        for _, tracker in started:
            try:
                tracker.finish("error")
            except Exception:  # noqa: BLE001 - the start's own error is the one to report
                pass
        raise
    return Trackers(started)


class Trackers:
    """Every started tracker as one: a row goes to each; one that raises is dropped with one warning on stderr
    (the rows go on to metrics.jsonl and the other trackers)."""

    def __init__(self, trackers: list[tuple[str, Tracker]]):
        self.trackers = list(trackers)

    def _drop(self, name: str, tracker: Tracker, e: Exception, row: Json | None) -> None:
        self.trackers = [(n, t) for n, t in self.trackers if t is not tracker]
        label = EXTRAS[name][0]
        if row is None:
            print(f"warning: log.{name}: {label} failed to close the run ({first_line(e)}); every row is in "
                  "metrics.jsonl", file=sys.stderr, flush=True)
            return
        print(f"warning: log.{name}: {label} failed at step {row.get('step')} ({first_line(e)}); the run goes on "
              "without it, every row is still in metrics.jsonl", file=sys.stderr, flush=True)

    def log(self, row: Json) -> None:
        for name, tracker in list(self.trackers):
            try:
                tracker.log(row)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                self._drop(name, tracker, e, row)

    def finish(self, status: str) -> None:
        for name, tracker in list(self.trackers):
            try:
                tracker.finish(status)
            except Exception as e:  # noqa: BLE001
                self._drop(name, tracker, e, None)


def sweep_log(log: Log, sweep: str, point: str) -> Log:
    """A sweep point's `log` table: its trackers group the sweep's points (W&B and Trackio: group = the sweep's
    name; MLflow: runs nested under a parent run of that name; TensorBoard with a `dir`: a folder per sweep, each
    point's below it). A name the recipe gave gets the point added; a group it gave is kept."""
    changes: dict[str, TrackerTable] = {}
    for name in ("wandb", "mlflow", "trackio"):
        table = getattr(log, name)
        if table is not None:
            changes[name] = msgspec.structs.replace(table, group=table.group or sweep,
                                                    name=f"{table.name}/{point}" if table.name else None)
    if log.tensorboard is not None and log.tensorboard.dir is not None:
        changes["tensorboard"] = msgspec.structs.replace(log.tensorboard,
                                                         name=f"{log.tensorboard.name or sweep}/{point}")
    return msgspec.structs.replace(log, **changes) if changes else log


# ---------------------------------------------------------------- Weights & Biases


class WandbTracker:
    def __init__(self, cfg: WandB, path: Path, config: Json):
        try:
            import wandb
        except ImportError:
            raise UserError(missing("wandb")) from None
        stored_file = path / WANDB_FILE
        stored = json.loads(stored_file.read_text()) if stored_file.exists() else {}
        same = stored.get("project") == cfg.project and stored.get("entity") == cfg.entity and stored.get("id")
        # Another project or entity is another W&B run; the same one continues (a resumed session).
        run_id = stored["id"] if same else secrets.token_hex(4)
        stored_file.write_text(json.dumps({"id": run_id, "project": cfg.project, "entity": cfg.entity}) + "\n")
        # The dir absolute: W&B's service process is shared by every run in this process and keeps the cwd it
        # started in (a relative one landed in an earlier run's folder).
        try:
            self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or default_name(path),
                                  group=cfg.group, tags=list(cfg.tags) or None, config=config, id=run_id,
                                  resume="allow", dir=str(path.resolve()))
        except Exception as e:  # noqa: BLE001 (no key, no network, a bad entity): one line, before the first step
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"log.wandb: could not start the W&B run: {first}") from None
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: Json) -> None:
        self.run.log(row)

    def finish(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "success" else 1)
