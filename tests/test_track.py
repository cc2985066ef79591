"""Tracking from the recipe's `log` table (runner/engine/track.py): what holds for every tracker without any of them
installed (a missing extra is one line at `runner check`, a tracker that raises mid-run is dropped with one warning and
loses no metrics.jsonl row, a sweep groups its points), and W&B offline (WANDB_MODE=offline; skipped without the wandb
package): the metrics.jsonl rows are logged with `step` as x, the resolved recipe is the config, a resumed run
continues the same W&B run, the API key is written nowhere, and changing only `log` never makes a run dir "hold a
different recipe". TensorBoard, MLflow and Trackio read back with their own readers: tests/test_track_tools.py.

Run: pytest tests/test_track.py   (a few seconds: wandb starts its service process)
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backends.errors import UserError
from backends.fake import FakeBackend
from backends.local.tiny import build_tokenizer
from runner.cli import main
from runner.engine import track
from runner.engine.loop import run
from runner.engine.rundir import open_run_dir, recipe_diff
from runner.engine.track_common import flatten
from runner.recipe.load import dump_recipe
from runner.recipe.schema import Log, Recipe

KEY = "0123456789abcdef0123456789abcdef01234567"


def make_recipe(tmp_path: Path, steps: int, log: dict[str, Any] | None = None) -> Recipe:
    data = tmp_path / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return msgspec.convert({
        "algo": {"kind": "sft", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4, "test_size": 4},
        "lr": 0.05, "max_steps": steps, "eval_every": 2, "save_every": 2, "log_dir": str(tmp_path / "run"),
        **({"log": log} if log is not None else {}),
    }, Recipe)


def test_changing_only_the_log_table_resumes(tmp_path: Path) -> None:
    a = make_recipe(tmp_path, 3)
    b = make_recipe(tmp_path, 3, {"wandb": {"project": "p", "tags": ["x"]}})
    assert recipe_diff(a, b) == []
    run(a, "r", backend=FakeBackend(build_tokenizer()))
    assert open_run_dir(b, "r").note.startswith("resume after checkpoint")


def test_wandb_missing_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(UserError, match=r"^log\.wandb: the wandb package is not installed; pip install wandb"):
        run(make_recipe(tmp_path, 2, {"wandb": {"project": "p"}}), "r", backend=FakeBackend(build_tokenizer()))


@pytest.mark.parametrize(("name", "table", "module", "extra"), [
    ("wandb", {"project": "p"}, "wandb", "pip install wandb (or pip install 'runner[wandb]')"),
    ("tensorboard", {}, "tensorboardX", "pip install 'runner[tensorboard]' (or pip install tensorboardX)"),
    ("mlflow", {"experiment": "e"}, "mlflow", "pip install 'runner[mlflow]' (or pip install mlflow)"),
    ("trackio", {"project": "p"}, "trackio", "pip install 'runner[trackio]' (or pip install trackio)"),
])
def test_a_missing_extra_is_one_line_at_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str], name: str, table: dict[str, Any],
                                               module: str, extra: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes.toml").write_text(dump_recipe("r", make_recipe(tmp_path, 2, {name: table})))
    assert main(["check", "recipes.toml#r"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: recipes.toml#r: log.{name}: the {module} package is not installed; {extra}, or remove "
                   f"the log.{name} table\n")


class Recording:
    """A tracker that keeps what it is sent, and raises on the row of step `fail_at`."""

    def __init__(self, fail_at: int | None = None):
        self.rows: list[dict[str, Any]] = []
        self.status: str | None = None
        self.fail_at = fail_at

    def log(self, row: dict[str, Any]) -> None:
        if row["step"] == self.fail_at:
            raise ConnectionError("tracking server went away\nsecond line")
        self.rows.append(row)

    def finish(self, status: str) -> None:
        self.status = status


def test_a_tracker_that_raises_mid_run_loses_no_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    failing, other = Recording(fail_at=2), Recording()
    for name, tracker in (("mlflow", failing), ("trackio", other)):
        monkeypatch.setitem(track.KINDS, name, track.Kind("json", lambda *_, t=tracker: t))
    run(make_recipe(tmp_path, 4, {"mlflow": {}, "trackio": {"project": "p"}}), "r",
        backend=FakeBackend(build_tokenizer()))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert other.rows == rows and other.status == "success"  # the other tracker got every row
    assert [r["step"] for r in failing.rows] == [0, 1] and failing.status is None  # dropped at step 2
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: log.")]
    assert warnings == ["warning: log.mlflow: MLflow failed at step 2 (ConnectionError: tracking server went away); "
                        "the run goes on without it, every row is still in metrics.jsonl"]


def test_a_tracker_that_cannot_start_stops_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started = Recording()

    def refuse(*_: Any) -> Any:
        raise UserError("log.trackio: could not start the Trackio run: no")

    monkeypatch.setitem(track.KINDS, "tensorboard", track.Kind("json", lambda *_: started))
    monkeypatch.setitem(track.KINDS, "trackio", track.Kind("json", refuse))
    with pytest.raises(UserError, match="could not start the Trackio run"):
        run(make_recipe(tmp_path, 2, {"tensorboard": {}, "trackio": {"project": "p"}}), "r",
            backend=FakeBackend(build_tokenizer()))
    assert started.status == "error" and not started.rows


def test_a_sweep_groups_its_points_in_each_tracker() -> None:
    log = msgspec.convert({"wandb": {"project": "p"}, "tensorboard": {"dir": "tb"}, "mlflow": {},
                           "trackio": {"project": "p", "name": "n", "group": "g"}}, Log)
    point = track.sweep_log(log, "sl_basic", "lr=0.001")
    assert point.wandb is not None and (point.wandb.group, point.wandb.name) == ("sl_basic", None)
    assert point.mlflow is not None and (point.mlflow.group, point.mlflow.name) == ("sl_basic", None)
    assert point.trackio is not None and (point.trackio.group, point.trackio.name) == ("g", "n/lr=0.001")
    assert point.tensorboard is not None and point.tensorboard.name == "sl_basic/lr=0.001"
    # TensorBoard without a dir logs in the run dir, which the sweep already puts under the sweep's dir.
    assert track.sweep_log(msgspec.convert({"tensorboard": {}}, Log), "s", "p").tensorboard == log.tensorboard.__class__()
    assert track.sweep_log(Log(), "s", "p") == Log()


def test_the_recipe_is_flattened_for_the_tools_that_show_flat_keys() -> None:
    assert flatten({"lr": 0.1, "lora": {"rank": 8, "x": {"y": [1, 2]}}, "log": {"tensorboard": {}}}) == {
        "lr": 0.1, "lora.rank": 8, "lora.x.y": [1, 2], "log.tensorboard": {}}


def test_mlflow_credentials_never_come_from_the_recipe() -> None:
    with pytest.raises(msgspec.ValidationError, match="MLFLOW_TRACKING_USERNAME"):
        msgspec.convert({"mlflow": {"tracking_uri": "https://me:secret@mlflow.example.com"}}, Log)
    assert msgspec.convert({"mlflow": {"tracking_uri": "https://mlflow.example.com/a@b"}}, Log).mlflow is not None


def records(path: Path) -> Iterator[Any]:
    """The protobuf records of an offline .wandb file (a LevelDB-style log after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf = path.read_bytes(), 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def logged(run_dir: Path) -> list[tuple[str, list[int], dict[str, Any]]]:
    """(run id, logged `step`s, config) of each offline session under run_dir/wandb, in order."""
    out = []
    for f in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        steps, config, run_id = [], {}, ""
        for r in records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                steps.append(items["step"])
            elif kind == "run":
                run_id = r.run.run_id
                config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
        out.append((run_id, steps, config))
    return out


def test_wandb_offline_logs_rows_and_a_resumed_run_continues_it(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("wandb.proto.wandb_internal_pb2")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", KEY)
    monkeypatch.chdir(tmp_path)
    fb = FakeBackend(build_tokenizer())
    run(make_recipe(tmp_path, 3, {"wandb": {"project": "proj"}}), "r", backend=fb)
    run_dir = tmp_path / "run"
    stored = json.loads((run_dir / "wandb.json").read_text())
    assert stored["project"] == "proj" and stored["id"]
    # Extended by two steps, with another tag (the log table may change): the same W&B run goes on.
    run(make_recipe(tmp_path, 5, {"wandb": {"project": "proj", "tags": ["more"]}}), "r", backend=fb)
    assert json.loads((run_dir / "wandb.json").read_text())["id"] == stored["id"]
    # wandb's service process may still be writing the last session's file when finish() returns: wait for it.
    deadline = time.monotonic() + 120
    sessions = logged(run_dir)
    # Each session ends with its final eval row (SFT's test/nll at step N); extending the run replaces that row.
    while [s[1] for s in sessions] != [[0, 1, 2, 3], [3, 4, 5]] and time.monotonic() < deadline:
        time.sleep(0.2)
        sessions = logged(run_dir)
    assert [(s[0], s[1]) for s in sessions] == [(stored["id"], [0, 1, 2, 3]), (stored["id"], [3, 4, 5])]
    config = sessions[0][2]
    assert config["lr"] == 0.05 and config["algo"]["kind"] == "sft" and config["max_steps"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    # The key is the environment's: nothing in the run dir holds it.
    assert not [p for p in run_dir.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    # Another project is another W&B run.
    run(make_recipe(tmp_path, 6, {"wandb": {"project": "other"}}), "r", backend=fb)
    assert json.loads((run_dir / "wandb.json").read_text())["id"] != stored["id"]
