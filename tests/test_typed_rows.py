"""checkpoints.jsonl and metrics.jsonl rows read as structs (runner/engine/checkpoints.py Checkpoint,
runner/engine/metrics.py MetricsRow) at their one reader: the typed fields, the row itself kept whole (the
algorithm's keys, a byte-identical rewrite), and a hand-edited row that cannot be read is one UserError naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backends.errors import UserError
from runner.engine.checkpoints import CHECKPOINTS, Checkpoint, SavedCost, checkpoints_of
from runner.engine.metrics import METRICS, MetricsRow, metrics_of


def test_a_checkpoint_row_is_typed_and_kept_whole(tmp_path: Path) -> None:
    row = {"name": "000002", "step": 1, "next_step": 2, "state_path": "checkpoints/weights/000002",
           "sampler_path": "tinker://x/sampler_weights/000002", "epoch": 0, "batch": 2, "row": 7,
           "cost": {"prefill": 5, "sample": 0, "train": 9, "usd": 0.5}, "time": 1.0, "paths": "run"}
    (tmp_path / CHECKPOINTS).write_text(json.dumps(row) + "\n")
    [c] = checkpoints_of(tmp_path)
    assert (c.name, c.step, c.next_step) == ("000002", 1, 2)
    assert c.state_path == str(tmp_path / "checkpoints/weights/000002")  # run-relative: resolved
    assert c.sampler_path == "tinker://x/sampler_weights/000002"
    assert c.cost == SavedCost(train=9, sample=0, prefill=5, usd=0.5)
    assert c.row["batch"] == 2 and c.row["row"] == 7  # the algorithm's keys ride along, even one named "row"
    assert Checkpoint.of({"name": "final", "next_step": 3}).cost is None


@pytest.mark.parametrize("row", [{"name": "final"}, {"name": "final", "next_step": "3"}, {"next_step": 3}])
def test_a_checkpoint_row_runner_cannot_read_is_one_error(tmp_path: Path, row: dict[str, object]) -> None:
    (tmp_path / CHECKPOINTS).write_text(json.dumps({"name": "000001", "next_step": 1}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(UserError, match=r"checkpoints\.jsonl: row 2: a checkpoint row that runner cannot read"):
        checkpoints_of(tmp_path)


def test_metrics_rows_are_typed_and_kept_whole(tmp_path: Path) -> None:
    lines = [{"step": 0, "loss": 1.5, "time/total": 2.5}, {"step": 1, "loss": 1.0, "row": 3.0}]
    (tmp_path / METRICS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    rows = metrics_of(tmp_path)
    assert [(r.step, r.time_total) for r in rows] == [(0, 2.5), (1, 0.0)]
    assert [r.row for r in rows] == lines
    with pytest.raises(UserError, match="row 1: a metrics row"):
        MetricsRow.of({"loss": 1.0}, f"{tmp_path / METRICS}: row 1")
    assert metrics_of(tmp_path / "nowhere") == []
