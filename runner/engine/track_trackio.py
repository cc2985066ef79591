"""Trackio: a run's metrics.jsonl rows in a Trackio project (`log = {trackio = {project = ...}}`), Hugging Face's
local-first tracker: a SQLite store under TRACKIO_DIR (default ~/.cache/huggingface/trackio), `trackio show` to look.

- Each row's numbers are logged at the row's `step`; the resolved recipe, flattened, is the run's config; the run
  is named by the run dir's path under runs/ (`name`), grouped by `group` (a sweep's name for its points).
- Resume: the run's project, name and id are kept in trackio.json; a session with the same project and name
  continues it (trackio's resume="allow", which finds a run by its name). Trackio keeps every point it is sent and
  has no way to delete one, so a session first reads what the run holds from Trackio's local store: a point it
  holds already (a step the killed session logged after its checkpoint) is not sent again, and a row metrics.jsonl
  kept that the store lacks (Trackio writes in batches every half second, so a kill -9 can lose the last ones; or
  the tracker was added on a resume) is sent. Logging to a Space or server (TRACKIO_SPACE_ID, TRACKIO_SERVER_URL)
  works too, but the local store has nothing to read there, so re-logged steps are sent again.
- Trackio has no run status: an interrupted or failed session raises a Trackio alert (warn / error) at its last
  step, which the dashboard lists.
- Trackio's own CPU/GPU monitors stay off: the run's points are metrics.jsonl's.
"""

from __future__ import annotations

from pathlib import Path

from backends.errors import UserError
from runner.engine.track_common import default_name, first_line, flatten, missing, read_json, scalars, write_json
from runner.recipe.common import Json
from runner.recipe.schema import Trackio

TRACKIO_FILE = "trackio.json"
# Keys Trackio renames (trackio.utils.RESERVED_KEYS); `step` is the x axis, the rest are left as they are.
RESERVED = ("project", "run", "timestamp", "step", "time", "metrics")


class TrackioTracker:
    def __init__(self, cfg: Trackio, path: Path, config: Json, rows: list[Json]):
        try:
            import trackio  # pyright: ignore[reportMissingImports]
            from trackio.sqlite_storage import SQLiteStorage  # pyright: ignore[reportMissingImports]
        except ImportError:
            raise UserError(missing("trackio")) from None
        self.trackio = trackio
        name = cfg.name or default_name(path)
        stored_file = path / TRACKIO_FILE
        stored = read_json(stored_file)
        same = stored.get("project") == cfg.project and stored.get("name") == name
        try:
            self.run = trackio.init(project=cfg.project, name=name, group=cfg.group, config=flatten(config),
                                    resume="allow" if same else "never", auto_log_cpu=False, auto_log_gpu=False,
                                    embed=False)
        except Exception as e:  # noqa: BLE001 (a bad project name, a Space that cannot be made): one line
            raise UserError(f"log.trackio: could not start the Trackio run: {first_line(e)}") from None
        write_json(stored_file, {"project": cfg.project, "name": name, "id": self.run.id})
        held: set[tuple[str, int]] = set()
        if same:
            for logged in SQLiteStorage.get_logs(cfg.project, name, run_id=self.run.id):
                held |= {(k, logged["step"]) for k in logged if k not in ("step", "timestamp")}
        last = max((int(r["step"]) for r in rows if isinstance(r.get("step"), int)), default=-1)
        self.held = {(key, step) for key, step in held if step > last}
        self.last_step = 0
        for row in rows:  # kept rows the store lacks
            self._send(row, skip=held)

    def _send(self, row: Json, skip: set[tuple[str, int]]) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        self.last_step = step
        metrics = {k: v for k, v in scalars(row).items() if (k, step) not in skip and k not in RESERVED}
        if metrics:
            self.run.log(metrics, step=step)

    def log(self, row: Json) -> None:
        self._send(row, skip=self.held)

    def finish(self, status: str) -> None:
        if status != "success":
            level = self.trackio.AlertLevel.ERROR if status == "error" else self.trackio.AlertLevel.WARN
            self.run.alert(title=f"run {status}", text=f"the session ended ({status}) at step {self.last_step}; "
                           "`runner run` of the same recipe resumes it", level=level, step=self.last_step)
        # The run's own finish (trackio.finish() finds the run in a context variable, which the loop's end may not
        # see): waits for its last batch to be written.
        from trackio.context_vars import current_run  # pyright: ignore[reportMissingImports]

        self.run.finish()
        if current_run.get() is self.run:
            current_run.set(None)
