"""Touch nothing that is not ours (issue 31): a folder is a run dir of ours only when it holds our marker
(.runner-run), or is empty, or was made by an older runner and holds only files runner writes; anything else is
refused by `runner check`, `runner run --dry-run` and `runner run` before anything is written, deleted or locked
there. `if_exists = "overwrite"` moves aside only a run dir of ours. No link inside a run dir is followed when
locking, writing or deleting, except a linked checkpoints/, which is written into and cleaned only of our own
temp folders. A data path that is not a regular file (FIFO, device, folder) is one line, and never blocks.

Each test reproduces one finding of the issue; "unchanged" is a full listing of the tree with each entry's kind,
mode, mtime (ns) and contents (or link target), before and after.

Run: pytest tests/test_rundir_claim.py   (6-20 s on 2 shared cores)
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from backends.errors import UserError
from backends.fake import FakeBackend
from backends.local.tiny import build_tokenizer
from runner.cli import main
from runner.engine.log import append_jsonl, read_jsonl, write_text_atomic
from runner.engine.loop import run
from runner.engine.rundir import (
    CHECKPOINTS,
    LOCK,
    MARKER,
    METRICS,
    OUTPUT,
    OWN_FILES,
    RunLock,
    claim,
    open_run_dir,
    own_state,
    relative_row,
    remove_own_state,
)
from runner.recipe.schema import Recipe

TOK = build_tokenizer()
ROOT = Path(__file__).resolve().parents[1]


def snapshot(root: Path) -> dict[str, Any]:
    """Every entry under `root` (links not followed): kind and mode, mtime in ns, contents or link target. A folder's
    mtime changes when an entry is created, renamed or removed in it, so the listing sees those too."""
    out: dict[str, Any] = {".": root.lstat().st_mtime_ns}
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(folder) / name
            st = p.lstat()
            body = (os.readlink(p) if stat.S_ISLNK(st.st_mode) else p.read_bytes() if stat.S_ISREG(st.st_mode)
                    else None)
            out[str(p.relative_to(root))] = (st.st_mode, st.st_mtime_ns, body)
    return out


def write_data(path: Path, n: int = 16) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer {i % 7}"}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_recipe(tmp_path: Path, log_dir: Path, **over: Any) -> Recipe:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_data(data)
    raw = {"algo": {"kind": "sft", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4},
           "lr": 0.05, "log_dir": str(log_dir), "eval_every": 0, "save_every": 2, **over}
    return msgspec.convert(raw, Recipe)


def fake(run_dir: Path) -> FakeBackend:
    return FakeBackend(TOK, storage_dir=run_dir / "checkpoints")


def steps_of(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run_dir / METRICS)]


# ---------------------------------------------------------------- folders that are not ours


def foreign_layout(tmp_path: Path, case: str) -> tuple[Path, Path, str]:
    """(the folder that must stay untouched, the working directory, log_dir as the recipe writes it)."""
    if case == "foreign":  # someone's folder: a temp-looking file, a nested hidden file, a thesis
        root = tmp_path / "foreign"
        (root / "checkpoints" / "cfg").mkdir(parents=True)
        (root / "checkpoints" / "cfg" / ".settings").write_text("keep me")
        (root / "notes.tmp").write_text("draft")
        (root / "thesis.txt").write_text("chapter 1")
        cwd, log_dir = tmp_path / "work", str(root)
    elif case == "etc":  # /etc as it looks: passwd and its editor's temp file, a hidden .lock, a config.toml
        root = tmp_path / "etc"
        (root / "ssl").mkdir(parents=True)
        (root / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
        (root / "passwd.tmp").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (root / "config.toml").write_text("[recipes.x]\nlr = 1\n")  # a recipe file is not enough
        (root / "ssl" / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\n")
        cwd, log_dir = tmp_path / "work", str(root)
    else:  # "../" or "../../" from the working directory
        root = tmp_path / "home"
        (root / "notes.tmp").parent.mkdir(parents=True)
        (root / "notes.tmp").write_text("draft")
        (root / ".bashrc").write_text("export PATH\n")
        cwd = root / "project" if case == "../" else root / "project" / "sub"
        log_dir = case
    cwd.mkdir(parents=True, exist_ok=True)
    write_data(cwd / "data.jsonl")
    (cwd / "recipes.toml").write_text(
        f'[recipes.r]\nlr = 0.05\nmax_steps = 2\nlog_dir = "{log_dir}"\n'
        'algo = {kind = "sft", data = {kind = "jsonl", path = "data.jsonl"}, batch_size = 4}\n')
    return root, cwd, log_dir


@pytest.mark.parametrize("case", ["foreign", "etc", "../", "../../"])
def test_a_folder_that_is_not_a_run_dir_is_refused_untouched(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Before: exit 2 "not a run dir", but only after deleting passwd.tmp / notes.tmp / checkpoints/cfg/.settings
    ("removed 1 temp folder(s)") and creating .lock there; `check` said ok; "overwrite" renamed the folder aside.
    Now check, --dry-run, run, and run with if_exists = overwrite or error each exit 2 with one line, and nothing
    under the folder changed."""
    root, cwd, _ = foreign_layout(tmp_path, case)
    monkeypatch.chdir(cwd)
    before = snapshot(root)
    commands = [["check", "recipes.toml"], ["check", "recipes.toml#r"], ["run", "recipes.toml#r", "--dry-run"],
                ["run", "recipes.toml#r"], ["run", "recipes.toml#r", "if_exists=overwrite"],
                ["run", "recipes.toml#r", "if_exists=error"]]
    capsys.readouterr()
    for command in commands:
        assert main(command) == 2, command
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "exists and is not a run dir (no .runner-run; it holds " in err[0], (command, err)
        assert err[0].endswith("nothing there was changed. Set log_dir to a new or empty folder"), err
    # The engine refuses too (a caller that skips check_all: sweeps, chains, the API).
    recipe = make_recipe(tmp_path, root)
    for dry_run in (True, False):
        with pytest.raises(UserError, match="is not a run dir"):
            open_run_dir(recipe, "r", dry_run=dry_run)
    assert snapshot(root) == before


