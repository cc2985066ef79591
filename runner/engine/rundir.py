"""The run directory (default runs/<name>) and resuming from it.

Layout:
  config.toml         the resolved recipe (loads back with `runner run config.toml#<name>`)
  metrics.jsonl       one row per finished step: {"step", train_mean_nll, optim/lr, ...}; 0-based steps,
                      then the algorithm's final row, if it has one, at step = total steps (RL: final eval)
  checkpoints.jsonl   one row per checkpoint: {name, step, next_step, state_path, sampler_path, ...}
  sessions.jsonl      one row per start or resume: {session, start_step, time}
  checkpoints/        the local backend's saved states (Tinker keeps them on the service)

A checkpoint row is written only after its save finished, and its state is exactly "after step
`step`" (the loop queues the save right behind that step's optim_step), so resuming at `next_step`
replays and skips nothing (the cookbook replays 1-2 batches: it records the finished batch and its
saved state may include later pipelined steps).

A crash can leave a save that finished without its row; backends never overwrite a checkpoint, so
each session after the first names its checkpoints with a suffix (000040-s2, final-s2).

Safety (docs/reliability.md, docs/rundir.md):
  .runner-run         the marker: a folder is a run dir of ours only when it holds it (written when we create the
                      dir or adopt an empty one, or one an older runner made: claim()). Any other existing folder
                      is refused before anything is written, deleted or locked there (run, --dry-run, check), and
                      "overwrite" moves aside only a run dir of ours. No link inside a run dir is followed when
                      deleting, locking or writing, except a linked checkpoints/ (written into, and cleaned only of
                      the temp folders of our own saves, by name)
  .lock               one writer per run dir: an fcntl.flock held from open_run_dir to end(); a second
                      process exits 2 naming the holder's pid (the file holds it)
  fingerprint.json    sha256 of the data files and of the `pkg.mod:fn` targets' source files the recipe names;
                      a resume whose data changed is refused, naming what changed (--force: resume anyway)
  checkpoint rows     local paths are stored relative to the run dir ("paths": "run"), so a moved or copied
                      run dir resumes from its own files (older absolute rows are mapped onto this dir's
                      checkpoints/ when the file is there): runner/engine/checkpoints.py
A checkpoint that no longer loads is skipped for the newest one before it (loop.py says so), and hidden temp
dirs of an interrupted atomic save (checkpoints/<kind>/.<name>.XXXXXXXX) are removed when the run dir is opened.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import msgspec

from backends.errors import UserError
from runner.engine.checkpoints import (
    CHECKPOINT_KINDS,
    SAVE_TEMP,
    Checkpoint,
    checkpoints_of,
    names_in,
    plain,
    relative_row,
    resolve_row,
    stored_rows,
)
from runner.engine.checkpoints import CHECKPOINTS as CHECKPOINTS  # runner/cli.py's, tools/openai_serve.py's
from runner.engine.checkpoints import own_state as own_state  # the tests'
from runner.engine.checkpoints import read_checkpoints as read_checkpoints  # tools/talk.py's, the tests'
from runner.engine.checkpoints import remove_own_state as remove_own_state  # loop.py's
from runner.engine.log import append_jsonl, disk_errors, read_jsonl, write_jsonl_atomic, write_text_atomic
from runner.engine.metrics import METRICS as METRICS  # runner/tools/compare.py's, sweep.py's
from runner.engine.metrics import MetricsRow, metrics_of
from runner.engine.track import Tracker, start_tracker
from runner.recipe.common import TARGET_PATTERN, Json
from runner.recipe.load import dump_recipe, load_recipe

# Where runs live and what a generate run writes: defined with the references, re-exported here.
from runner.recipe.refs import OUTPUT as OUTPUT
from runner.recipe.refs import output_files as output_files
from runner.recipe.refs import run_dir_path as run_dir_path
from runner.recipe.schema import Recipe
from runner.user_code import find_user_modules

CONFIG, SESSIONS = "config.toml", "sessions.jsonl"
# A chained run's starting point (runner/engine/chain.py): the upstream's ref, recipe (TOML) and checkpoint.
INIT = "init_from.json"
# One writer per run dir (RunLock) and the data it trained on (fingerprint()).
LOCK, FINGERPRINT = ".lock", "fingerprint.json"
# The marker that makes a folder a run dir of ours (claim()), and the format of what it holds.
MARKER, MARKER_FORMAT = ".runner-run", 1
# Files that a run dir holds before anything trained (a failed start): they never make it "a run".
BOOKKEEPING = (CONFIG, SESSIONS, INIT, LOCK, FINGERPRINT, MARKER)
# Every top-level entry runner writes in a run dir: a folder without the marker (made by an older runner) is adopted
# only when it holds nothing else. Besides the names above: the tracker's wandb.json (track.py), a sweep point's
# output.log (tools/sweep.py), `runner chat/eval`'s evals.jsonl (tools/talk.py), `runner plot DIR`'s index.html and
# plot-*.png (tools/plot.py), generate's generated/ (refs.OUTPUT), RL transcripts in iteration_NNNNNN/ (rl/algo.py),
# the metrics backups of a resume and the temp files of atomic writes (log.write_text_atomic: <name>.tmp).
OWN_FILES = (CONFIG, METRICS, CHECKPOINTS, SESSIONS, INIT, LOCK, FINGERPRINT, "wandb.json", "output.log", "evals.jsonl",
             "index.html")
OWN_DIRS = ("checkpoints", OUTPUT)
_OWN_FILE = re.compile(rf"{re.escape(METRICS)}\.pre_resume_\d{{6}}(-s\d+)?|plot-[^/]*\.png|"
                       rf"({'|'.join(re.escape(f) for f in (*OWN_FILES, MARKER))})\.tmp")
_OWN_DIR = re.compile(r"iteration_\d{6}")
# What claim() found: nothing there (new), our marker (ours), an empty folder, or an older runner's run dir (legacy).
Claim = Literal["new", "ours", "empty", "legacy"]
# Keys that may change between a run and its resumption: extending a run is a new max_steps, the
# directory itself is the run's identity, and where metrics are also sent (log) and the `--smoke` stand-ins (smoke) are
# not part of the training; nor are the cost settings (a rerun with a larger budget continues, docs/cost.md).
RESUMABLE_CHANGES = ("max_steps", "if_exists", "log_dir", "log", "smoke", "budget", "price", "price_file")
# Dotted keys that say where the model's files come from, not what trains (backends/hub.py).
RESUMABLE_KEYS = ("backend.local_files_only",)


@dataclass
class RunDir:
    path: Path
    name: str
    recipe: Recipe
    # The last checkpoint row with a state_path: where a resumed run starts (None: from scratch).
    resume: Checkpoint | None = None
    # What open_run_dir found, for the dry-run plan and the log.
    note: str = "new"
    # The note is worth a line when training starts (an old run moved aside, a failed one replaced).
    announce: bool = False
    # 1 for the first training session in this dir, n for the n-th (set by begin()).
    session: int = 1
    # A chained recipe's starting point (loop.InitWeights.record()), written to init_from.json by begin().
    init: Json | None = None
    # Where rows go besides metrics.jsonl (runner/engine/track.py; the recipe's `log` table), from begin() to end().
    tracker: Tracker | None = None
    # Checkpoint rows with a state, newest first: resume and what it falls back to when that one does not load.
    candidates: list[Checkpoint] = field(default_factory=list)
    # The run dir's flock (None: not locked, e.g. a dry run), released by end() (or when this object goes).
    lock: RunLock | None = None
    # The data's fingerprint for this session (computed when a resume checks it, else by begin()).
    fingerprint: dict[str, dict[str, str]] | None = None

    @property
    def start_step(self) -> int:
        return self.resume.next_step if self.resume else 0

    def begin(self) -> float:
        """Commit to training from start_step: write config.toml, drop metrics rows at or after
        start_step (backup kept), record the session. Returns the time/total spent before start_step."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.init is not None and (self.start_step == 0 or not (self.path / INIT).exists()):
            write_text_atomic(self.path / INIT, json.dumps(self.init, indent=1) + "\n")
        # The run dir is recorded too (log_dir), so config.toml says where its run lives even when the recipe
        # left it to the default.
        recipe = msgspec.structs.replace(self.recipe, log_dir=self.recipe.log_dir or str(self.path))
        write_text_atomic(self.path / CONFIG, dump_config(self.name, recipe))
        # What the data was when these steps trained (a resume with --force records the data it went on with).
        prints = self.fingerprint if self.fingerprint is not None else fingerprint(self.recipe)
        write_text_atomic(self.path / FINGERPRINT, json.dumps(prints, indent=1) + "\n")
        self.session = len(read_jsonl(self.path / SESSIONS)) + 1
        append_jsonl(self.path / SESSIONS,
                     {"session": self.session, "start_step": self.start_step, "time": time.time()})
        metrics = self.path / METRICS
        rows = metrics_of(self.path)
        kept = [r for r in rows if r.step < self.start_step]
        if len(kept) < len(rows):
            backup = metrics.with_name(f"{METRICS}.pre_resume_{self.start_step:06d}")
            if os.path.lexists(backup):  # resumed from the same step before: keep both
                backup = backup.with_name(f"{backup.name}-s{self.session}")
            with disk_errors(backup):  # a new file, never written through a link
                with os.fdopen(os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644),
                               "wb") as f:
                    f.write(metrics.read_bytes())
            write_jsonl_atomic(metrics, [r.row for r in kept])
        self.tracker = start_tracker(recipe, self.path)
        return kept[-1].time_total if kept else 0.0

    def end(self, status: str) -> None:
        """The session is over ("success", "interrupted", "error"): close the tracker, if any, and release the
        run dir's lock."""
        try:
            if self.tracker is not None:
                tracker, self.tracker = self.tracker, None
                tracker.finish(status)
        finally:
            self.unlock()

    def unlock(self) -> None:
        if self.lock is not None:
            lock, self.lock = self.lock, None
            lock.close()

    def checkpoint_name(self, step: int, last: bool) -> str:
        """Named by steps done (000020 = after 20 steps), "final" after the last one."""
        base = "final" if last else f"{step + 1:06d}"
        return base if self.session == 1 else f"{base}-s{self.session}"

    def log_metrics(self, row: Json) -> None:
        append_jsonl(self.path / METRICS, row)
        if self.tracker is not None:
            self.tracker.log(row)

    def add_checkpoint(self, ckpt: Checkpoint) -> None:
        append_jsonl(self.path / CHECKPOINTS, relative_row(ckpt.row, self.path))

    def drop_checkpoints(self, from_step: int) -> list[Checkpoint]:
        """Remove the rows of checkpoints whose state is after `from_step` steps or later (weights found to be
        non-finite); returns them (paths resolved)."""
        rows = stored_rows(self.path)
        late = [Checkpoint.of(r).next_step >= from_step for r in rows]
        if any(late):
            write_jsonl_atomic(self.path / CHECKPOINTS, [r for r, drop in zip(rows, late, strict=True) if not drop])
        return [Checkpoint.of(resolve_row(r, self.path)) for r, drop in zip(rows, late, strict=True) if drop]

    def metrics(self) -> list[MetricsRow]:
        return metrics_of(self.path)

    def has_row(self, step: int) -> bool:
        """Whether metrics.jsonl holds a row for `step` (at step = total steps: the final row was logged)."""
        return any(r.step == step for r in self.metrics())

    def checkpoints(self) -> list[Checkpoint]:
        return checkpoints_of(self.path)


