"""`runner check` of a data source: every row read and validated as `runner run` will, without torch or a model.

A file (jsonl, file, a local hf folder) is read in full, through its format: an unreadable or non-UTF-8 file, a line
that is not JSON, a missing mapped column, a message with an unknown role or a row of no known shape is the same
one-line UserError that `run` gives. A streaming source is checked on its first STREAMING_ROWS rows; hub datasets
(which need the network) and `python` / `run_output` sources (user code, other runs) are checked when they are read.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec

from backends.errors import UserError
from runner.data.conversations import conversation
from runner.data.files import Located, can_keep, iter_rows, keep_rows
from runner.data.problems import problem
from runner.recipe.common import DataSource
from runner.recipe.explain import dotted
from runner.recipe.formats import AUTO, FORMATS, FormatError, map_row, resolve_format
from runner.recipe.load import structs
from runner.recipe.schema import Recipe
from runner.recipe.sources import HF, DataBase, File, Jsonl

STREAMING_ROWS = 1000
SHAPES = ("conversation", "comparison", "problem")


# Sources already checked, by (the source's table, its path's size and mtime): a sweep checks every point, and its
# points mostly share their data.
_CHECKED: dict[tuple[bytes, tuple[int, int]], int] = {}


def check_data(recipe: Recipe, where: str, keep: bool = False) -> None:
    """Every data source of a recipe checked (check_source); UserError prefixed with `where` and the key path.
    keep: the algorithm's own data rows are kept for its loader to take (files.keep_rows): `runner run` of a recipe
    that trains next, so its file is read once."""
    for path, node in structs(recipe, ()):
        if isinstance(node, DataBase):
            # An algorithm's own data (SFT conversations, comparisons, distillation prompts) has a known shape; an
            # env's or an eval's rows carry the fields that env reads (tests, rubrics, tools), which it checks itself.
            strict = path[:1] == ("algo",) and "env" not in path
            try:
                check_source(node, strict, keep and strict)  # pyright: ignore[reportArgumentType] (a DataSource)
            except UserError as e:
                raise UserError(f"{where}: {dotted(list(path))}: {e}") from None


def check_source(source: DataSource, strict: bool = True, keep: bool = False) -> int:
    """Read and validate the source's rows; the number checked (0: a source checked only when it is read).
    strict = False: rows of no known shape pass (the file is still read: encoding, JSON, permissions). keep: the rows
    read are held for the next iter_rows of the source (files.keep_rows)."""
    if not isinstance(source, (Jsonl, File, HF)) or (isinstance(source, HF) and not Path(source.name).is_dir()):
        return 0
    try:
        stat = Path(source.name if isinstance(source, HF) else source.path).stat()
    except OSError:
        return _check(source, strict)  # which says what is wrong with the path
    key = (msgspec.json.encode(source) + bytes([strict]), (stat.st_size, stat.st_mtime_ns))
    if key not in _CHECKED:
        _CHECKED[key] = _check(source, strict, keep)
    return _CHECKED[key]


def _check(source: Jsonl | File | HF, strict: bool = True, keep: bool = False) -> int:
    streaming = isinstance(source, (File, HF)) and source.streaming
    rows = itertools.islice(iter_rows(source), STREAMING_ROWS if streaming else None)
    name = resolve_format(source.format, source.fields)
    kept: list[Located] | None = [] if keep and can_keep(source) else None
    n = 0
    for row, where in rows:
        if kept is not None:
            kept.append((row, where))
        if name == AUTO:
            _check_row(row, where, strict)
        else:
            for shape in SHAPES:
                if FORMATS[name].mapper(shape) is None:
                    continue
                try:
                    mapped = map_row(row, name, source.fields, shape)
                except FormatError as e:
                    raise UserError(f"{where}: {e}") from None
                if mapped is not None:
                    _validate(shape, mapped, where)
        n += 1
    if kept is not None:
        keep_rows(source, kept)
    return n


def _validate(shape: str, row: object, where: str) -> None:
    if shape == "conversation":
        conversation(row, where)
    elif shape == "comparison":
        from runner.data.comparisons import parse_row  # numpy and rendering: only for comparison data

        parse_row(row, where)
    else:
        problem(row, where)


def _check_row(row: object, where: str, strict: bool = True) -> None:
    """A row taken as it is: validated as the shape its keys say (not strict: only conversations and comparisons,
    whose keys leave no doubt; anything else is the env's to read)."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object (one JSON object per row), got {type(row).__name__}")
    if "messages" in row:
        return _validate("conversation", row, where)
    if row.keys() & {"comparison", "chosen", "rejected"}:
        return _validate("comparison", row, where)
    if not strict:
        return None
    if row.keys() & {"question", "answer"}:
        return _validate("problem", row, where)
    have = ", ".join(map(repr, row)) or "none"
    raise UserError(f"{where}: a row of no known shape (columns: {have}); expected \"messages\", \"prompt\" + "
                    "\"chosen\" + \"rejected\", \"comparison\" + \"label\" or \"question\" + \"answer\", or a source "
                    "`format` that maps these columns (docs/datasets.md)")