def test_overwrite_moves_aside_only_a_run_dir_of_ours(tmp_path: Path) -> None:
    """Before: a folder holding thesis.txt became foreign2.old-..., exit 0. Now only a run dir of ours moves aside."""
    mine = tmp_path / "mine"
    run(make_recipe(tmp_path, mine, max_steps=2), "r", backend=fake(mine))
    assert (mine / MARKER).is_file() and json.loads((mine / MARKER).read_text())["format"] == 1
    run(make_recipe(tmp_path, mine, max_steps=2, if_exists="overwrite"), "r", backend=fake(mine))
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("mine.old-")]
    assert steps_of(aside) == [0, 1] and (aside / MARKER).is_file() and steps_of(mine) == [0, 1]
    # A run dir with a file runner never writes, and no marker: not ours, not moved.
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.txt").write_text("chapter 1")
    (other / "config.toml").write_text((mine / "config.toml").read_text())
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=r"is not a run dir \(no \.runner-run; it holds 'thesis.txt'\)"):
        run(make_recipe(tmp_path, other, max_steps=2, if_exists="overwrite"), "r", backend=fake(other))
    assert snapshot(tmp_path) == before


def test_a_run_dir_of_an_older_runner_is_adopted_only_when_it_holds_only_our_files(tmp_path: Path) -> None:
    """A run dir made before the marker (config.toml, metrics.jsonl, checkpoints.jsonl, checkpoints/, ... and
    nothing else) resumes and gets the marker; the same with one foreign file is refused untouched."""
    old = tmp_path / "old"
    run(make_recipe(tmp_path, old, max_steps=2), "r", backend=fake(old))
    (old / MARKER).unlink()
    (old / f"{METRICS}.pre_resume_000002").write_text("")  # as an older resume left it
    assert claim(old) == "legacy"
    (old / "thesis.txt").write_text("mine")
    before = snapshot(old)
    with pytest.raises(UserError, match="it holds 'thesis.txt'"):
        run(make_recipe(tmp_path, old, max_steps=4), "r", backend=fake(old))
    assert snapshot(old) == before
    (old / "thesis.txt").unlink()
    run(make_recipe(tmp_path, old, max_steps=4), "r", backend=fake(old))
    assert steps_of(old) == [0, 1, 2, 3] and (old / MARKER).is_file() and claim(old) == "ours"


