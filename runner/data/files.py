"""Reading a data source's raw rows, lazily, each with where it came from ("data.jsonl:17", "train.parquet[3]").

Kinds: `jsonl` (line by line, exact line numbers), `file` (by suffix: .jsonl/.ndjson, .json (an array, or JSON lines),
.parquet, .arrow (Arrow IPC file or stream, as `datasets` writes), or a folder written by `save_to_disk`), `hf` (a hub
dataset or a local dataset folder), `python` (user code) and `run_output` (a generate run's rows).

`iter_rows(source)` yields (row, where) without reading more than it yields: with `streaming = true` a .parquet or
.arrow file is read one record batch at a time (only the columns the format reads), a hub dataset is iterated without
downloading it whole, and `max_rows` stops reading after that many rows. Without streaming, columnar files are read
whole (one fast pass) and then yielded. A JSON array is parsed whole either way (use JSON lines for big sets).

Errors are one-line UserErrors: a missing or unreadable file (permissions), text that is not UTF-8 (file:line), a line
that is not JSON, a file Arrow cannot read.
"""

from __future__ import annotations

import itertools
import json
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TypeGuard

from backends.errors import UserError
from runner.recipe.common import DataSource, Python, RunOutput
from runner.recipe.formats import AUTO, columns, resolve_format
from runner.recipe.sources import HF, File, Jsonl
from runner.recipe.targets import import_target

if TYPE_CHECKING:
    import pyarrow as pa

    from backends.types import Json

# A raw row (whatever the file holds: a JSON value, an Arrow row's dict, what user code yields; readers check its
# shape) and where it came from.
Located = tuple[object, str]
Reader = Callable[[Path, bool, "list[str] | None"], Iterator[Located]]
BATCH_ROWS = 1024
# The sources that take `format`, `fields` and `max_rows` (schema.Mapped's subclasses).
MAPPED = (Jsonl, File, HF)


# Rows that `runner run`'s up-front check read (runner/data/check.py, keep=True), handed to the first iter_rows of the
# same source, so a run reads a local file once, not once to check it and again to train on it. Keyed by the source's
# table and its file's size and mtime (a file changed in between is read again); taken by that first read, so the
# memory is the loader's own; at most KEEP_ROWS rows kept in all (beyond, the file is simply read twice).
KEEP_ROWS = 2_000_000
_KEPT: dict[tuple[bytes, int, int], list[Located]] = {}


def can_keep(source: DataSource) -> TypeGuard[Jsonl | File]:
    """Whether keep_rows takes this source's rows: a local file read whole (jsonl, or a file kind not streamed)."""
    return isinstance(source, Jsonl) or (isinstance(source, File) and not source.streaming)


def _keep_key(source: DataSource) -> tuple[bytes, int, int] | None:
    if not can_keep(source):
        return None
    try:
        st = Path(source.path).stat()
    except OSError:
        return None
    import msgspec

    return msgspec.json.encode(source), st.st_size, st.st_mtime_ns


def keep_rows(source: DataSource, rows: list[Located]) -> bool:
    """Hold `rows` (all of iter_rows(source), just read) for the next iter_rows(source); False when not kept (not a
    local non-streaming file, or over KEEP_ROWS)."""
    key = _keep_key(source)
    if key is None or sum(map(len, _KEPT.values())) + len(rows) > KEEP_ROWS:
        return False
    _KEPT[key] = rows
    return True


def iter_rows(source: DataSource) -> Iterator[Located]:
    """The source's rows in order, each with its location; at most `max_rows` of them."""
    if _KEPT and (key := _keep_key(source)) is not None:
        kept = _KEPT.pop(key, None)
        for stale in [k for k in _KEPT if k[0] == key[0]]:  # kept before the file changed
            del _KEPT[stale]
        if kept is not None:
            return iter(kept)
    rows = _rows(source)
    limit = source.max_rows if isinstance(source, MAPPED) else None
    return itertools.islice(rows, limit) if limit else rows


def load_rows(source: DataSource) -> tuple[list[object], list[str]]:
    """(rows, location of each row): iter_rows, read in full."""
    rows: list[object] = []
    where: list[str] = []
    for row, w in iter_rows(source):
        rows.append(row)
        where.append(w)
    return rows, where


def describe(source: DataSource) -> str:
    match source:
        case Jsonl(path=path) | File(path=path):
            return path
        case HF(name=name):
            return name
        case Python(target=target):
            return target
        case RunOutput(run=run):
            return run
    return repr(source)


