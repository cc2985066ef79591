"""`runner sweep`: many runs of one recipe, a grid of values, each point an ordinary run dir.

    runner sweep recipes.toml#sl_basic 'lr=[1e-3,4e-3]' 'lora.rank=[8,16]' max_steps=20 [--parallel N] [--zip]

What is swept:
- on the command line, a TOML array on a key is one run per value; several arrays make the product of them
  (`--zip`: they are paired instead, equal lengths, a one-value array goes with every pair). A key whose type
  is itself an array (`algo.env.prompts`) takes an array as its value, as `runner run` does: to sweep it, give
  an array of arrays, `algo.env.prompts=[["a"], ["b", "c"]]` (two points). An array of arrays sweeps any key.
- in the recipe, `[recipes.<name>.sweep]` holds the same thing as a table: every key holds the array of its
  values (`lr = [1e-3, 4e-3]`, `algo.env.prompts = [["a"], ["b"]]`), so `runner sweep FILE#name` runs it.
  `runner run` refuses such a recipe (it names no single run); `runner check` checks every point.
- a plain `key=value` applies to every point. On a key the recipe sweeps it pins that axis to one value, so
  `runner sweep FILE#name lr=1e-3` runs just that slice of the recipe's grid, in the same point dirs.

Where: the sweep dir is the recipe's log_dir (default runs/<name>); each point runs in
`<sweep dir>/<key=value,...>/` (swept keys only, sorted: `runs/sl_basic/lora.rank=8,lr=0.001`), a plain
run dir with its own config.toml (`runner run runs/sl_basic/lora.rank=8,lr=0.001/config.toml` resumes it by
hand), and `sweep.json` in the sweep dir records the grid: the recipe, the axes and every point's values and
dir. Every point is decoded, checked and its run dir inspected before anything starts: one bad point is one
line naming it and the key, exit 2.

How: each point is a `python -m runner run <point>/config.toml` subprocess, `--parallel` at a time (local
backend: the cores shared between them through OMP_NUM_THREADS, see default_parallel; Tinker: 8), its
output in `<point>/output.log`. A point that finished before is not started again; one that was killed resumes
from its last checkpoint (the loop's ordinary resume), so a killed sweep continues where it stopped. One point
failing does not stop the others; the exit code is 1 if any failed. `--dry-run` lists the points with their
status and starts nothing. At the end the sweep dir gets index.html: the comparison table and the curves
(runner/tools/compare.py, runner/tools/plot.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import queue as queues
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import msgspec
import msgspec.inspect as mi
import tomli_w

from backends.errors import UserError
from backends.types import Json
from runner.engine.chain import check_all, check_session
from runner.engine.rundir import CHECKPOINTS, CONFIG, METRICS, claim, dump_config, open_run_dir
from runner.engine.track import sweep_log
from runner.recipe.explain import NAME, child, got, info
from runner.recipe.explain import resolve as resolve_type
from runner.recipe.load import SWEEP_KEY, parse_override, pick, recipe_dict, resolve, show_value, toml_value
from runner.recipe.schema import Recipe

SWEEP_FILE = "sweep.json"
# The most points one sweep may have: each is a run dir and a process, and every point is decoded and checked
# before the first starts. A larger grid is refused up front, naming its size (docs/sweeps.md).
MAX_POINTS = 1000
OUTPUT_LOG = "output.log"
_ARRAY_TYPES = (mi.ListType, mi.TupleType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)


@dataclass
class Point:
    values: Json  # dotted key -> value, in axis order
    name: str  # its dir name under the sweep dir
    recipe: Recipe  # log_dir = its run dir
    status: str = "new"
    finished: bool = False


@dataclass
class Sweep:
    ref: str  # FILE#name
    name: str
    path: str  # the recipe file
    axes: dict[str, list[object]]  # dotted key -> values, in order
    plain: list[str]  # overrides that apply to every point (not in dir names)
    zip: bool
    dir: Path
    points: list[Point] = field(default_factory=list)


# ---------------------------------------------------------------- the grid

def sweep_table(raw: Json, where: str) -> dict[str, list[object]]:
    """The recipe's `sweep` table as {dotted key: values}; nested tables are dotted keys (`lora.rank`)."""
    table = raw.get(SWEEP_KEY)
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise UserError(f"{where}: {SWEEP_KEY}: expected a table of KEY = [values], got {got(table)}")
    out: dict[str, list[object]] = {}

    def walk(node: Json, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            if not NAME.match(key):
                raise UserError(f"{where}: {SWEEP_KEY}.{dotted}: not a recipe key (letters, digits, '_', '-')")
            if isinstance(value, dict):
                walk(value, f"{dotted}.")
            elif isinstance(value, list):
                out[dotted] = value
            else:
                raise UserError(f"{where}: {SWEEP_KEY}.{dotted}: expected an array of the values to sweep, "
                                f"got {got(value)}; write {dotted} = [{toml_value(value)}, ...]")
    walk(table, "")
    return out


def takes_array(raw: Json, keys: list[str]) -> bool:
    """Whether the schema says the field at `keys` holds an array (walking tagged unions by the raw tags, and
    tables the raw recipe leaves to their defaults by those defaults). Unknown keys: False."""
    node: object = raw
    t: mi.Type | None = info(Recipe)
    for key in keys[:-1]:
        t, f = child(t, node, key)
        if t is None:
            return False
        nxt = node.get(key) if isinstance(node, dict) else None
        if not isinstance(nxt, dict):
            default = f.default if f is not None else None
            nxt = msgspec.to_builtins(default) if isinstance(default, msgspec.Struct) else {}
        node = nxt
    t, _ = child(t, node, keys[-1])
    return t is not None and isinstance(resolve_type(t, None), _ARRAY_TYPES)


def sweep_override(text: str) -> tuple[list[str], object]:
    """parse_override, and a list of bare words (`backend.dtype=[bfloat16,float32]`, not TOML) as the list of
    those words, each taken as an override takes a value that is not a TOML literal: a string."""
    keys, value = parse_override(text)
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        inner = value[1:-1]
        items = [x.strip() for x in inner.split(",")]
        if items and not items[-1]:
            items.pop()  # a trailing comma, as TOML allows
        if items and all(items) and not any(c in inner for c in "[]{}\"'\n="):
            return keys, [parse_override(f"v={x}")[1] for x in items]
    return keys, value


def plan(ref: str, overrides: Sequence[str] = (), zip_: bool = False, *, need_axes: bool = True,
         inspect_dirs: bool = True) -> Sweep:
    """The sweep `ref` + `overrides` describe, every point decoded and checked (UserError naming the point and
    key otherwise), with each point's status from its run dir (`inspect_dirs`: a point whose run dir holds
    another recipe, or exists under if_exists = "error", is an error too). Nothing is written."""
    path, name, raw = pick(ref)
    where = f"{path}#{name}"
    axes = sweep_table(raw, where)
    plain: list[str] = []
    for text in overrides:
        keys, value = sweep_override(text)
        dotted = ".".join(keys)
        if dotted.split(".")[0] == SWEEP_KEY:
            raise UserError(f"{where}: {text!r}: sweep on the command line as KEY=[v1, v2], e.g. lr=[1e-4,3e-4]")
        nested = isinstance(value, list) and bool(value) and all(isinstance(v, list) for v in value)
        if isinstance(value, list) and (nested or not takes_array(raw, keys)):
            axes.pop(dotted, None)  # the command line's axis comes last and replaces the recipe's
            axes[dotted] = value
        elif dotted in axes:
            axes[dotted] = [value]
        else:
            plain.append(text)
    if need_axes and not axes:
        raise UserError(f"{where}: nothing to sweep: give KEY=[v1, v2, ...] (e.g. 'lr=[1e-4,3e-4]') or a "
                        f"[recipes.{name}.{SWEEP_KEY}] table")
    for key, values in axes.items():
        if not values:
            raise UserError(f"{where}: {key}: empty list: nothing to sweep (give at least one value)")
        if key.split(".")[0] == "log_dir":
            raise UserError(f"{where}: {key}: cannot be swept: each point runs in <sweep dir>/<its values>; set "
                            "log_dir (plain) to choose the sweep dir")
    grid = _grid(axes, zip_, where)
    with check_session():  # what the points share (an upstream, a teacher) is loaded and checked once
        sweep = _points(path, name, raw, where, axes, plain, zip_, grid)
    if not inspect_dirs:
        return sweep
    if (sweep.dir / CONFIG).exists():
        raise UserError(f"{sweep.dir} is a run dir (it has {CONFIG}), not a sweep dir: move it aside, or set "
                        f"log_dir=runs/<another name> for the sweep")
    if (foreign := _foreign_entry(sweep.dir)) is not None:
        raise UserError(f"{sweep.dir} exists and is not a sweep dir (it holds {foreign!r}); nothing there was changed. "
                        "Set log_dir to a new or empty folder for the sweep")
    for p in sweep.points:
        at = f"{where} point {p.name}"
        try:  # the run dir's own checks: if_exists = "error", or a dir that holds a different recipe
            note = open_run_dir(p.recipe, name, dry_run=True).note
        except UserError as e:
            raise UserError(f"{at}: {e}") from None
        p.status, p.finished = point_status(Path(p.recipe.log_dir or ""), p.recipe, note)
    return sweep


def _points(path: str, name: str, raw: Json, where: str, axes: dict[str, list[object]], plain: list[str],
            zip_: bool, grid: list[Json]) -> Sweep:
    """The sweep with every point of `grid` decoded and checked (its run dir not looked at yet)."""
    sweep = Sweep(ref=f"{path}#{name}", name=name, path=path, axes=axes, plain=plain, zip=zip_, dir=Path())
    seen: dict[str, Json] = {}
    for values in grid:
        pname = point_name(values)
        if pname in seen:
            raise UserError(f"{where}: point {pname} appears twice in the grid (a value repeated?)")
        seen[pname] = values
        at = f"{where} point {pname}"
        # A table before the keys inside it, whichever is swept: backend={...} then backend.lora_alpha=[16, 32].
        texts = sorted([f"{k}={toml_value(v)}" for k, v in values.items()] + plain,
                       key=lambda text: text.partition("=")[0].count("."))
        recipe = resolve(path, name, raw, texts, where=at)
        check_all(recipe, at)
        if not sweep.points:
            sweep.dir = Path(recipe.log_dir) if recipe.log_dir else Path("runs") / name
        recipe = _point_recipe(recipe, sweep.dir / pname, sweep.dir.name)
        sweep.points.append(Point(values, pname, recipe))
    return sweep


def _grid(axes: dict[str, list[object]], zip_: bool, where: str) -> list[Json]:
    """The points' values; a grid of more than MAX_POINTS points is refused before any is built."""
    keys = list(axes)
    sizes = " x ".join(f"{len(v):,} {k}" for k, v in axes.items())
    if not zip_:
        if (size := math.prod(len(v) for v in axes.values())) > MAX_POINTS:
            raise UserError(f"{where}: the grid has {size:,} points ({sizes}), more than {MAX_POINTS:,}; sweep fewer "
                            "values, or split it into several sweeps")
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*axes.values())]
    lengths = {len(v) for v in axes.values() if len(v) != 1}
    if len(lengths) > 1:
        sizes = ", ".join(f"{k} has {len(v)}" for k, v in axes.items())
        raise UserError(f"{where}: --zip pairs the values, so every swept key needs as many ({sizes})")
    n = lengths.pop() if lengths else 1
    if n > MAX_POINTS:
        raise UserError(f"{where}: --zip makes {n:,} points, more than {MAX_POINTS:,}; sweep fewer values, or split "
                        "it into several sweeps")
    return [{k: (v[i] if len(v) > 1 else v[0]) for k, v in axes.items()} for i in range(n)]


