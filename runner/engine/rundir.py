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

Safety (docs/reliability.md):
  .lock               one writer per run dir: an fcntl.flock held from open_run_dir to end(); a second
                      process exits 2 naming the holder's pid (the file holds it)
  fingerprint.json    sha256 of the data files and of the `pkg.mod:fn` targets' source files the recipe names;
                      a resume whose data changed is refused, naming what changed (--force: resume anyway)
  checkpoint rows     local paths are stored relative to the run dir ("paths": "run"), so a moved or copied
                      run dir resumes from its own files (older absolute rows are mapped onto this dir's
                      checkpoints/ when the file is there)
A checkpoint that no longer loads is skipped for the newest one before it (loop.py says so), and hidden temp
dirs of an interrupted atomic save (checkpoints/*/.name.XXXX) are removed when the run dir is opened.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from backends.errors import UserError
from runner.engine.log import append_jsonl, disk_errors, read_jsonl, write_jsonl_atomic, write_text_atomic
from runner.engine.track import start_tracker
from runner.recipe.load import dump_recipe, load_recipe

# Where runs live and what a generate run writes: defined with the references, re-exported here.
from runner.recipe.refs import OUTPUT as OUTPUT
from runner.recipe.refs import output_files as output_files
from runner.recipe.refs import run_dir_path as run_dir_path
from runner.recipe.schema import TARGET_PATTERN, Recipe

CONFIG, METRICS, CHECKPOINTS, SESSIONS = "config.toml", "metrics.jsonl", "checkpoints.jsonl", "sessions.jsonl"
# A chained run's starting point (runner/engine/chain.py): the upstream's ref, recipe (TOML) and checkpoint.
INIT = "init_from.json"
# One writer per run dir (RunLock) and the data it trained on (fingerprint()).
LOCK, FINGERPRINT = ".lock", "fingerprint.json"
# Files that a run dir holds before anything trained (a failed start): they never make it "a run".
BOOKKEEPING = (CONFIG, SESSIONS, INIT, LOCK, FINGERPRINT)
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
    resume: dict[str, Any] | None = None
    # What open_run_dir found, for the dry-run plan and the log.
    note: str = "new"
    # The note is worth a line when training starts (an old run moved aside, a failed one replaced).
    announce: bool = False
    # 1 for the first training session in this dir, n for the n-th (set by begin()).
    session: int = 1
    # A chained recipe's starting point (loop.InitWeights.record()), written to init_from.json by begin().
    init: dict[str, Any] | None = None
    # Where rows go besides metrics.jsonl (runner/engine/track.py; the recipe's `log` table), from begin() to end().
    tracker: Any = None
    # Checkpoint rows with a state, newest first: resume and what it falls back to when that one does not load.
    candidates: list[dict[str, Any]] = field(default_factory=list)
    # The run dir's flock (None: not locked, e.g. a dry run), released by end() (or when this object goes).
    lock: RunLock | None = None
    # The data's fingerprint for this session (computed when a resume checks it, else by begin()).
    fingerprint: dict[str, dict[str, str]] | None = None

    @property
    def start_step(self) -> int:
        return int(self.resume["next_step"]) if self.resume else 0

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
        rows = read_jsonl(metrics)
        kept = [r for r in rows if r.get("step", -1) < self.start_step]
        if len(kept) < len(rows):
            backup = metrics.with_name(f"{METRICS}.pre_resume_{self.start_step:06d}")
            if backup.exists():  # resumed from the same step before: keep both
                backup = backup.with_name(f"{backup.name}-s{self.session}")
            with disk_errors(backup):
                shutil.copyfile(metrics, backup)
            write_jsonl_atomic(metrics, kept)
        self.tracker = start_tracker(recipe, self.path)
        return float(kept[-1].get("time/total", 0.0)) if kept else 0.0

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

    def log_metrics(self, row: dict[str, Any]) -> None:
        append_jsonl(self.path / METRICS, row)
        if self.tracker is not None:
            self.tracker.log(row)

    def add_checkpoint(self, row: dict[str, Any]) -> None:
        append_jsonl(self.path / CHECKPOINTS, relative_row(row, self.path))

    def drop_checkpoints(self, from_step: int) -> list[dict[str, Any]]:
        """Remove the rows of checkpoints whose state is after `from_step` steps or later (weights found to be
        non-finite); returns them (paths resolved)."""
        rows = read_jsonl(self.path / CHECKPOINTS)
        kept = [r for r in rows if r.get("next_step", 0) < from_step]
        if len(kept) < len(rows):
            write_jsonl_atomic(self.path / CHECKPOINTS, kept)
        return [resolve_row(r, self.path) for r in rows if r.get("next_step", 0) >= from_step]

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / METRICS)

    def has_row(self, step: int) -> bool:
        """Whether metrics.jsonl holds a row for `step` (at step = total steps: the final row was logged)."""
        return any(r.get("step") == step for r in self.metrics())

    def checkpoints(self) -> list[dict[str, Any]]:
        return read_checkpoints(self.path)


def open_run_dir(recipe: Recipe, name: str, *, dry_run: bool = False, init: dict[str, Any] | None = None,
                 force: bool = False) -> RunDir:
    """Apply recipe.if_exists to the run directory, holding its lock (released by RunDir.end()). Nothing is
    written here except the lock file, the removal of a failed save's temp dirs, and that "overwrite" moves an
    old directory aside (never deletes it); with dry_run nothing at all changes (and nothing is locked).
    `init`: a chained recipe's starting point, which must be the one recorded when the run dir trained.
    `force`: resume even though the data's fingerprint changed."""
    path = run_dir_path(recipe, name)
    lock = None if dry_run else RunLock(path)
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


class RunLock:
    """An exclusive fcntl.flock on <run dir>/.lock (creating the dir), or UserError naming the pid that holds
    it. The OS drops it when the process dies (kill -9 included), so a stale lock file never blocks a resume."""

    def __init__(self, path: Path):
        self.fd: int | None = None  # set once locked (close() and __del__ run on a half-made lock too)
        with disk_errors(path):
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise UserError(f"run dir {path} is in use by another run (pid {holder}); wait for it to finish, "
                            "stop it, or set another log_dir") from None
        except OSError as e:  # a file system without locks (some network and FUSE mounts): say so, go on
            print(f"warning: cannot lock {path / LOCK} ({e.strerror}); nothing stops a second run from writing "
                  "to this run dir at the same time", file=sys.stderr)
        try:
            with disk_errors(path / LOCK):
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
    return not path.exists() or all(e.name == LOCK for e in path.iterdir())


def _open(recipe: Recipe, name: str, path: Path, dry_run: bool, init: dict[str, Any] | None,
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
    if recipe.if_exists == "overwrite":
        aside = path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists() or aside.is_symlink():  # two overwrites within a second: never rename onto one
            n += 1
            aside = aside.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        if not dry_run:
            with disk_errors(path):
                path.rename(aside)
            run.lock = RunLock(path)
        run.note, run.announce = f"old run moved aside to {aside}", True
        return run
    if not (path / CONFIG).exists():
        raise UserError(f"{path} exists but is not a run dir (no {CONFIG}); set log_dir or if_exists = \"overwrite\"")
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
    states = [r for r in run.checkpoints() if r.get("state_path")]
    run.candidates = states[::-1]
    run.resume = states[-1] if states else None
    run.fingerprint = fingerprint(recipe)  # hashed once per session (begin() records it)
    if not _nothing_trained(path) and not force and (what := fingerprint_changed(path, recipe, run.fingerprint)):
        raise UserError(f"run dir {path}: {what} since it trained; resuming would mix data. Pass --force to "
                        "resume anyway, or set if_exists = \"overwrite\" (moves it aside) or another log_dir")
    run.note = (f"resume after checkpoint {run.resume['name']!r}" if run.resume
                else "exists, no checkpoint yet: from step 0")
    return run


def _init_changed(path: Path, init: dict[str, Any] | None) -> str | None:
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


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (an empty table stays a value)."""
    out: dict[str, Any] = {}
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



# ---------------------------------------------------------------- checkpoint paths

def _is_local(p: object) -> bool:
    return isinstance(p, str) and bool(p) and "://" not in p


def relative_row(row: dict[str, Any], run_path: Path) -> dict[str, Any]:
    """The row as checkpoints.jsonl stores it: local state/sampler paths inside the run dir made relative to it."""
    out = dict(row)
    base = run_path.resolve()
    for key in ("state_path", "sampler_path"):
        p = out.get(key)
        if not _is_local(p):
            continue
        try:
            out[key] = str(Path(str(p)).resolve().relative_to(base))
        except ValueError:  # outside the run dir (a backend with its own storage): kept as given
            continue
        out["paths"] = "run"
    return out


def resolve_row(row: dict[str, Any], run_path: Path) -> dict[str, Any]:
    """A stored row with usable paths: run-relative ones joined to the run dir; an older row's path (absolute,
    or relative to where it ran) mapped onto this run dir's own checkpoints/ when that file is here, so a moved
    or copied run dir uses its own files."""
    out = dict(row)
    for key in ("state_path", "sampler_path"):
        p = out.get(key)
        if not _is_local(p):
            continue
        if row.get("paths") == "run" and not Path(str(p)).is_absolute():
            out[key] = str(run_path / str(p))
            continue
        parts = Path(str(p)).parts
        if "checkpoints" in parts:
            i = len(parts) - 1 - parts[::-1].index("checkpoints")
            own = run_path.joinpath(*parts[i:])
            if own.exists():
                out[key] = str(own)
    return out


def read_checkpoints(run_path: Path) -> list[dict[str, Any]]:
    """checkpoints.jsonl's rows with paths resolved (resolve_row): what every reader of the file should use."""
    return [resolve_row(r, run_path) for r in read_jsonl(run_path / CHECKPOINTS)]


def remove_stale_temps(path: Path) -> int:
    """Remove what an interrupted atomic save leaves (hidden temp folders under checkpoints/<kind>/, *.tmp
    files of the run dir's own atomic writes). Only called holding the lock, so no save is in progress."""
    n = 0
    for tmp in [*(path / "checkpoints").glob("*/.*"), *path.glob("*.tmp")]:
        with contextlib.suppress(OSError):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
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
    if os.getcwd() not in sys.path:  # as targets.import_object finds user modules
        sys.path.insert(0, os.getcwd())
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
