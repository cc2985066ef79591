"""checkpoints.jsonl rows (runner/engine/checkpoints.py): the path fields read as a struct (RowPaths), local paths
made run-relative on write and joined back on read, a service's URL and a row's other fields left as they are."""

from __future__ import annotations

from pathlib import Path

from runner.engine.checkpoints import RowPaths, relative_row, resolve_row


def test_row_paths_read_the_path_fields_only() -> None:
    row = {"name": "000002", "step": 2, "state_path": "/r/checkpoints/weights/000002",
           "sampler_path": "tinker://run/sampler_weights/000002", "paths": "run"}
    paths = RowPaths.of(row)
    assert paths == RowPaths("/r/checkpoints/weights/000002", "tinker://run/sampler_weights/000002", "run")
    assert paths.local() == {"state_path": "/r/checkpoints/weights/000002"}  # a URL is not local
    assert RowPaths.of({"state_path": 5, "step": 1}) == RowPaths()  # a hand-edited row: nothing to map
    assert RowPaths.of({"step": 1}).local() == {}


def test_a_row_round_trips_through_the_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints" / "weights").mkdir(parents=True)
    row = {"name": "000002", "step": 2, "next_step": 3, "state_path": str(run / "checkpoints/weights/000002"),
           "sampler_path": "tinker://x/sampler_weights/000002", "cost": {"prefill": 1}}
    stored = relative_row(row, run)
    assert stored == {**row, "state_path": "checkpoints/weights/000002", "paths": "run"}
    moved = tmp_path / "moved"
    run.rename(moved)
    assert resolve_row(stored, moved) == {**stored, "state_path": str(moved / "checkpoints/weights/000002")}
    odd = {"state_path": 5, "step": 1}
    assert relative_row(odd, moved) == odd and resolve_row(odd, moved) == odd