def _point_recipe(recipe: Recipe, run_dir: Path, sweep_name: str) -> Recipe:
    """A point's recipe as its config.toml records it: its run dir; `resume`, since the sweep itself applies the
    recipe's if_exists before starting it; its trackers grouped by sweep (runner/engine/track.py:sweep_log)."""
    return msgspec.structs.replace(recipe, log_dir=str(run_dir), log=sweep_log(recipe.log, sweep_name, run_dir.name))


# ---------------------------------------------------------------- names and values

def point_name(values: Json) -> str:
    """'lora.rank=8,lr=0.001': stable (the same values give the same name whatever else the grid holds and however
    the axes are ordered) and safe as a file name. A table value shows its keys (backend.kind=tinker), an array
    its items joined by '+'; other characters than letters, digits and ._+-@=, become '_', and then a hash of
    the exact values is added, so names stay unique."""
    parts: dict[str, str] = {}

    def add(key: str, v: object) -> None:
        if isinstance(v, dict) and v:
            for k, x in v.items():
                add(f"{key}.{k}", x)
        else:
            parts[key] = show_value(v)

    for key, v in values.items():
        add(key, v)
    # Keys in sorted order: the same point is the same dir however the axes were ordered (command line, table).
    text = ",".join(f"{k}={parts[k]}" for k in sorted(parts))
    safe = re.sub(r"[^A-Za-z0-9._+@=,-]", "_", text)
    if safe != text or len(safe) > 120:
        digest = hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:8]
        safe = f"{safe[:110]}-{digest}"
    return safe


