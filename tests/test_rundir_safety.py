"""Run-dir safety (issue 22): one writer per run dir, a data fingerprint checked on resume, run-relative checkpoint
paths (moved and copied run dirs), falling back to the newest checkpoint that loads, stale temp dirs, disk errors as
one line with metrics appends that never tear, the finite-loss guard and zero trained tokens.

Each test reproduces one failure of the issue. The fake backend keeps them fast; the disk-full checkpoint test uses
the local backend's real save (tiny model).

Run: pytest tests/test_rundir_safety.py   (about 15 s on 2 cores)
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from backends.errors import UserError
from backends.fake import FakeBackend
from backends.local.tiny import build_tokenizer
from runner.engine.log import append_jsonl, read_jsonl
from runner.engine.loop import run
from runner.engine.rundir import (
    CHECKPOINTS,
    FINGERPRINT,
    LOCK,
    METRICS,
    fingerprint,
    fingerprint_changed,
    open_run_dir,
    read_checkpoints,
)
from runner.recipe.schema import Recipe

TOK = build_tokenizer()
ROOT = Path(__file__).resolve().parents[1]


def write_data(path: Path, n: int = 40, answer: int = 7) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer {i * answer % 13}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_recipe(tmp_path: Path, run_dir: str = "run", **over: Any) -> Recipe:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_data(data)
    algo = {"kind": "sft", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4, "test_size": 8,
            **over.pop("algo", {})}
    raw = {"algo": algo, "lr": 0.05, "log_dir": str(tmp_path / run_dir), "eval_every": 0, "save_every": 2, **over}
    return msgspec.convert(raw, Recipe)


def fake(run_dir: Path, **kw: Any) -> FakeBackend:
    """A fake backend whose states are files in the run dir (as the local backend's), so paths are real."""
    return FakeBackend(TOK, storage_dir=run_dir / "checkpoints", **kw)


def steps_of(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / METRICS)]


