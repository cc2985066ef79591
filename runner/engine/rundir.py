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
"""

from __future__ import annotations

import json
import os
import shutil
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from backends.errors import UserError
from runner.engine.log import append_jsonl, read_jsonl, write_jsonl_atomic
from runner.engine.track import start_tracker
from runner.recipe.load import dump_recipe, load_recipe

# Where runs live and what a generate run writes: defined with the references, re-exported here.
from runner.recipe.refs import OUTPUT as OUTPUT
from runner.recipe.refs import output_files as output_files
from runner.recipe.refs import run_dir_path as run_dir_path
from runner.recipe.schema import Recipe

CONFIG, METRICS, CHECKPOINTS, SESSIONS = "config.toml", "metrics.jsonl", "checkpoints.jsonl", "sessions.jsonl"
# A chained run's starting point (runner/engine/chain.py): the upstream's ref, recipe (TOML) and checkpoint.
INIT = "init_from.json"
# What a generate run writes (runner/algos/generate.py): generated/step_NNNNNN.jsonl.
# Keys that may change between a run and its resumption: extending a run is a new max_steps, the
# directory itself is the run's identity, and where metrics are also sent (log) and the `--smoke` stand-ins (smoke) are
# not part of the training.
RESUMABLE_CHANGES = ("max_steps", "if_exists", "log_dir", "log", "smoke")


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

    @property
    def start_step(self) -> int:
        return int(self.resume["next_step"]) if self.resume else 0

    def begin(self) -> float:
        """Commit to training from start_step: write config.toml, drop metrics rows at or after
        start_step (backup kept), record the session. Returns the time/total spent before start_step."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.init is not None and (self.start_step == 0 or not (self.path / INIT).exists()):
            _write_atomic(self.path / INIT, json.dumps(self.init, indent=1) + "\n")
        # The run dir is recorded too (log_dir), so config.toml says where its run lives even when the recipe
        # left it to the default.
        recipe = msgspec.structs.replace(self.recipe, log_dir=self.recipe.log_dir or str(self.path))
        _write_atomic(self.path / CONFIG, dump_config(self.name, recipe))
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
            shutil.copyfile(metrics, backup)
            write_jsonl_atomic(metrics, kept)
        self.tracker = start_tracker(recipe, self.path)
        return float(kept[-1].get("time/total", 0.0)) if kept else 0.0

    def end(self, status: str) -> None:
        """The session is over ("success", "interrupted", "error"): close the tracker, if any."""
        if self.tracker is not None:
            tracker, self.tracker = self.tracker, None
            tracker.finish(status)

    def checkpoint_name(self, step: int, last: bool) -> str:
        """Named by steps done (000020 = after 20 steps), "final" after the last one."""
        base = "final" if last else f"{step + 1:06d}"
        return base if self.session == 1 else f"{base}-s{self.session}"

    def log_metrics(self, row: dict[str, Any]) -> None:
        append_jsonl(self.path / METRICS, row)
        if self.tracker is not None:
            self.tracker.log(row)

    def add_checkpoint(self, row: dict[str, Any]) -> None:
        append_jsonl(self.path / CHECKPOINTS, row)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / METRICS)

    def has_row(self, step: int) -> bool:
        """Whether metrics.jsonl holds a row for `step` (at step = total steps: the final row was logged)."""
        return any(r.get("step") == step for r in self.metrics())

    def checkpoints(self) -> list[dict[str, Any]]:
        return read_jsonl(self.path / CHECKPOINTS)


def open_run_dir(recipe: Recipe, name: str, *, dry_run: bool = False, init: dict[str, Any] | None = None) -> RunDir:
    """Apply recipe.if_exists to the run directory. Nothing is written here except that "overwrite"
    moves an old directory aside (never deletes it); with dry_run nothing at all changes. `init`: a chained
    recipe's starting point, which must be the one recorded when the run dir trained."""
    path = run_dir_path(recipe, name)
    run = RunDir(path, name, recipe, init=init)
    if not path.exists() or not any(path.iterdir()):
        return run
    if recipe.if_exists == "error":
        raise UserError(f"run dir {path} already exists (if_exists = \"error\"); set if_exists or log_dir")
    if recipe.if_exists == "overwrite":
        aside = path.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        n = 1
        while aside.exists() or aside.is_symlink():  # two overwrites within a second: never rename onto one
            n += 1
            aside = aside.with_name(f"{path.name}.old-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        if not dry_run:
            path.rename(aside)
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
    run.resume = states[-1] if states else None
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
        if entry.name in (CONFIG, SESSIONS, INIT):
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
    return [k for k in keys if k.split(".")[0] not in RESUMABLE_CHANGES and fa.get(k) != fb.get(k)]


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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