# ---------------------------------------------------------------- status of a point's run dir

def point_status(run_dir: Path, recipe: Recipe, note: str) -> tuple[str, bool]:
    """(what the run dir holds, in words; whether the point is finished and need not start). Read only.

    Finished: its last checkpoint is the final one (the loop saves "final" after the last step), at max_steps
    if the recipe sets it (a larger max_steps extends the run), and for RL with evals, the final eval row is
    there. When unsure it says not finished: the loop then decides, and a finished run is a no-op there."""
    from runner.tools.compare import read_rows

    if "moved aside" in note:
        return "new (the old run dir is moved aside: if_exists = \"overwrite\")", False
    if not (run_dir / CONFIG).exists():
        return "new", False
    if "starts over" in note:
        return "new (nothing trained; the dir gives way to this recipe)", False
    states = [r for r in read_rows(run_dir / CHECKPOINTS) if r.get("state_path")]
    rows = read_rows(run_dir / METRICS)
    if not states:
        trained = [r for r in rows if "progress/done_frac" in r]
        return (f"partial: {len(trained)} steps logged, no checkpoint yet (starts again from step 0)" if trained
                else "new"), False
    last = states[-1]
    done = int(last.get("next_step", 0))
    final = str(last.get("name", "")).startswith("final")
    at_max = recipe.max_steps is None or done >= recipe.max_steps
    rl_eval_due = type(recipe.algo).__name__ == "RL" and recipe.eval_every > 0
    has_final_row = any(r.get("step") == done for r in rows)
    if final and at_max and (not rl_eval_due or has_final_row):
        return f"finished ({done} steps)", True
    if final and at_max:
        return f"trained {done} steps; the final eval is still to run", False
    return f"partial: {done} steps checkpointed, resumes at step {done}", False


