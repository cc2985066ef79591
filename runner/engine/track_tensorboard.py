"""TensorBoard: a run's metrics.jsonl rows as TensorBoard event files (`log = {tensorboard = {}}`), written with
tensorboardX (the `tensorboard` extra; TensorBoard itself is needed only to look at them).

- Where: the run dir itself by default, so `tensorboard --logdir runs` names each run by its dir and a sweep's points
  appear as <sweep>/<point>; with `dir`, <dir>/<name> (name: the run dir's path under runs/, a sweep point's
  <sweep>/<point>).
- Each row's numbers are scalars at the row's `step` (tags as tensorboardX cleans them: characters other than
  letters, digits and `_-/.` become `_`, tb_tag()); the resolved recipe, flattened, is the run's hparams (the HPARAMS
  tab compares a sweep's points); every row is flushed as it is logged, so a kill -9 loses none.
- Resume: every session writes its own event file (names sort by the time they were made), which starts with
  TensorBoard's own restart marker, SessionLog.START at the first step metrics.jsonl does not hold (tensorboardX's
  purge_step): TensorBoard's readers drop every earlier point at or after it, so the steps the session logs again
  replace what a killed session wrote instead of doubling it. A folder that holds no event file yet (the tracker
  added on a resume) first gets the rows metrics.jsonl kept.
- TensorBoard has no run status: an interrupted or failed session just ends its file.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from backends.errors import UserError
from runner.engine.track_common import default_name, first_line, flatten, missing, scalars
from runner.recipe.schema import TensorBoard

# tensorboardX's own cleaning of a summary tag (tensorboardX.summary._clean_tag), done here so it is one known rule.
_INVALID = re.compile(r"[^-/\w.]")


def tb_tag(key: str) -> str:
    return _INVALID.sub("_", key).lstrip("/")


def event_dir(cfg: TensorBoard, path: Path) -> Path:
    return path if cfg.dir is None else Path(cfg.dir) / (cfg.name or default_name(path))


def hparam(value: Any) -> Any:
    """A recipe value as an hparam: numbers, strings and booleans as they are, anything else as JSON."""
    return value if isinstance(value, (bool, int, float, str)) else json.dumps(value)


class TensorBoardTracker:
    def __init__(self, cfg: TensorBoard, path: Path, config: dict[str, Any], rows: list[dict[str, Any]]):
        try:
            from tensorboardX import SummaryWriter  # pyright: ignore[reportMissingImports]
            from tensorboardX.summary import hparams  # pyright: ignore[reportMissingImports]
        except ImportError:
            raise UserError(missing("tensorboard")) from None
        folder = event_dir(cfg, path)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"log.tensorboard: cannot write to {folder} ({e.strerror})") from None
        fresh = not any(folder.glob("*tfevents*"))
        # The restart marker: every point at or after the first step metrics.jsonl does not hold is dropped.
        purge = max((int(r["step"]) for r in rows if isinstance(r.get("step"), int)), default=-1) + 1
        # Event files are read in name order, and tensorboardX names them by the second: the suffix orders two made
        # in the same second (and keeps the second from overwriting the first).
        self.writer = SummaryWriter(logdir=str(folder), purge_step=purge, flush_secs=5,
                                    filename_suffix=f".{time.time_ns():020d}")
        try:
            _, ssi, _ = hparams({k: hparam(v) for k, v in flatten(config).items()}, {})
            self.writer._get_file_writer().add_summary(ssi)
            if fresh:
                for row in rows:
                    self._write(row)
            self.writer.flush()
        except Exception as e:  # noqa: BLE001 - before the first step: one line
            self.writer.close()
            raise UserError(f"log.tensorboard: cannot write event files to {folder}: {first_line(e)}") from None

    def _write(self, row: dict[str, Any]) -> None:
        step = row.get("step")
        if not isinstance(step, int):
            return
        for key, value in scalars(row).items():
            self.writer.add_scalar(tb_tag(key), value, global_step=step)

    def log(self, row: dict[str, Any]) -> None:
        self._write(row)
        self.writer.flush()

    def finish(self, status: str) -> None:
        self.writer.close()
