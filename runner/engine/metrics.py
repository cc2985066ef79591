"""metrics.jsonl's rows: one per finished step ({"step": 0, "train_mean_nll": ..., "optim/lr": ...}), then the
algorithm's final row, if it has one, at step = total steps. The run dir (runner/engine/rundir.py) writes them and,
when a session resumes, keeps those before its first step; the trackers (runner/engine/track.py) start from the
kept rows. Both read the file here (`metrics_of`)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from backends.errors import UserError
from runner.engine.log import read_jsonl
from runner.recipe.common import Json

METRICS = "metrics.jsonl"


class MetricsRow(msgspec.Struct, frozen=True, kw_only=True):
    """One row, typed where runner reads it by name; `row` is the row itself (what the trackers are sent and a
    rewrite of the file writes back, byte for byte)."""

    step: int
    time_total: float = msgspec.field(default=0.0, name="time/total")  # wall seconds of the run up to this row
    row: Json = {}

    @staticmethod
    def of(row: Json, where: str = METRICS) -> MetricsRow:
        """The typed row (UserError, naming `where`, for a row without an integer step: a hand-edited file)."""
        try:
            typed = msgspec.convert({k: v for k, v in row.items() if k in _READ_METRICS}, MetricsRow)
        except msgspec.ValidationError as e:
            raise UserError(f"{where}: a metrics row that runner cannot read ({e}): fix or remove it") from None
        return msgspec.structs.replace(typed, row=row)


def metrics_of(run_path: Path) -> list[MetricsRow]:
    """metrics.jsonl's rows, typed ([] when there is no file yet)."""
    where = run_path / METRICS
    return [MetricsRow.of(r, f"{where}: row {i}") for i, r in enumerate(read_jsonl(where), 1)]


# The keys converted (the row's other keys, a metric named "row" included, stay in `row` alone).
_READ_METRICS = frozenset(f.encode_name for f in msgspec.structs.fields(MetricsRow) if f.name != "row")