# ---------------------------------------------------------------- running

def default_parallel(points: Sequence[Point]) -> int:
    """What each point's backend says it can run at once here (BackendConfig.sweep_parallel: Tinker 8, the local
    backend half the cores, or 1 where its runs share a GPU), the smallest of them; points on different backends share
    the machine."""
    cores = usable_cores()
    return min((p.recipe.backend.sweep_parallel(cores, p.recipe.model) for p in points), default=max(1, cores))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _foreign_entry(sweep_dir: Path) -> str | None:
    """The first entry of an existing sweep dir that a sweep does not write (sweep.json, the report's index.html and
    plot-*.png, point run dirs that rundir.claim accepts), else None: a sweep never writes into someone's folder."""
    if not sweep_dir.is_dir():
        return None if not sweep_dir.exists() else "."
    for entry in sorted(os.scandir(sweep_dir), key=lambda e: e.name):
        name = entry.name
        if entry.is_symlink():
            return name
        if name in (SWEEP_FILE, SWEEP_FILE + ".tmp", "index.html") or (name.startswith("plot-") and name.endswith(".png")):
            if entry.is_file():
                continue
            return name
        if not entry.is_dir():
            return name
        try:
            claim(Path(entry.path))
        except UserError:
            return name
    return None


def write_record(sweep: Sweep) -> None:
    """sweep.json: the recipe, the axes and every point's values and dir. Points of earlier invocations
    (another slice of the grid) are kept, and their axis values merged in."""
    path = sweep.dir / SWEEP_FILE
    try:
        old = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError:
        old = {}
    axes: dict[str, list[object]] = ({k: list(v) for k, v in old.get("axes", {}).items()} if isinstance(old, dict)
                                     else {})
    for key, values in sweep.axes.items():
        merged = axes.setdefault(key, [])
        for v in values:
            if (jv := _jsonable(v)) not in merged:
                merged.append(jv)
    points = {p["name"]: p for p in old.get("points", []) if isinstance(p, dict) and "name" in p}
    for p in sweep.points:
        points[p.name] = {"name": p.name, "dir": p.recipe.log_dir, "values": _jsonable(p.values)}
    record = {"recipe": sweep.ref, "name": sweep.name, "zip": sweep.zip, "overrides": sweep.plain, "axes": axes,
              "points": list(points.values())}
    sweep.dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def _jsonable(v: object) -> object:
    """`v` as sweep.json stores it (what JSON lacks, as its str)."""
    return json.loads(json.dumps(v, default=str))


