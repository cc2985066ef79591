"""W&B tracking from the recipe's `log` table, offline (WANDB_MODE=offline; skipped without the wandb package):
the metrics.jsonl rows are logged with `step` as x, the resolved recipe is the config, a resumed run continues
the same W&B run, the API key is written nowhere, and changing only `log` never makes a run dir "hold a
different recipe".

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
from runner.engine.loop import run
from runner.engine.rundir import open_run_dir, recipe_diff
from runner.recipe.schema import Recipe

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
    deadline = time.monotonic() + 30
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