def test_an_empty_folder_is_adopted(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert claim(empty) == "empty" and claim(tmp_path / "nothing") == "new"
    run(make_recipe(tmp_path, empty, max_steps=2), "r", backend=fake(empty))
    assert steps_of(empty) == [0, 1] and claim(empty) == "ours"


def test_a_run_dir_of_ours_with_odd_entries_is_refused(tmp_path: Path) -> None:
    """Our marker is not a pass for anything: a FIFO named metrics.jsonl (reading it would block), a marker that is a
    link, a marker of a newer format, and a log_dir that is a file are each one line."""
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, run_dir, max_steps=2), "r", backend=fake(run_dir))
    assert claim(run_dir) == "ours"
    (run_dir / METRICS).unlink()
    os.mkfifo(run_dir / METRICS)
    with pytest.raises(UserError, match=f"run dir {run_dir}: {METRICS} is not a plain file; remove it"):
        claim(run_dir)
    (run_dir / METRICS).unlink()
    (run_dir / MARKER).write_text('{"format": 2}\n')
    with pytest.raises(UserError, match=r"made by a newer runner \(run dir format 2, this one knows 1\)"):
        claim(run_dir)
    (run_dir / MARKER).unlink()
    (run_dir / MARKER).symlink_to(tmp_path / "data.jsonl")
    with pytest.raises(UserError, match=r"\.runner-run is not a plain file \(a link\?\)"):
        claim(run_dir)
    with pytest.raises(UserError, match="exists and is not a folder"):
        claim(tmp_path / "data.jsonl")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(UserError, match="is a symbolic link to nothing"):
        claim(tmp_path / "dangling")


def test_own_file_names_are_the_modules_own() -> None:
    """The names a legacy run dir may hold are the ones the modules that write them use."""
    from runner.engine.track import WANDB_FILE
    from runner.tools.sweep import OUTPUT_LOG
    from runner.tools.talk import EVALS

    assert {WANDB_FILE, OUTPUT_LOG, EVALS} <= set(OWN_FILES) and OUTPUT == "generated"


# ---------------------------------------------------------------- links inside a run dir


def test_a_linked_lock_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    """Before: a .lock linked to another file had that file's contents replaced by a pid."""
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, run_dir, max_steps=2), "r", backend=fake(run_dir))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run_dir / LOCK).unlink()
    (run_dir / LOCK).symlink_to(victim)
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=r"\.lock is a symbolic link; runner never writes, locks or deletes through"):
        run(make_recipe(tmp_path, run_dir, max_steps=4), "r", backend=fake(run_dir))
    with pytest.raises(UserError, match=r"\.lock is a symbolic link; runner never writes through it"):
        RunLock(run_dir)  # the lock itself refuses too (no claim() before it)
    assert snapshot(tmp_path) == before
    (run_dir / LOCK).unlink()
    os.link(victim, run_dir / LOCK)  # a hard link: the same file under two names
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=r"\.lock is a hard link shared with 1 other name"):
        RunLock(run_dir)
    assert snapshot(tmp_path) == before and victim.read_text() == "precious"


@pytest.mark.parametrize("name", [METRICS, "config.toml", "config.toml.tmp", CHECKPOINTS])
def test_a_linked_file_in_a_run_dir_is_refused_untouched(name: str, tmp_path: Path) -> None:
    """metrics.jsonl (appended), config.toml (rewritten), a temp file (removed) or checkpoints.jsonl linked to
    another file: refused, the file it points to untouched."""
    run_dir = tmp_path / "run"
    run(make_recipe(tmp_path, run_dir, max_steps=2), "r", backend=fake(run_dir))
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    if (run_dir / name).exists():
        (run_dir / name).unlink()
    (run_dir / name).symlink_to(victim)
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match=rf"{name} is a symbolic link"):
        run(make_recipe(tmp_path, run_dir, max_steps=4), "r", backend=fake(run_dir))
    assert snapshot(tmp_path) == before


def test_the_run_dir_writers_never_write_through_a_link(tmp_path: Path) -> None:
    """Below claim(): append_jsonl, write_text_atomic's temp file, read_jsonl's repair and the RL transcripts open
    with O_NOFOLLOW."""
    victim = tmp_path / "victim.jsonl"
    victim.write_text('{"step": 0}\n{"step": 1, "torn')
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(victim)
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="is a symbolic link; runner does not write through links"):
        append_jsonl(link, {"step": 2})
    with pytest.raises(UserError, match="is a symbolic link"):
        read_jsonl(link)  # reading would cut the torn tail off the file it points to
    assert snapshot(tmp_path) == before
    (tmp_path / "config.toml.tmp").symlink_to(victim)
    before = snapshot(tmp_path)
    with pytest.raises(UserError, match="config.toml.tmp is a symbolic link"):
        write_text_atomic(tmp_path / "config.toml", "x")
    # The failed write removes its temp name (the link itself); what it pointed to is untouched.
    assert snapshot(tmp_path)["victim.jsonl"] == before["victim.jsonl"] and not (tmp_path / "config.toml").exists()
    from runner.rl.transcripts import write_rollout_summaries

    (tmp_path / "iteration_000000").mkdir()
    (tmp_path / "iteration_000000" / "train_rollout_summaries.jsonl").symlink_to(victim)  # RL transcripts too
    with pytest.raises(UserError, match="train_rollout_summaries.jsonl is a symbolic link"):
        write_rollout_summaries(tmp_path / "iteration_000000" / "train_rollout_summaries.jsonl", [], split="train",
                                iteration=0)
    assert snapshot(tmp_path)["victim.jsonl"] == before["victim.jsonl"]
    assert victim.read_text() == '{"step": 0}\n{"step": 1, "torn'