def _prepare_dir(point: Point, name: str) -> None:
    """Before its process starts: apply the recipe's if_exists (overwrite moves an old run aside) and write the
    point's config.toml (the command below runs it, and `runner compare` sees the point from now on)."""
    open_run_dir(point.recipe, name).unlock()  # "overwrite": moves an old dir aside; else nothing is written
    run_dir = Path(point.recipe.log_dir or "")
    run_dir.mkdir(parents=True, exist_ok=True)
    config = run_dir / CONFIG
    if not config.exists():
        recipe = msgspec.structs.replace(point.recipe, if_exists="resume")
        tmp = config.with_name(CONFIG + ".tmp")
        tmp.write_text(dump_config(name, recipe), encoding="utf-8")
        os.replace(tmp, config)


def point_command(config: Path) -> list[str]:
    """A point's process: the ordinary `runner run` of its config.toml (which resumes it, or finds it finished)."""
    return [sys.executable, "-m", "runner", "run", str(config)]


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGKILL when the sweep process dies, so a killed sweep leaves no point
    running that its next invocation would run a second time in the same dir."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def run_sweep(sweep: Sweep, parallel: int | None, out: TextIO | None = None) -> int:
    """Run the points that are not finished, `parallel` at a time; one line per start and per finish. Returns
    the exit code: 0, 1 if any point failed, 130 if interrupted (each running point saves a checkpoint)."""
    from runner.tools.compare import main_metrics_line

    stream = out or sys.stdout

    def say(text: str) -> None:
        stream.write(text + "\n")
        stream.flush()

    todo = [p for p in sweep.points if not p.finished]
    n = parallel or default_parallel(todo)
    n = max(1, min(n, len(todo))) if todo else 1
    threads = max(1, usable_cores() // n)
    write_record(sweep)
    axes = " x ".join(sweep.axes)
    how = f"{n} at a time" + (f", {threads} thread{'s' if threads > 1 else ''} each"
                              if "OMP_NUM_THREADS" not in os.environ else "")
    say(f"sweep {sweep.dir}: {len(sweep.points)} points ({axes}); "
        + (f"{len(todo)} to run, {how}" if todo else "all finished before: nothing to run"))
    width = max(len(p.name) for p in sweep.points)
    total = len(sweep.points)
    index = {p.name: i + 1 for i, p in enumerate(sweep.points)}
    for p in sweep.points:
        if p.finished:
            say(f"[{index[p.name]}/{total}] {'done':<7}{p.name:<{width}}  earlier  "
                f"{main_metrics_line(Path(p.recipe.log_dir or ''))}")

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads))
    # User modules next to the recipe file stay importable from the point's config.toml.
    folder = str(Path(sweep.path).parent.resolve())
    env["PYTHONPATH"] = os.pathsep.join([p for p in (env.get("PYTHONPATH"), folder) if p])
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    queue = list(todo)
    running: dict[subprocess.Popen[bytes], tuple[Point, float]] = {}
    # Each point's exit is posted here by a thread that waits on it: the scheduler sleeps until a point ends (or a
    # Ctrl-C), no polling.
    ended: queues.SimpleQueue[subprocess.Popen[bytes]] = queues.SimpleQueue()
    failed: list[str] = []
    interrupts = 0
    while queue or running:
        try:
            while queue and len(running) < n and not interrupts:
                p = queue.pop(0)
                try:
                    _prepare_dir(p, sweep.name)
                except UserError as e:
                    say(f"[{index[p.name]}/{total}] {'FAILED':<7}{p.name:<{width}}  {e}")
                    failed.append(p.name)
                    continue
                run_dir = Path(p.recipe.log_dir or "")
                with open(run_dir / OUTPUT_LOG, "ab") as log:
                    log.write(f"--- runner sweep: {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
                    log.flush()
                    # Spawned from this one thread, so preexec_fn is safe; PR_SET_PDEATHSIG belongs to it.
                    proc = subprocess.Popen(
                        point_command(run_dir / CONFIG), stdin=subprocess.DEVNULL,
                        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                        preexec_fn=preexec)  # noqa: PLW1509
                running[proc] = (p, time.monotonic())
                threading.Thread(target=_post_exit, args=(proc, ended), daemon=True).start()
                say(f"[{index[p.name]}/{total}] {'start':<7}{p.name:<{width}}  {p.status}")
            if not running:
                continue
            for proc in _exited(ended):
                p, t0 = running.pop(proc)
                run_dir = Path(p.recipe.log_dir or "")
                took = f"{time.monotonic() - t0:.1f}s"
                if proc.returncode == 0:
                    say(f"[{index[p.name]}/{total}] {'done':<7}{p.name:<{width}}  {took}  {main_metrics_line(run_dir)}")
                elif proc.returncode == 130 and interrupts:  # Ctrl-C: it saved a checkpoint and said so
                    failed.append(p.name)
                    say(f"[{index[p.name]}/{total}] {'stopped':<7}{p.name:<{width}}  after {took}: "
                        f"{_last_error(run_dir / OUTPUT_LOG)}")
                else:
                    failed.append(p.name)
                    say(f"[{index[p.name]}/{total}] {'FAILED':<7}{p.name:<{width}}  exit {proc.returncode} after "
                        f"{took}: {_last_error(run_dir / OUTPUT_LOG)} (log: {run_dir / OUTPUT_LOG})")
        except KeyboardInterrupt:
            # The points run in their own sessions (a terminal's Ctrl-C reaches only this process): pass it on,
            # once (each finishes its submitted steps and saves a checkpoint), or again to make them quit now.
            interrupts += 1
            if queue:
                say(f"interrupted: {len(queue)} not started; waiting for {len(running)} running to save a "
                    "checkpoint (Ctrl-C again to stop them now)")
                queue.clear()
            for proc in running:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
    if interrupts:
        say(f"sweep interrupted: run the same command to continue ({sweep.dir})")
        return 130
    done = total - len(failed)
    say(f"sweep {sweep.dir}: {done} of {total} points done" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _post_exit(proc: subprocess.Popen[bytes], ended: queues.SimpleQueue[subprocess.Popen[bytes]]) -> None:
    proc.wait()
    ended.put(proc)


def _exited(ended: queues.SimpleQueue[subprocess.Popen[bytes]]) -> list[subprocess.Popen[bytes]]:
    """The points that have exited: blocks until one has (a Ctrl-C still interrupts the wait), then takes every other
    that has too."""
    done = [ended.get()]
    while not ended.empty():
        done.append(ended.get_nowait())
    return done


def _last_error(log: Path) -> str:
    """The line of a point's output that says what went wrong: its last 'error:' line, else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no output)"
    errors = [line for line in lines if line.startswith("error:") or "Error" in line.split(":")[0]]
    return (errors or lines or ["(no output)"])[-1]


def print_dry_run(sweep: Sweep, parallel: int | None, out: TextIO | None = None) -> None:
    stream = out or sys.stdout
    todo = [p for p in sweep.points if not p.finished]
    n = parallel or default_parallel(todo)
    todo_text = f"{len(todo)} to run, {max(1, min(n, len(todo)))} at a time" if todo else "nothing to run"
    stream.write(f"sweep {sweep.dir}: {len(sweep.points)} points ({' x '.join(sweep.axes)}); {todo_text}\n")
    width = max(len(str(p.recipe.log_dir)) for p in sweep.points)
    for p in sweep.points:
        stream.write(f"  {p.recipe.log_dir!s:<{width}}  {p.status}\n")
    if sweep.plain:
        stream.write(f"every point: {' '.join(sweep.plain)}\n")
    stream.flush()


# ---------------------------------------------------------------- check and show

def has_sweep(raw: Json) -> bool:
    return SWEEP_KEY in raw


def check_line(ref: str, overrides: Sequence[str]) -> str:
    """`runner check` of one recipe: 'ok  FILE#name', or for a recipe with a sweep table every point decoded and
    checked: 'ok  FILE#name (sweep: 4 points)'. Raises UserError (for a sweep, naming the point)."""
    path, name, raw = pick(ref)
    where = f"{path}#{name}"
    if has_sweep(raw):
        return f"ok  {where} (sweep: {len(plan(ref, overrides, inspect_dirs=False).points)} points)"
    check_all(resolve(path, name, raw, overrides), where, name=name)
    return f"ok  {where}"


def refuse_sweep(ref: str) -> None:
    """`runner run` of a recipe with a sweep table: it names many runs, not one."""
    path, name, raw = pick(ref)
    if has_sweep(raw):
        keys = ", ".join(sweep_table(raw, f"{path}#{name}"))
        raise UserError(f"{path}#{name} sweeps {keys} ([recipes.{name}.{SWEEP_KEY}]): run it with `runner sweep "
                        f"{path}#{name}` (KEY=VALUE there runs one slice of the grid)")


def show_sweep(ref: str, overrides: Sequence[str]) -> str | None:
    """`runner show` of a sweep: the recipe with every field resolved (the swept keys at their first values) and
    the sweep table as the command line leaves it, itself a sweep recipe that `runner sweep` runs the same way.
    None: no sweep (no sweep table, no array on a key that does not take one)."""
    path, name, raw = pick(ref)
    lists = any(isinstance(sweep_override(o)[1], list) for o in overrides)
    if not has_sweep(raw) and not lists:
        return None
    sweep = plan(ref, overrides, need_axes=False, inspect_dirs=False)
    if not sweep.axes:
        return None
    base = resolve(path, name, raw, [f"{k}={toml_value(v[0])}" for k, v in sweep.axes.items()] + sweep.plain)
    table: Json = {}
    for key, values in sweep.axes.items():
        node = table
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = values
    return tomli_w.dumps({"recipes": {name: {**recipe_dict(base), SWEEP_KEY: table}}})