def clean(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


# ---------------------------------------------------------------- one writer per run dir

def test_second_writer_is_refused_naming_the_holders_pid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: two `runner run` on one log_dir both ran and interleaved metrics.jsonl. Now the second exits 2
    with one line naming the first's pid; once the holder is gone (even killed), the dir opens again."""
    recipe = make_recipe(tmp_path, max_steps=2)
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from runner.engine.rundir import RunLock
            lock = RunLock(Path({str(run_dir)!r}))
            print("locked", flush=True)
            time.sleep(60)
        """)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"run dir {run_dir} is in use by another run \(pid {holder.pid}\)"):
            run(recipe, "r", backend=fake(run_dir))
        # The CLI: exit 2, one line.
        from runner.cli import main
        from runner.recipe.load import dump_recipe

        (tmp_path / "r.toml").write_text(dump_recipe("r", recipe))
        assert main(["run", f"{tmp_path / 'r.toml'}#r"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {tmp_path / 'r.toml'}#r: run dir {run_dir} is in use by another run (pid {holder.pid}); wait for it to "
                       "finish, stop it, or set another log_dir"]
    finally:
        holder.kill()
        holder.wait()
    assert not (run_dir / METRICS).exists()  # the refused run wrote nothing
    run(recipe, "r", backend=fake(run_dir))  # a killed holder's lock is gone with it
    assert steps_of(run_dir) == [0, 1]


def test_lock_is_held_for_the_run_and_released_after(tmp_path: Path) -> None:
    recipe = make_recipe(tmp_path, max_steps=2)
    first = open_run_dir(recipe, "r")
    with pytest.raises(UserError, match=f"in use by another run \\(pid {os.getpid()}\\)"):
        open_run_dir(recipe, "r")
    first.end("success")
    open_run_dir(recipe, "r").end("success")
    assert open_run_dir(recipe, "r", dry_run=True).lock is None  # a dry run locks nothing


def test_a_file_system_without_locks_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run(make_recipe(tmp_path, max_steps=2), "r", backend=fake(tmp_path / "run"))
    assert steps_of(tmp_path / "run") == [0, 1]
    assert f"warning: cannot lock {tmp_path / 'run' / LOCK} (No locks available)" in capsys.readouterr().err


# ---------------------------------------------------------------- data fingerprint

def test_edited_data_is_refused_on_resume_and_force_resumes(tmp_path: Path) -> None:
    """Before: a data file whose rows were edited (same count) between kill and resume resumed silently."""
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, max_steps=2), "r", backend=fake(run_dir))
    assert json.loads((run_dir / FINGERPRINT).read_text())["files"] == {
        str(tmp_path / "data.jsonl"): fingerprint(make_recipe(tmp_path))["files"][str(tmp_path / "data.jsonl")]}
    write_data(tmp_path / "data.jsonl", answer=5)  # same number of rows, other answers
    with pytest.raises(UserError, match=rf"data file {tmp_path / 'data.jsonl'} changed since it trained; .*--force"):
        run(make_recipe(tmp_path, max_steps=4), "r", backend=fake(run_dir))
    assert steps_of(run_dir) == [0, 1]
    run(make_recipe(tmp_path, max_steps=4), "r", backend=fake(run_dir), force=True)
    assert steps_of(run_dir) == [0, 1, 2, 3]
    run(make_recipe(tmp_path, max_steps=5), "r", backend=fake(run_dir))  # --force recorded the new data


def test_fingerprint_covers_target_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `pkg.mod:fn` target's source file is part of the fingerprint: editing it is a change."""
    (tmp_path / "mydata_fp.py").write_text("def rows():\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = make_recipe(tmp_path, algo={"data": {"kind": "python", "target": "mydata_fp:rows"}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / FINGERPRINT).write_text(json.dumps(fingerprint(recipe)))
    assert set(fingerprint(recipe)["targets"]) == {"mydata_fp:rows"}
    assert fingerprint_changed(run_dir, recipe) is None
    (tmp_path / "mydata_fp.py").write_text("def rows():\n    return [1]\n")
    assert fingerprint_changed(run_dir, recipe) == "the source of mydata_fp:rows changed"


# ---------------------------------------------------------------- checkpoint paths

def test_checkpoint_rows_are_run_relative_and_a_moved_dir_resumes(tmp_path: Path) -> None:
    """Before: absolute paths in checkpoints.jsonl, so a moved run dir could not resume."""
    run(make_recipe(tmp_path, "old", max_steps=3), "r", backend=fake(tmp_path / "old"))
    rows = read_jsonl(tmp_path / "old" / CHECKPOINTS)
    assert [r["state_path"] for r in rows] == ["checkpoints/fake:__0_weights_000002.npz",
                                               "checkpoints/fake:__0_weights_final.npz"]
    assert all(r["paths"] == "run" for r in rows)
    (tmp_path / "old").rename(tmp_path / "moved")
    run(make_recipe(tmp_path, "moved", max_steps=5), "r", backend=fake(tmp_path / "moved"))
    assert steps_of(tmp_path / "moved") == [0, 1, 2, 3, 4]
    run(make_recipe(tmp_path, "straight", max_steps=3), "r", backend=fake(tmp_path / "straight"))
    run(make_recipe(tmp_path, "straight", max_steps=5), "r", backend=fake(tmp_path / "straight"))
    assert clean(read_jsonl(tmp_path / "moved" / METRICS)) == clean(read_jsonl(tmp_path / "straight" / METRICS))


def test_a_copied_dir_resumes_from_its_own_files_old_absolute_rows_included(tmp_path: Path) -> None:
    """Before: a copy resumed from the original's files. Rows written before run-relative paths (absolute) are
    mapped onto the copy's own checkpoints/ too."""
    run(make_recipe(tmp_path, "orig", max_steps=3), "r", backend=fake(tmp_path / "orig"))
    ckpts = tmp_path / "orig" / CHECKPOINTS
    legacy = [{k: v for k, v in r.items() if k != "paths"} | {"state_path": str(tmp_path / "orig" / r["state_path"]),
                                                              "sampler_path": str(tmp_path / "orig" / r["sampler_path"])}
              for r in read_jsonl(ckpts)]
    ckpts.write_text("".join(json.dumps(r) + "\n" for r in legacy))  # as an older runner wrote them
    assert read_checkpoints(tmp_path / "orig")[-1]["state_path"] == legacy[-1]["state_path"]
    shutil.copytree(tmp_path / "orig", tmp_path / "copy")
    assert read_checkpoints(tmp_path / "copy")[-1]["state_path"] == str(
        tmp_path / "copy" / "checkpoints" / "fake:__0_weights_final.npz")
    shutil.rmtree(tmp_path / "orig" / "checkpoints")  # the copy must not need the original's files
    run(make_recipe(tmp_path, "copy", max_steps=5), "r", backend=fake(tmp_path / "copy"))
    assert steps_of(tmp_path / "copy") == [0, 1, 2, 3, 4]


def test_resume_falls_back_to_the_newest_checkpoint_that_loads(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a corrupt last checkpoint failed every resume. Now it is skipped, saying so in one line."""
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, max_steps=4), "r", backend=fake(run_dir))
    final = run_dir / "checkpoints" / "fake:__0_weights_final.npz"
    final.unlink()  # the newest state is gone (a disk that lost it)
    capsys.readouterr()
    run(make_recipe(tmp_path, max_steps=6), "r", backend=fake(run_dir))
    err = capsys.readouterr().err
    assert "checkpoint 'final' does not load (" in err and "trying '000002' (after 2 steps)" in err
    assert "resuming from checkpoint '000002' (after 2 steps), the newest that loads" in err
    assert steps_of(run_dir) == [0, 1, 2, 3, 4, 5]


def test_stale_temp_dirs_of_a_failed_save_are_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, max_steps=2), "r", backend=fake(run_dir))
    stale = run_dir / "checkpoints" / "weights" / ".000004.k2j3h4x9"
    stale.mkdir(parents=True)
    (stale / "adapter.bin").write_bytes(b"half")
    (run_dir / "config.toml.tmp").write_text("half")
    open_run_dir(make_recipe(tmp_path, max_steps=4), "r").end("success")
    assert not stale.exists() and not (run_dir / "config.toml.tmp").exists()
    assert "removed 2 temp folder(s) left by an interrupted save" in capsys.readouterr().err


# ---------------------------------------------------------------- disk errors

def test_disk_full_appending_metrics_is_one_line_and_never_tears(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a torn last line and a traceback. The failed append is cut back off; the resume is exact."""
    run_dir = tmp_path / "run"
    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(METRICS):
            calls["n"] += 1
            if calls["n"] == 4:  # the 4th row: half of it lands, then the disk is full
                real_write(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(UserError, match=rf"^disk full writing {run_dir / METRICS} \(No space left on device\)"):
        run(make_recipe(tmp_path, max_steps=6, depth=0), "r", backend=fake(run_dir))
    monkeypatch.setattr(os, "write", real_write)
    text = (run_dir / METRICS).read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [0, 1, 2]
    run(make_recipe(tmp_path, max_steps=6, depth=0), "r", backend=fake(run_dir))
    run(make_recipe(tmp_path, "straight", max_steps=6, depth=0), "r", backend=fake(tmp_path / "straight"))
    assert clean(read_jsonl(run_dir / METRICS)) == clean(read_jsonl(tmp_path / "straight" / METRICS))


def test_the_next_run_on_a_full_disk_is_one_line_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the run after a disk-full crash was a traceback (ENOSPC) as soon as it wrote anything."""
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, max_steps=2), "r", backend=fake(run_dir))

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)  # the lock file's pid: the first thing a run writes
    with pytest.raises(UserError, match=rf"^disk full writing {run_dir / LOCK} \(No space left on device\)"):
        run(make_recipe(tmp_path, max_steps=4), "r", backend=fake(run_dir))
    monkeypatch.undo()
    monkeypatch.setattr(os, "replace", full)  # an atomic rewrite (config.toml) that cannot land
    with pytest.raises(UserError, match=rf"^disk full writing {run_dir / 'config.toml'} "):
        run(make_recipe(tmp_path, max_steps=4), "r", backend=fake(run_dir))
    monkeypatch.undo()
    assert not list(run_dir.glob("*.tmp"))  # the failed rewrite's temp file is gone
    run(make_recipe(tmp_path, max_steps=4), "r", backend=fake(run_dir))
    assert steps_of(run_dir) == [0, 1, 2, 3]


def test_a_torn_last_line_from_an_old_crash_is_repaired_on_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, max_steps=2), "r", backend=fake(run_dir))
    with open(run_dir / METRICS, "a") as f:
        f.write('{"step": 2, "train_mean_nl')  # an older version's crash mid-write
    run(make_recipe(tmp_path, max_steps=4), "r", backend=fake(run_dir))
    lines = (run_dir / METRICS).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]


def test_disk_full_saving_a_checkpoint_is_one_line_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `RuntimeError: [enforce fail at inline_container.cc:672]` (torch.save on a full disk), then a
    traceback on the next run. The local backend's real save, with torch.save failing as it does on a full disk."""
    import torch

    real_save = torch.save
    left = {"n": 1}  # torch.save writes a state's optimizer: the first checkpoint saves, the second fails

    def full_disk(*args: Any, **kwargs: Any) -> Any:
        left["n"] -= 1
        if left["n"] < 0:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file "
                               "data/0: file write failed")
        return real_save(*args, **kwargs)

    recipe = make_recipe(tmp_path, max_steps=4, algo={"max_length": 64}, lora={"rank": 2},
                         backend={"kind": "local", "device": "cpu"})
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(UserError, match=r"^disk full writing .*file write failed.*run the same command to resume"):
        run(recipe, "r")
    monkeypatch.undo()
    assert [r["next_step"] for r in read_jsonl(tmp_path / "run" / CHECKPOINTS)] == [2]
    run(recipe, "r")  # resumes (the failed save's temp dir is removed first)
    assert steps_of(tmp_path / "run") == [0, 1, 2, 3]
    assert not list((tmp_path / "run" / "checkpoints").glob("*/.*"))


# ---------------------------------------------------------------- silent nonsense

def test_lr_inf_stops_with_one_line_and_keeps_no_nan_checkpoint(tmp_path: Path) -> None:
    """Before: lr=inf trained NaN from step 1 and saved a NaN final checkpoint with exit 0."""
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match=r"^step 1: train_mean_nll = nan \(not finite; lr inf\): stopped, keeping "
                                        r"no non-finite checkpoint; no checkpoint before it is good.*dropped "
                                        r"checkpoint\(s\) '000001'"):
        run(make_recipe(tmp_path, lr=math.inf, max_steps=4, save_every=1), "r", backend=fake(run_dir))
    assert read_jsonl(run_dir / CHECKPOINTS) == []  # the checkpoint after step 0 held the NaN weights
    assert list((run_dir / "checkpoints").iterdir()) == []  # nor its files, nor those saved after it
    assert all(math.isfinite(r["train_mean_nll"]) for r in read_jsonl(run_dir / METRICS))


class NanGradAt(FakeBackend):
    """The fake backend, whose n-th optim_step reports a NaN gradient norm."""

    def __init__(self, run_dir: Path, at: int):
        super().__init__(TOK, storage_dir=run_dir / "checkpoints")
        self.at = at

    def _client(self, state: dict[str, np.ndarray]) -> Any:
        client = super()._client(state)
        optim_step, count = client.optim_step, {"n": 0}

        def patched(params: Any) -> Any:
            count["n"] += 1
            fut = optim_step(params)
            if count["n"] != self.at + 1:
                return fut
            return fut.map(lambda out: type(out)({**out.metrics, "grad_norm:mean": float("nan")}))

        client.optim_step = patched
        return client


def test_a_nan_grad_norm_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(UserError, match=r"^step 3: optim/grad_norm = nan .*the last good checkpoint is '000002' "
                                        r"\(after 2 steps\)\. Lower lr"):
        run(make_recipe(tmp_path, max_steps=6, save_every=2, depth=1), "r", backend=NanGradAt(run_dir, 3))
    assert [r["name"] for r in read_jsonl(run_dir / CHECKPOINTS)] == ["000002"]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "fake:__0_sampler_weights_000002.npz", "fake:__0_weights_000002.npz"]  # the one after step 3 went
    assert steps_of(run_dir) == [0, 1, 2]
    run(make_recipe(tmp_path, max_steps=6, save_every=2, depth=1), "r", backend=fake(run_dir))
    assert steps_of(run_dir) == [0, 1, 2, 3, 4, 5]


def test_zero_trained_tokens_is_an_error_naming_the_cause(tmp_path: Path) -> None:
    """Before: max_length too short to reach any reply logged NaN losses with exit 0."""
    with pytest.raises(UserError, match=r"no token of the batch is trained.*max_length"):
        run(make_recipe(tmp_path, max_steps=2, algo={"max_length": 4}), "r", backend=fake(tmp_path / "run"))


def test_append_jsonl_writes_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    for i in range(3):
        append_jsonl(path, {"step": i, "x": float("nan")})
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]
    assert math.isnan(read_jsonl(path)[0]["x"])
    assert not (tmp_path / LOCK).exists()