def needed_columns(source: DataSource) -> list[str] | None:
    """The columns a mapped source's format reads (None: all of them)."""
    if not isinstance(source, MAPPED):
        return None
    name = resolve_format(source.format, source.fields)
    return None if name == AUTO else sorted(set(columns(name, source.fields).values()))


def _rows(source: DataSource) -> Iterator[Located]:
    match source:
        case Jsonl(path=path):
            return read_jsonl(Path(path))
        case File(path=path, split=split, streaming=streaming):
            return _read_file(Path(path), split, streaming, needed_columns(source))
        case HF(name=name, split=split, subset=subset, streaming=streaming):
            return _read_hf(name, split, subset, streaming)
        case Python(target=target, args=args):
            return ((row, f"{target}()[{i}]") for i, row in enumerate(_call_python(target, args)))
        case RunOutput(run=ref):
            return _read_run_output(ref)
    raise TypeError(f"unknown data source {source!r}")


# ---------------------------------------------------------------- files


def _open(path: Path) -> BinaryIO:
    """The file opened for bytes, or a one-line UserError (not there, a folder, no permission, any OS error)."""
    if not path.exists():
        raise UserError(f"data file {path} not found (relative paths start at the working directory)")
    if path.is_dir():
        raise UserError(f"data file {path} is a folder, not a file")
    if (kind := _not_regular(path)) is not None:  # a FIFO would block the read, /dev/zero never end it
        raise UserError(f"data file {path} is {kind}, not a regular file")
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except PermissionError:
        raise UserError(f"data file {path}: cannot read it (permission denied)") from None
    except OSError as e:
        raise UserError(f"data file {path}: cannot read it ({e.strerror or type(e).__name__})") from None


def _not_regular(path: Path) -> str | None:
    """What `path` is when it is not a regular file (following links): "a FIFO (named pipe)", ...; else None."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # open() says what is wrong
    kinds = [(stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")]
    return None if stat.S_ISREG(mode) else next((what for test, what in kinds if test(mode)), "not a file")


def _utf8(raw: bytes, path: Path, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        "save the file as UTF-8") from None


def read_jsonl(path: Path) -> Iterator[Located]:
    """One JSON value per non-blank line, line by line."""
    with _open(path) as f:
        for n, raw in enumerate(f, start=1):
            line = _utf8(raw, path, n)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield row, f"{path}:{n}"


def _read_json(path: Path) -> Iterator[Located]:
    """A JSON array of rows (or, when the file does not start with '[', JSON lines)."""
    with _open(path) as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n")
        _utf8(data[data.rfind(b"\n", 0, e.start) + 1 :], path, line + 1)  # raises, naming the line
        raise
    if not text.lstrip().startswith("["):
        yield from read_jsonl(path)
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    for i, row in enumerate(rows):
        yield row, f"{path}[{i}]"


def _read_file(path: Path, split: str, streaming: bool, cols: list[str] | None) -> Iterator[Located]:
    if path.is_dir():
        yield from _read_disk(path, split, streaming)
        return
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise UserError(f"data file {path}: unknown kind {path.suffix or '(no suffix)'!r}; expected one of "
                        f"{', '.join(READERS)} or a folder written by save_to_disk")
    yield from reader(path, streaming, cols)


def _columnar(batches: Callable[[Path, list[str] | None], Iterator[pa.RecordBatch]]) -> Reader:
    """A reader of an Arrow-backed file kind, from its record-batch generator."""
    def read(path: Path, streaming: bool, cols: list[str] | None) -> Iterator[Located]:
        _open(path).close()  # a clear line for a missing or unreadable file before Arrow's own
        return _table_rows(path, batches(path, cols), streaming)

    return read


def _table_rows(path: Path, batches: Iterator[pa.RecordBatch], streaming: bool) -> Iterator[Located]:
    import pyarrow as pa

    def rows() -> Iterator[Located]:
        i = 0
        for batch in batches if streaming else iter([pa.Table.from_batches(list(batches))]):
            for row in batch.to_pylist():
                yield row, f"{path}[{i}]"
                i += 1

    try:
        yield from rows()
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"data file {path}: cannot read it as {path.suffix[1:]}: {_one_line(e)}") from None


def _parquet_batches(path: Path, cols: list[str] | None) -> Iterator[pa.RecordBatch]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    present = set(f.schema_arrow.names)
    columns = [c for c in cols if c in present] if cols else None
    for group in range(f.num_row_groups):  # one row group at a time: nothing past the rows taken is read
        yield from f.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=columns)


def _arrow_batches(path: Path, cols: list[str] | None) -> Iterator[pa.RecordBatch]:
    """An Arrow IPC file, or an IPC stream (what `datasets` writes as .arrow), memory-mapped."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
            batches: Iterable[pa.RecordBatch] = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:
            source.seek(0)
            batches = pa.ipc.open_stream(source)
        for batch in batches:
            if cols:
                batch = batch.select([c for c in cols if c in batch.schema.names])
            yield batch


