"""TensorBoard: a run's metrics.jsonl rows as TensorBoard event files (`log = {tensorboard = {}}`), written with
tensorboardX (the `tensorboard` extra; TensorBoard itself is needed only to look at them).

- Where: the run dir itself by default, so `tensorboard --logdir runs` names each run by its dir and a sweep's points
  appear as <sweep>/<point>; with `dir`, <dir>/<name> (name: the run dir's path under runs/, a sweep point's
  <sweep>/<point>).
- Each row's numbers are scalars at the row's `step`, one event per row (tags as tensorboardX cleans them: characters
  other than letters, digits and `_-/.` become `_`, tb_tag()); the resolved recipe, flattened, is the run's hparams
  (the HPARAMS tab compares a sweep's points). Every row is flushed as it is logged.
- Resume: metrics.jsonl is what the run holds, so every session writes a new event file that holds all of it:
  TensorBoard's restart marker (SessionLog.START at step 0, tensorboardX's purge_step, which makes TensorBoard's
  readers drop every point of the older files), then the rows metrics.jsonl kept, then the session's own; once
  that file is written, the older event files of the folder are removed. So a step a killed session logged after
  its checkpoint, which the resume logs again, is one point, and so is a row a kill -9 cut in half (metrics.jsonl
  is written first). Rewriting the kept rows costs one event per row at each resume.
- TensorBoard has no run status: an interrupted or failed session just ends its file.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from backends.errors import UserError
from runner.engine.track_common import default_name, first_line, flatten, missing, scalars
from runner.recipe.common import Json
from runner.recipe.schema import TensorBoard

# tensorboardX's own cleaning of a summary tag (tensorboardX.summary._clean_tag), done here so it is one known rule.
_INVALID = re.compile(r"[^-/\w.]")


def tb_tag(key: str) -> str:
    return _INVALID.sub("_", key).lstrip("/")


def event_dir(cfg: TensorBoard, path: Path) -> Path:
    return path if cfg.dir is None else Path(cfg.dir) / (cfg.name or default_name(path))


def hparam(value: object) -> bool | int | float | str:
    """A recipe value as an hparam: numbers, strings and booleans as they are, anything else as JSON."""
    return value if isinstance(value, (bool, int, float, str)) else json.dumps(value)


class TensorBoardTracker:
    def __init__(self, cfg: TensorBoard, path: Path, config: Json, rows: list[Json]):
        try:
            from tensorboardX import SummaryWriter  # pyright: ignore[reportMissingImports]
            from tensorboardX.proto.summary_pb2 import Summary  # pyright: ignore[reportMissingImports, reportAttributeAccessIssue]
            from tensorboardX.summary import hparams  # pyright: ignore[reportMissingImports]
        except ImportError:
            raise UserError(missing("tensorboard")) from None
        folder = event_dir(cfg, path)
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"log.tensorboard: cannot write to {folder} ({e.strerror})") from None
        older = sorted(folder.glob("events.out.tfevents.*"))
        # Event files are read in name order, and tensorboardX names them by the second: the suffix orders two made
        # in the same second (and keeps the second from overwriting the first).
        self.writer = SummaryWriter(logdir=str(folder), purge_step=0, flush_secs=5,
                                    filename_suffix=f".{time.time_ns():020d}")
        self.Summary = Summary
        try:
            _, ssi, _ = hparams({k: hparam(v) for k, v in flatten(config).items()}, {})
            file_writer = self.writer._get_file_writer()
            file_writer.add_summary(ssi)
            for row in rows:
                self._write(row)
            self.writer.flush()
        except Exception as e:  # noqa: BLE001 - before the first step: one line
            self.writer.close()
            raise UserError(f"log.tensorboard: cannot write event files to {folder}: {first_line(e)}") from None
        for old in older:  # what they held is in the new file, or was dropped from metrics.jsonl
            old.unlink(missing_ok=True)

    def _write(self, row: Json) -> None:
        step = row.get("step")
        values = scalars(row)
        if isinstance(step, int) and values:
            summary = self.Summary(value=[self.Summary.Value(tag=tb_tag(k), simple_value=v) for k, v in values.items()])
            self.writer._get_file_writer().add_summary(summary, global_step=step)

    def log(self, row: Json) -> None:
        self._write(row)
        self.writer.flush()

    def finish(self, status: str) -> None:
        self.writer.close()
