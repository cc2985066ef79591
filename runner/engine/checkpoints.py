"""checkpoints.jsonl's rows and the states they name (runner/engine/rundir.py keeps the run dir around them).

A row is written only after its save finished ({name, step, next_step, state_path, sampler_path, ...}: loop.py).
Local paths inside the run dir are stored relative to it ("paths": "run"), so a moved or copied run dir resumes from
its own files; an older row's absolute path is mapped onto this dir's checkpoints/ when the file is there
(`resolve_row`). Only states runner wrote there, by name and never through a link, are ever deleted (`own_state`).
Every reader of the file goes through `checkpoints_of` (typed rows, `Checkpoint`) or `read_checkpoints` (the rows as
dicts, for tools that print them); both read it with `stored_rows`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

import msgspec

from backends.errors import UserError
from runner.engine.log import read_jsonl
from runner.recipe.common import Json

CHECKPOINTS = "checkpoints.jsonl"
# What the local backend saves under checkpoints/ (backends/local/backend.py: checkpoints/<kind>/<name>, written into
# a temp folder .<name>.XXXXXXXX, tempfile.mkdtemp's 8 random characters, then renamed) and the fake backend
# (checkpoints/<...>_<name>.npz); <name> is the loop's RunDir.checkpoint_name.
CHECKPOINT_KINDS = ("weights", "sampler_weights")
CHECKPOINT_NAME = r"(\d{6}|final)(-s\d+)?"
SAVE_TEMP = re.compile(rf"\.{CHECKPOINT_NAME}\.[a-z0-9_]{{8}}")
_OWN_STATE = re.compile(CHECKPOINT_NAME)
_OWN_NPZ = re.compile(rf"[^/]*_{CHECKPOINT_NAME}\.npz")


class RowPaths(msgspec.Struct):
    """The path fields of a checkpoint row (the row's other fields pass through untouched). A path is local when it
    is a non-empty string without "://" (a service's is a URL)."""

    state_path: str | None = None
    sampler_path: str | None = None
    paths: str | None = None  # "run": the local paths are relative to the run dir

    @staticmethod
    def of(row: Json) -> RowPaths:
        """The row's path fields; none when one is not a string (a hand-edited row: nothing local to map)."""
        try:
            return msgspec.convert(row, RowPaths)
        except msgspec.ValidationError:
            return RowPaths()

    def local(self) -> dict[str, str]:
        """state_path / sampler_path -> the path, for the local ones."""
        return {k: p for k, p in (("state_path", self.state_path), ("sampler_path", self.sampler_path))
                if p and "://" not in p}


class SavedCost(msgspec.Struct, kw_only=True):
    """A checkpoint row's `cost`: the tokens and dollars spent up to it (runner/engine/cost.py Ledger.checkpoint()),
    which a resumed run continues from. A count absent in an older row is 0."""

    train: int = 0
    sample: int = 0
    prefill: int = 0
    usd: float = 0.0


class Checkpoint(msgspec.Struct, kw_only=True, frozen=True):
    """One row of checkpoints.jsonl, typed: what runner reads of it by name. `row` is the row itself (local paths
    resolved, `resolve_row`), which also carries the keys only the algorithm reads (its data position, from
    Algorithm.state(): what its load_state() gets back) and is what the file stores (`relative_row`), byte for byte."""

    name: str
    next_step: int  # steps done: a resume starts at this step
    step: int | None = None  # the step it was saved after (next_step - 1); absent in a hand-written row
    state_path: str | None = None  # the training state (weights and optimizer): a resume loads it
    sampler_path: str | None = None  # the sampler weights: export, sample, chat and a chain's downstream use them
    cost: SavedCost | None = None
    row: Json = {}

    @staticmethod
    def of(row: Json, where: str = CHECKPOINTS) -> Checkpoint:
        """The typed row (UserError, naming `where`, for a row without a name or next_step, or with a field of the
        wrong type: a hand-edited file)."""
        try:
            typed = msgspec.convert({k: v for k, v in row.items() if k in _READ_CHECKPOINT}, Checkpoint)
        except msgspec.ValidationError as e:
            raise UserError(f"{where}: a checkpoint row that runner cannot read ({e}): fix or remove it") from None
        return msgspec.structs.replace(typed, row=row)


# The keys converted (an algorithm's own keys, one named "row" included, stay in `row` alone).
_READ_CHECKPOINT = frozenset(f.encode_name for f in msgspec.structs.fields(Checkpoint) if f.name != "row")


def relative_row(row: Json, run_path: Path) -> Json:
    """The row as checkpoints.jsonl stores it: local state/sampler paths inside the run dir made relative to it."""
    out = dict(row)
    for key, p in RowPaths.of(row).local().items():
        if (rel := _in_run_dir(p, run_path)) is not None:
            out[key], out["paths"] = rel, "run"
    return out


def _in_run_dir(p: str, run_path: Path) -> str | None:
    """`p` relative to the run dir: as written (a linked checkpoints/ stays checkpoints/...), under checkpoints/'s
    target (a backend that resolved its storage dir, as the local one does), or with links resolved on both sides;
    None: outside it (a backend with its own storage)."""
    ckpts = run_path / "checkpoints"
    for path, base, prefix in [(Path(os.path.abspath(p)), Path(os.path.abspath(run_path)), ""),
                               (Path(os.path.abspath(p)), ckpts.resolve(), "checkpoints"),
                               (Path(p).resolve(), run_path.resolve(), "")]:
        try:
            return str(Path(prefix, path.relative_to(base)))
        except ValueError:
            continue
    return None


def resolve_row(row: Json, run_path: Path) -> Json:
    """A stored row with usable paths: run-relative ones joined to the run dir; an older row's path (absolute,
    or relative to where it ran) mapped onto this run dir's own checkpoints/ when that file is here, so a moved
    or copied run dir uses its own files."""
    out = dict(row)
    paths = RowPaths.of(row)
    for key, p in paths.local().items():
        if paths.paths == "run" and not Path(p).is_absolute():
            out[key] = str(run_path / p)
            continue
        parts = Path(p).parts
        if "checkpoints" in parts:
            i = len(parts) - 1 - parts[::-1].index("checkpoints")
            own = run_path.joinpath(*parts[i:])
            if own.exists():
                out[key] = str(own)
    return out


def stored_rows(run_path: Path) -> list[Json]:
    """checkpoints.jsonl's rows as stored (paths as written): the one read of the file."""
    return read_jsonl(run_path / CHECKPOINTS)


def read_checkpoints(run_path: Path) -> list[Json]:
    """checkpoints.jsonl's rows with paths resolved (resolve_row), as dicts."""
    return [resolve_row(r, run_path) for r in stored_rows(run_path)]


def checkpoints_of(run_path: Path) -> list[Checkpoint]:
    """checkpoints.jsonl's rows with paths resolved, typed: what the engine reads."""
    where = run_path / CHECKPOINTS
    return [Checkpoint.of(r, f"{where}: row {i}") for i, r in enumerate(read_checkpoints(run_path), 1)]


def own_state(run_path: Path, state: str) -> Path | None:
    """The saved state `state` when it is one runner wrote in the run dir's checkpoints/ (by name: <kind>/<name> of
    the local backend, *_<name>.npz of the fake one; <name> a checkpoint name) and no part of it below checkpoints/
    is a link; else None. Deleting anything else (a row of a copied checkpoints.jsonl naming a linked folder's
    files) is never ours to do."""
    if "://" in state or (rel := _in_run_dir(state, run_path)) is None or Path(rel).parts[:1] != ("checkpoints",):
        return None
    root = Path(os.path.abspath(run_path / "checkpoints"))
    parts = Path(rel).parts[1:]
    ours = ((len(parts) == 2 and parts[0] in CHECKPOINT_KINDS and bool(_OWN_STATE.fullmatch(parts[1])))
            or (len(parts) == 1 and bool(_OWN_NPZ.fullmatch(parts[0]))))
    if not ours or not all(plain(root.joinpath(*parts[: i + 1])) for i in range(len(parts))):
        return None
    return root.joinpath(*parts)


def remove_own_state(run_path: Path, state: str) -> bool:
    """Delete a saved state of this run dir (own_state: ours by name, not through a link); whether it went."""
    path = own_state(run_path, state)
    if path is None:
        return False
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(path.lstat().st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
        return True
    return False


def names_in(folder: Path) -> list[str]:
    """The entries of `folder`, sorted ([] when it cannot be listed)."""
    try:
        return sorted(os.listdir(folder))
    except OSError:
        return []


def plain(path: Path, kind: Callable[[int], bool] | None = None) -> bool:
    """Whether `path` exists and is not a link (and, given `kind`, e.g. stat.S_ISDIR, is of that kind)."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return False
    return not stat.S_ISLNK(mode) and (kind is None or kind(mode))