def _read_disk(path: Path, split: str, streaming: bool) -> Iterator[Located]:
    """A folder written by Dataset.save_to_disk / DatasetDict.save_to_disk (memory-mapped Arrow)."""
    import datasets

    if not any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
        raise UserError(f"data folder {path}: not a folder written by save_to_disk (no dataset_info.json or "
                        "dataset_dict.json); give a data file instead")
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises many types
        raise UserError(f"data folder {path}: {type(e).__name__}: {_one_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"data folder {path}: no split {split!r}; it has: {', '.join(map(str, ds))}")
        ds = ds[split]
    for i, row in enumerate(ds.to_iterable_dataset() if streaming else ds):
        yield row, f"{path}[{split}][{i}]"


def _read_hf(name: str, split: str, subset: str | None, streaming: bool) -> Iterator[Located]:
    if Path(name).is_dir():
        yield from _read_disk_or_files(Path(name), split, subset, streaming)
        return
    import datasets

    try:
        ds = datasets.load_dataset(name, subset, split=split, streaming=streaming)
    except Exception as e:  # noqa: BLE001 - the hub, the cache and the builders all raise their own types
        raise UserError(f"HF dataset {name!r} (split {split!r}): {type(e).__name__}: {_one_line(e)}") from None
    for i, row in enumerate(ds):
        yield row, f"{name}[{split}][{i}]"


def _read_disk_or_files(path: Path, split: str, subset: str | None, streaming: bool) -> Iterator[Located]:
    """A local folder: save_to_disk output, else a folder of data files `datasets` can load by itself."""
    if any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
        yield from _read_disk(path, split, streaming)
        return
    import datasets

    try:
        ds = datasets.load_dataset(str(path), subset, split=split, streaming=streaming)
    except Exception as e:  # noqa: BLE001
        raise UserError(f"HF dataset folder {path} (split {split!r}): {type(e).__name__}: {_one_line(e)}") from None
    for i, row in enumerate(ds):
        yield row, f"{path}[{split}][{i}]"


# `file` sources by suffix: a new kind is one entry here. A reader gets (path, streaming, the columns the format reads).
READERS: dict[str, Reader] = {
    ".jsonl": lambda path, streaming, cols: read_jsonl(path),
    ".ndjson": lambda path, streaming, cols: read_jsonl(path),
    ".json": lambda path, streaming, cols: _read_json(path),
    ".parquet": _columnar(_parquet_batches),
    ".arrow": _columnar(_arrow_batches),
}


# ---------------------------------------------------------------- code and other runs


def _call_python(target: str, args: Json) -> list[object]:
    fn = import_target(target)
    try:
        rows = fn(**args)
    except Exception as e:  # noqa: BLE001 - user code: report, don't trace
        raise UserError(f"data target {target!r} raised {type(e).__name__}: {_one_line(e)}") from None
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Iterable):
        raise UserError(f"data target {target!r} must return an iterable of rows, got {type(rows).__name__}")
    return list(rows)


def _read_run_output(ref: str) -> Iterator[Located]:
    """The rows a generate run wrote (generated/step_*.jsonl, in step order). `ref` is absolute (loading made it so):
    "/abs/file.toml#name" (that recipe's run dir) or a run dir."""
    from runner.recipe.load import load_recipe
    from runner.recipe.refs import output_files, run_dir_path

    file, sep, _ = ref.rpartition("#")
    if sep:
        if not Path(file).is_file():
            raise UserError(f"run_output {ref!r}: recipe file not found: {file or '(this file)'}")
        name, recipe = load_recipe(ref)
        run_dir, label = run_dir_path(recipe, name).resolve(), f"#{name}"
    else:
        run_dir = label = Path(ref)
    files = output_files(Path(run_dir))
    if not files:
        raise UserError(f"run_output {label}: {run_dir} has generated nothing yet; `runner run` of this "
                        "recipe runs it first")
    for f in files:
        yield from read_jsonl(f)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