def homes(root: Path) -> Path:
    """A folder of home directories, as the issue's checkpoints/ link pointed at."""
    for rel, text in [("alice/.ssh/id_rsa", "-----BEGIN OPENSSH PRIVATE KEY-----\n"), ("alice/.bashrc", "alias l=ls\n"),
                      ("bob/.profile", "umask 022\n")]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_linked_checkpoints_folder_is_written_into_and_never_cleaned_beyond_ours(tmp_path: Path) -> None:
    """Before: checkpoints/ linked to a folder of home directories lost alice/.ssh/ (with a key), alice/.bashrc and
    bob/.profile on resume ("removed 3 temp folder(s)"). Now the run saves into the linked folder and resumes
    from it; only the temp folder of our own interrupted save goes."""
    run_dir, other_disk = tmp_path / "run", homes(tmp_path / "disk")
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(other_disk, target_is_directory=True)
    assert claim(run_dir) == "empty"  # checkpoints put on another disk before the first run
    run(make_recipe(tmp_path, run_dir, max_steps=2), "r", backend=fake(run_dir))
    assert [r["state_path"] for r in read_jsonl(run_dir / CHECKPOINTS)][-1] == \
        "checkpoints/fake:__0_weights_final.npz"
    assert (other_disk / "fake:__0_weights_final.npz").is_file()
    # What an interrupted save of ours leaves, and look-alikes that are not ours.
    stale = other_disk / "weights" / ".000004.k2j3h4x9"  # tempfile.mkdtemp's name: 8 random characters
    stale.mkdir(parents=True)
    (stale / "adapter.bin").write_bytes(b"half")
    (other_disk / "weights" / ".000006.abcdefgh").symlink_to(other_disk / "alice", target_is_directory=True)
    (other_disk / "alice" / ".000004.k2j3h4x9").mkdir()  # our temp name, but not under a checkpoint kind
    (other_disk / "weights" / ".cache").mkdir()
    theirs = {k: v for k, v in snapshot(other_disk).items() if not k.startswith(("fake:", "weights/.000004"))}
    run(make_recipe(tmp_path, run_dir, max_steps=4), "r", backend=fake(run_dir))
    assert steps_of(run_dir) == [0, 1, 2, 3] and not stale.exists()
    after = snapshot(other_disk)
    assert {k: v for k, v in after.items() if k in theirs and k not in (".", "weights")} == \
        {k: v for k, v in theirs.items() if k not in (".", "weights")}
    assert (other_disk / "alice/.ssh/id_rsa").read_text().startswith("-----BEGIN OPENSSH")