def open_run_dir(recipe: Recipe, name: str, *, dry_run: bool = False, init: Json | None = None,
                 force: bool = False) -> RunDir:
    """Apply recipe.if_exists to the run directory, holding its lock (released by RunDir.end()). First claim():
    a folder that is not a run dir of ours is refused before anything is written, deleted or locked there. Nothing
    is written here except the dir, its marker and lock file, the removal of a failed save's temp dirs, and that
    "overwrite" moves an old run dir of ours aside (never deletes it); with dry_run nothing at all changes (and
    nothing is locked). `init`: a chained recipe's starting point, which must be the one recorded when the run dir
    trained. `force`: resume even though the data's fingerprint changed."""
    path = run_dir_path(recipe, name)
    claim(path)
    lock = None if dry_run else RunLock(make_ours(path))
    try:
        run = _open(recipe, name, path, dry_run, init, force)
    except BaseException:
        if lock is not None:
            lock.close()
        raise
    if lock is not None and run.lock is None:
        run.lock = lock
    elif lock is not None:  # "overwrite" moved the locked dir aside and locked the new one
        lock.close()
    return run


def claim(path: Path) -> Claim:
    """Whether `path` may be a run dir of ours, only looking (nothing is written, deleted or locked): "new" (nothing
    there), "ours" (it holds our marker), "empty" (an empty folder, or one holding only a .lock file and a
    checkpoints/ that is empty or links to a folder: adopted),
    "legacy" (no marker, but every entry is one runner writes and config.toml holds one recipe: a run dir of an
    older runner, adopted). Anything else is a one-line UserError, as is a link at the top of the run dir (only
    checkpoints/ may link to another folder, a folder). `path` itself may be a link (runs/x -> /big/x): the user
    named it."""
    try:
        st = path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise UserError(f"log_dir {path} is a symbolic link to nothing; point it at a folder or remove it") from None
        return "new"
    except OSError as e:
        raise UserError(f"log_dir {path}: cannot use it ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UserError(f"log_dir {path} exists and is not a folder; set log_dir to a new or empty folder")
    try:
        entries = {e.name: e for e in os.scandir(path)}
    except OSError as e:
        raise UserError(f"log_dir {path}: cannot list it ({e.strerror})") from None
    kind: Claim
    if MARKER in entries:
        if not entries[MARKER].is_file(follow_symlinks=False):
            raise UserError(f"run dir {path}: {MARKER} is not a plain file (a link?); runner refuses to use it")
        if (version := _marker_format(path / MARKER)) > MARKER_FORMAT:
            raise UserError(f"run dir {path} was made by a newer runner (run dir format {version}, this one "
                            f"knows {MARKER_FORMAT}); use that version or another log_dir")
        kind = "ours"
    elif _empty(path, entries):
        return "empty"
    else:
        foreign = [n for n in sorted(entries) if not _own_entry(n, entries[n])]
        if foreign or not _holds_recipe(path / CONFIG):
            what = f"it holds {foreign[0]!r}" if foreign else f"it holds no {CONFIG} with one recipe"
            shown = path if path.is_absolute() else f"{path} ({path.resolve()})"  # "..": which one
            raise UserError(f"{shown} exists and is not a run dir (no {MARKER}; {what}); nothing there was changed. "
                            "Set log_dir to a new or empty folder")
        kind = "legacy"
    links = sorted(n for n, e in entries.items() if e.is_symlink() and n != "checkpoints")
    if links:
        raise UserError(f"run dir {path}: {links[0]} is a symbolic link; runner never writes, locks or deletes "
                        "through a link in a run dir (only checkpoints/ may link to a folder): replace it with a file")
    if "checkpoints" in entries and not entries["checkpoints"].is_dir():  # a linked one must lead to a folder
        raise UserError(f"run dir {path}: checkpoints is not a folder (nor a link to one)")
    odd = sorted(n for n, e in entries.items() if (n in OWN_FILES or _OWN_FILE.fullmatch(n)) and not e.is_file())
    if odd:  # a FIFO or a device named like our files: reading it would block or never end
        raise UserError(f"run dir {path}: {odd[0]} is not a plain file; remove it")
    return kind


def _empty(path: Path, entries: dict[str, os.DirEntry[str]]) -> bool:
    """A folder that holds nothing, or nothing but a .lock file and a checkpoints/ that is empty or a link to a
    folder (checkpoints put on another disk before the first run)."""
    if set(entries) - {LOCK, "checkpoints"}:
        return False
    if LOCK in entries and not entries[LOCK].is_file(follow_symlinks=False):
        return False
    ckpts = entries.get("checkpoints")
    return ckpts is None or (ckpts.is_symlink() and ckpts.is_dir()) or (ckpts.is_dir() and not names_in(path / ckpts.name))


def _own_entry(name: str, entry: os.DirEntry[str]) -> bool:
    """Whether a top-level entry is one runner writes (by name and kind; links are reported by claim())."""
    if name in OWN_DIRS or _OWN_DIR.fullmatch(name):
        return entry.is_dir()
    return (name in OWN_FILES or bool(_OWN_FILE.fullmatch(name))) and entry.is_file()


def _holds_recipe(config: Path) -> bool:
    """Whether `config` is a plain file holding exactly one [recipes.<name>] table (config.toml as runner writes it)."""
    if not config.is_file() or config.is_symlink():
        return False
    try:
        recipes = tomllib.loads(config.read_text(encoding="utf-8")).get("recipes")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return isinstance(recipes, dict) and len(recipes) == 1


def _marker_format(marker: Path) -> int:
    """The format a marker records (1 when it records none: a marker whose write was cut short)."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        value = json.loads(raw or b"{}").get("format", 1)
    except (OSError, ValueError, AttributeError):
        return 1
    return value if isinstance(value, int) else 1


def make_ours(path: Path) -> Path:
    """Create the run dir (a claimed one: see claim()) and its marker, when missing. Returns `path`."""
    with disk_errors(path):
        path.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return path
        try:
            os.write(fd, json.dumps({"format": MARKER_FORMAT, "what": "a run dir of runner (docs/rundir.md)"})
                     .encode() + b"\n")
        finally:
            os.close(fd)
    return path


class RunLock:
    """An exclusive fcntl.flock on <run dir>/.lock (creating the dir), or UserError naming the pid that holds
    it. The OS drops it when the process dies (kill -9 included), so a stale lock file never blocks a resume.
    A .lock that is a link, not a plain file, or a hard link to another file is refused, untouched."""

    def __init__(self, path: Path):
        self.fd: int | None = None  # set once locked (close() and __del__ run on a half-made lock too)
        lock = path / LOCK
        with disk_errors(path):
            path.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENXIO):
                    raise
                fd = -1
        st = os.fstat(fd) if fd >= 0 else None
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            if fd >= 0:
                os.close(fd)
            what = "a symbolic link" if st is None else "not a plain file" if not stat.S_ISREG(st.st_mode) else \
                f"a hard link shared with {st.st_nlink - 1} other name(s)"
            raise UserError(f"run dir {path}: {LOCK} is {what}; runner never writes through it: remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise UserError(f"run dir {path} is in use by another run (pid {holder}); wait for it to finish, "
                            "stop it, or set another log_dir") from None
        except OSError as e:  # a file system without locks (some network and FUSE mounts): say so, go on
            print(f"warning: cannot lock {lock} ({e.strerror}); nothing stops a second run from writing "
                  "to this run dir at the same time", file=sys.stderr)
        try:
            with disk_errors(lock):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the descriptor releases the flock

    def __del__(self) -> None:
        self.close()


def _is_empty(path: Path) -> bool:
    """Nothing there, or nothing but our marker, lock file and an empty or linked checkpoints/ (a run dir whose
    first run never started)."""
    return not path.exists() or _empty(path, {e.name: e for e in os.scandir(path) if e.name != MARKER})


def _open(recipe: Recipe, name: str, path: Path, dry_run: bool, init: Json | None,
          force: bool) -> RunDir:
    run = RunDir(path, name, recipe, init=init)
    if _is_empty(path):
        return run
    if not dry_run:
        removed = remove_stale_temps(path)
        if removed:
            print(f"{path}: removed {removed} temp folder(s) left by an interrupted save", file=sys.stderr)
    if recipe.if_exists == "error":
        raise UserError(f"run dir {path} already exists (if_exists = \"error\"); set if_exists or log_dir")
    if recipe.if_exists == "overwrite":  # claim() let only a run dir of ours (or an older runner's) get here
        aside = path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists() or aside.is_symlink():  # two overwrites within a second: never rename onto one
            n += 1
            aside = aside.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        if not dry_run:
            with disk_errors(path):
                path.rename(aside)
            run.lock = RunLock(make_ours(path))
        run.note, run.announce = f"old run moved aside to {aside}", True
        return run
    if not (path / CONFIG).exists():
        if _nothing_trained(path):  # a run of ours that stopped before it wrote its recipe
            return run
        raise UserError(f"run dir {path} holds no {CONFIG} but trained files; set log_dir or "
                        "if_exists = \"overwrite\" (moves it aside)")
    old = load_config(path / CONFIG)
    differing = recipe_diff(old, recipe)
    if differing and _nothing_trained(path):
        # A run that failed before its first step (say, a python env with a wrong argument) left only its
        # recipe and session log: fixing the recipe and running again starts over in the same dir.
        run.note = f"held a different recipe (differs in: {', '.join(differing)}) but nothing trained: starts over"
        run.announce = True
        return run
    if differing:
        raise UserError(
            f"run dir {path} holds a different recipe (differs in: {', '.join(differing)}); "
            f"set if_exists = \"overwrite\" (moves it aside) or another log_dir"
        )
    changed = _init_changed(path, init) if not _nothing_trained(path) else None
    if changed:
        raise UserError(f"run dir {path} was trained from init_from #{init['name'] if init else '?'} as it was then, "
                        f"which has changed ({changed}); set if_exists = \"overwrite\" (moves it aside) or another "
                        "log_dir")
    states = [r for r in run.checkpoints() if r.state_path]
    run.candidates = states[::-1]
    run.resume = states[-1] if states else None
    run.fingerprint = fingerprint(recipe)  # hashed once per session (begin() records it)
    if not _nothing_trained(path) and not force and (what := fingerprint_changed(path, recipe, run.fingerprint)):
        raise UserError(f"run dir {path}: {what} since it trained; resuming would mix data. Pass --force to "
                        "resume anyway, or set if_exists = \"overwrite\" (moves it aside) or another log_dir")
    run.note = (f"resume after checkpoint {run.resume.name!r}" if run.resume
                else "exists, no checkpoint yet: from step 0")
    return run


def _init_changed(path: Path, init: Json | None) -> str | None:
    """How the upstream a run dir was started from differs from `init` now (its recipe's keys, or a different
    checkpoint: the upstream was re-run); None when it is the same, or the run dir records none."""
    recorded_file = path / INIT
    if init is None or not recorded_file.exists():
        return None
    try:
        recorded = json.loads(recorded_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise UserError(f"{recorded_file}: not valid JSON; fix or remove it") from None
    old_recipe = _recipe_from_toml(recorded.get("recipe", ""), recorded_file)
    new_recipe = _recipe_from_toml(init["recipe"], recorded_file)
    keys = recipe_diff(old_recipe, new_recipe) if old_recipe is not None and new_recipe is not None else ["recipe"]
    if keys:
        return f"its recipe differs in: {', '.join(keys)}"
    if recorded.get("state_path") != init["state_path"] and init["state_path"]:
        return f"its final checkpoint is now {init['state_path']}, not {recorded.get('state_path')}"
    return None


def _recipe_from_toml(text: str, where: Path) -> Recipe | None:
    from runner.recipe.load import decode_recipe

    try:
        tables = tomllib.loads(text).get("recipes", {})
    except tomllib.TOMLDecodeError:
        return None
    if len(tables) != 1:
        return None
    name, raw = next(iter(tables.items()))
    return decode_recipe(raw, f"{where}#{name}")


def _nothing_trained(path: Path) -> bool:
    """Whether the run dir holds nothing a new run could overwrite: no file but the recipe, the session
    log and empty metrics/checkpoint logs (no metrics row, no checkpoint, no transcript)."""
    for entry in path.iterdir():
        if entry.name in BOOKKEEPING:
            continue
        if entry.name in (METRICS, CHECKPOINTS) and entry.is_file() and not entry.read_text().strip():
            continue
        if entry.is_dir() and not entry.is_symlink() and not any(entry.rglob("*")):
            continue  # an empty folder (checkpoints/ before any save)
        return False
    return True


def recipe_diff(a: Recipe, b: Recipe) -> list[str]:
    """Dotted keys whose values differ, ignoring the keys a resumed run may change."""
    fa, fb = flatten(msgspec.to_builtins(a)), flatten(msgspec.to_builtins(b))
    keys = sorted(set(fa) | set(fb))
    return [k for k in keys if k.split(".")[0] not in RESUMABLE_CHANGES and k not in RESUMABLE_KEYS
            and fa.get(k) != fb.get(k)]


def flatten(d: Json, prefix: str = "") -> Json:
    """{'a': {'b': 1}} -> {'a.b': 1} (an empty table stays a value)."""
    out: Json = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# ---------------------------------------------------------------- config.toml
# The recipe loader owns the TOML format (runner/recipe/schema.py); these two wrappers are the only place
# the run dir touches it.

def dump_config(name: str, recipe: Recipe) -> str:
    return dump_recipe(name, recipe)


def load_config(path: Path) -> Recipe:
    """The one recipe in a run dir's config.toml (whatever its name: log_dir may be shared)."""
    try:
        names = list(tomllib.loads(path.read_text(encoding="utf-8")).get("recipes", {}))
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{path}: not valid TOML ({e})") from None
    if len(names) != 1:
        raise UserError(f"{path}: expected exactly one [recipes.<name>] table, found {len(names)}")
    return load_recipe(f"{path}#{names[0]}")[1]



# ---------------------------------------------------------------- stale temps

def remove_stale_temps(path: Path) -> int:
    """Remove what an interrupted atomic save leaves: the temp folders of the local backend's saves
    (checkpoints/<kind>/.<name>.XXXXXXXX) and the run dir's own <file>.tmp of an atomic write, matched by name
    and kind, never through a link (lstat first; shutil.rmtree does not follow links inside). A linked
    checkpoints/ is entered, its other entries untouched. Only called holding the lock, so no save is in
    progress."""
    n = 0
    for tmp in [path / name for name in names_in(path) if name.endswith(".tmp") and _OWN_FILE.fullmatch(name)]:
        if plain(tmp, stat.S_ISREG):
            with contextlib.suppress(OSError):
                tmp.unlink()
                n += 1
    for kind in CHECKPOINT_KINDS:
        folder = path / "checkpoints" / kind
        if not plain(folder, stat.S_ISDIR):
            continue
        for tmp in [folder / name for name in names_in(folder) if SAVE_TEMP.fullmatch(name)]:
            if plain(tmp, stat.S_ISDIR):
                with contextlib.suppress(OSError):
                    shutil.rmtree(tmp)
                    n += 1
    return n


# ---------------------------------------------------------------- data fingerprint

_TARGET = re.compile(TARGET_PATTERN)


def fingerprint(recipe: Recipe) -> dict[str, dict[str, str]]:
    """sha256 of each local file the recipe names (data paths) and of each `pkg.mod:fn` target's source file,
    keyed by how the recipe names them. Datasets by hub name and run references are not files: not included."""
    files: dict[str, str] = {}
    targets: dict[str, str] = {}
    for key, value in flatten(msgspec.to_builtins(recipe)).items():
        if not isinstance(value, str) or key.split(".")[0] in RESUMABLE_CHANGES:
            continue
        if _TARGET.match(value):
            source = _target_file(value)
            if source is not None:
                targets[value] = _sha256(source)
        elif key.rsplit(".", 1)[-1].endswith("path") and Path(value).is_file():
            files[value] = _sha256(Path(value))
    return {"files": files, "targets": targets}


def fingerprint_changed(path: Path, recipe: Recipe, new: dict[str, dict[str, str]] | None = None) -> str | None:
    """What changed since the run dir recorded its fingerprint ("data file x.jsonl changed"), or None. `new`: the
    recipe's fingerprint, when already computed."""
    recorded_file = path / FINGERPRINT
    if not recorded_file.exists():
        return None  # a run dir from before fingerprints
    try:
        old = json.loads(recorded_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{FINGERPRINT} is corrupt"
    new = new if new is not None else fingerprint(recipe)
    changed = [f"data file {k}" for k, h in old.get("files", {}).items() if new["files"].get(k) != h]
    changed += [f"the source of {k}" for k, h in old.get("targets", {}).items() if new["targets"].get(k) != h]
    if not changed:
        return None
    return f"{', '.join(changed)} changed"


def _target_file(target: str) -> Path | None:
    module = target.partition(":")[0]
    find_user_modules()  # where targets.import_object finds them
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    origin = spec.origin if spec is not None else None
    return Path(origin) if origin and Path(origin).is_file() else None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    return h.hexdigest()
