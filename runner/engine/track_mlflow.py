"""MLflow: a run's metrics.jsonl rows as an MLflow run's metrics (`log = {mlflow = {experiment = ..., tracking_uri =
...}}`), through MlflowClient (no global MLflow state is set: another MLflow run in the same process is untouched).

- Where: `tracking_uri` (default MLFLOW_TRACKING_URI, else MLflow's own default, ./mlflow.db), experiment
  `experiment` (default MLFLOW_EXPERIMENT_NAME, else "Default"); credentials from MLflow's environment variables.
- Each row's numbers are metrics at the row's `step` (keys as MLflow allows them: characters other than letters,
  digits and `_-./ ` become `_`, mlflow_key()); the resolved recipe, flattened, is the run's params. MLflow params
  cannot change, so a key whose value a resumed session changed (max_steps, when a run is extended) keeps its first
  value and the new one is the tag `runner.changed.<key>`.
- Resume: the run id is kept in mlflow.json; a session in the same store and experiment continues that run (status
  RUNNING again). MLflow keeps every point it is sent and cannot delete one, so a session first reads the run's
  metric history: a point MLflow holds already (a step the killed session logged after its checkpoint, which the
  local backend reproduces exactly) is not sent again, and a row metrics.jsonl kept that MLflow lacks (the tracker
  added on a resume) is sent. On a backend that does not reproduce a step exactly, MLflow keeps the first value.
- Status: FINISHED, KILLED (interrupted: Ctrl-C, a budget) or FAILED; a kill -9 leaves it RUNNING until the resume.
- Sweeps: the points of a sweep (group) are nested under a parent run named by it (tag mlflow.parentRunId), found
  or made once per experiment, and tagged runner.sweep.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

from backends.errors import UserError
from runner.engine.track_common import default_name, first_line, flatten, missing, read_json, scalars, write_json
from runner.recipe.common import Json
from runner.recipe.schema import MLflow

MLFLOW_FILE = "mlflow.json"
STATUS = {"success": "FINISHED", "interrupted": "KILLED", "error": "FAILED"}
# MLflow's limits (mlflow.utils.validation): values longer are cut, batches split.
MAX_PARAM, MAX_TAG, PARAMS_PER_BATCH, METRICS_PER_BATCH = 6000, 8000, 100, 1000
_INVALID = re.compile(r"[^/\w.\- ]")


def mlflow_key(key: str) -> str:
    return _INVALID.sub("_", key)


def param_value(value: object) -> str:
    return (value if isinstance(value, str) else json.dumps(value))[:MAX_PARAM]


@contextlib.contextmanager
def _locked(uri: str) -> Iterator[None]:
    """An exclusive lock on this machine for the store at `uri` (a file in the temp dir, named by its hash)."""
    digest = hashlib.sha1(uri.encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"runner-mlflow-{digest}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


T = TypeVar("T")


def _chunks(items: list[T], n: int) -> Iterator[list[T]]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


class MlflowTracker:
    def __init__(self, cfg: MLflow, path: Path, config: Json, rows: list[Json]):
        try:
            import mlflow  # pyright: ignore[reportMissingImports]
            from mlflow.entities import Metric, Param, RunTag  # pyright: ignore[reportMissingImports]
            from mlflow.tracking import MlflowClient  # pyright: ignore[reportMissingImports]
        except ImportError:
            raise UserError(missing("mlflow")) from None
        self.Metric, self.Param, self.RunTag = Metric, Param, RunTag
        self.uri = cfg.tracking_uri or "MLflow's default tracking URI"
        try:
            self.uri = cfg.tracking_uri or mlflow.get_tracking_uri()
            # One start at a time per store on this machine: a sweep's points start together, and two processes
            # that make a new sqlite store at once break its schema migration; they also share one parent run.
            with _locked(self.uri):
                self.client = MlflowClient(tracking_uri=self.uri)
                self._start(cfg, path, config, rows)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 (no server, a bad URI, refused credentials): one line
            raise UserError(f"log.mlflow: could not start the MLflow run at {self.uri}: {first_line(e)}") from None

    def _start(self, cfg: MLflow, path: Path, config: Json, rows: list[Json]) -> None:
        client, Param, RunTag = self.client, self.Param, self.RunTag
        experiment_id = self._experiment(cfg.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default")
        stored_file = path / MLFLOW_FILE
        stored = read_json(stored_file)
        run = None
        if stored.get("tracking_uri") == self.uri and stored.get("experiment_id") == experiment_id:
            with contextlib.suppress(Exception):  # deleted, or never made it to this store: a new run
                run = client.get_run(stored["run_id"])
            if run is not None and run.info.lifecycle_stage != "active":
                run = None
        name = cfg.name or default_name(path)
        tags = {"runner.run_dir": str(path.resolve())}
        if cfg.group:
            tags |= {"runner.sweep": cfg.group, "mlflow.parentRunId": self._parent(experiment_id, cfg.group)}
        if run is None:
            run = client.create_run(experiment_id, run_name=name, tags=tags)
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run_id = run.info.run_id
        write_json(stored_file, {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": self.uri})
        have = run.data.params
        params = {mlflow_key(k): param_value(v) for k, v in flatten(config).items()}
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])
        new = [Param(k, v) for k, v in params.items() if k not in have]
        changed = [RunTag(f"runner.changed.{k}", v[:MAX_TAG]) for k, v in params.items()
                   if k in have and have[k] != v]
        for chunk in _chunks([*new, *changed], PARAMS_PER_BATCH):
            client.log_batch(run_id, params=[p for p in chunk if isinstance(p, Param)],
                             tags=[t for t in chunk if isinstance(t, RunTag)])
        # What the run holds: (key, step) of every point, from the run's metric history.
        held = {(key, m.step) for key in run.data.metrics for m in client.get_metric_history(run_id, key)}
        last = max((int(r["step"]) for r in rows if isinstance(r.get("step"), int)), default=-1)
        # Points after the kept rows: the ones this session logs again are not sent twice.
        self.held = {(key, step) for key, step in held if step > last}
        for row in rows:  # kept rows the run lacks
            self._send(row, skip=held)

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            if found.lifecycle_stage != "active":
                raise UserError(f"log.mlflow: experiment {name!r} is deleted in {self.uri}; restore it or pick "
                                "another experiment")
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # another process made it first
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def _parent(self, experiment_id: str, group: str) -> str:
        """The parent run of a sweep's points: found by its tags, or made (the store is locked: points started at once
        share one)."""
        found = self.client.search_runs([experiment_id], filter_string="tags.`runner.role` = 'sweep'",
                                        order_by=["attributes.start_time ASC"], max_results=1000)
        for run in found:
            if run.data.tags.get("runner.sweep") == group:
                return run.info.run_id
        run = self.client.create_run(experiment_id, run_name=group, tags={"runner.role": "sweep", "runner.sweep": group})
        self.client.set_terminated(run.info.run_id, "FINISHED")
        return run.info.run_id

    def _send(self, row: Json, skip: set[tuple[str, int]]) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        ms = int(time.time() * 1000)
        metrics = [self.Metric(k, v, ms, step) for k, v in ((mlflow_key(k), v) for k, v in scalars(row).items())
                   if (k, step) not in skip]
        for chunk in _chunks(metrics, METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk)

    def log(self, row: Json) -> None:
        self._send(row, skip=self.held)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))