def test_only_our_saved_states_are_deleted(tmp_path: Path) -> None:
    """The NaN guard deletes the states of dropped checkpoint rows: only states runner names, never through a link,
    never outside checkpoints/ (a copied checkpoints.jsonl could name anything)."""
    run_dir, other_disk = tmp_path / "run", homes(tmp_path / "disk")
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(other_disk, target_is_directory=True)
    (other_disk / "weights" / "000002").mkdir(parents=True)
    (other_disk / "weights" / "000002" / "adapter.bin").write_bytes(b"w")
    (other_disk / "weights" / "000004").symlink_to(other_disk / "bob", target_is_directory=True)
    (other_disk / "x_final.npz").write_bytes(b"w")
    for foreign in ["checkpoints/alice", "checkpoints/alice/.ssh", "checkpoints/weights/000004",
                    "checkpoints/weights/../alice", "../disk/alice", str(tmp_path / "disk" / "bob"), "tinker://x/1"]:
        assert own_state(run_dir, str(run_dir / foreign)) is None, foreign
        assert not remove_own_state(run_dir, str(run_dir / foreign))
    assert own_state(run_dir, str(run_dir / "checkpoints/weights/000002")) is not None
    # The local backend resolves its storage dir: its paths name the link's target, and are the same states.
    assert own_state(run_dir, str(other_disk / "weights/000002")) == run_dir / "checkpoints/weights/000002"
    assert own_state(run_dir, str(other_disk / "alice")) is None
    assert relative_row({"state_path": str(other_disk / "weights/000002")}, run_dir) == {
        "state_path": "checkpoints/weights/000002", "paths": "run"}
    assert relative_row({"state_path": str(tmp_path / "elsewhere")}, run_dir) == {"state_path": str(tmp_path / "elsewhere")}
    assert remove_own_state(run_dir, str(run_dir / "checkpoints/weights/000002"))
    assert remove_own_state(run_dir, str(run_dir / "checkpoints/x_final.npz"))
    assert not (other_disk / "weights" / "000002").exists() and not (other_disk / "x_final.npz").exists()
    assert sorted(str(p.relative_to(other_disk)) for p in other_disk.rglob("*") if p.is_file()) == [
        "alice/.bashrc", "alice/.ssh/id_rsa", "bob/.profile"]


# ---------------------------------------------------------------- data paths that are not regular files


def test_a_data_path_that_is_not_a_regular_file_is_one_line(tmp_path: Path) -> None:
    """Before: a FIFO as a data path blocked `runner check` forever (and /dev/zero would be read forever). Now
    check and run say what it is in one line, exit 2, at once. Subprocesses with a timeout: a regression hangs
    there, not here."""
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "folder.jsonl").mkdir()
    paths = {"fifo": (str(fifo), "a FIFO (named pipe)"), "zero": ("/dev/zero", "a character device"),
             "folder": (str(tmp_path / "folder.jsonl"), "a folder")}
    (tmp_path / "recipes.toml").write_text("".join(
        f'[recipes.{name}]\nlog_dir = "{tmp_path / name}"\n'
        f'algo = {{kind = "sft", data = {{kind = "jsonl", path = "{path}"}}}}\n' for name, (path, _) in paths.items()))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def runner(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runner", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=180)  # a fresh interpreter: imports under load

    check = runner("check", "recipes.toml")
    assert check.returncode == 2 and check.stdout == ""
    assert sorted(check.stderr.splitlines()) == sorted(
        f"error: recipes.toml#{name}: algo.data: data file {path} is {what}, not a regular file"
        if name != "folder" else f"error: recipes.toml#{name}: algo.data: data file {path} is a folder, not a file"
        for name, (path, what) in paths.items())
    for name, (path, what) in paths.items():
        out = runner("run", f"recipes.toml#{name}")
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert f"data file {path} is {what}" in out.stderr
        assert not (tmp_path / name).exists()  # refused before the run dir


def test_a_sweep_never_writes_into_a_folder_that_is_not_a_sweep_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep's log_dir gets sweep.json, index.html and a run dir per point: a folder holding anything else is
    refused (exit 2, one line) before a point dir is made there; a sweep dir of ours (points claim() accepts) is not."""
    root, cwd, _ = foreign_layout(tmp_path, "foreign")
    monkeypatch.chdir(cwd)
    before = snapshot(root)
    capsys.readouterr()
    for extra in ([], ["--dry-run"]):
        assert main(["sweep", "recipes.toml#r", "lr=[0.01,0.02]", *extra]) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [f"error: {root} exists and is not a sweep dir (it holds 'checkpoints'); nothing there was "
                       "changed. Set log_dir to a new or empty folder for the sweep"], err
    assert snapshot(root) == before
    from runner.tools.sweep import _foreign_entry

    ours = tmp_path / "sweep"
    (ours / "lr=0.01").mkdir(parents=True)
    (ours / "lr=0.01" / MARKER).write_text("{}")
    (ours / "sweep.json").write_text("{}")
    (ours / "plot-train_mean_nll.png").write_bytes(b"png")
    assert _foreign_entry(ours) is None and _foreign_entry(tmp_path / "none") is None
    (ours / "lr=0.01" / "thesis.txt").write_text("x")  # a point dir that is ours may hold anything
    (ours / "lr=0.02").mkdir()
    (ours / "lr=0.02" / "thesis.txt").write_text("x")
    assert _foreign_entry(ours) == "lr=0.02"
