"""Dataset readers: a recipe's data source -> validated rows, each with where it came from.

Sources: `Jsonl` (a local file), `HF` (a hub dataset, or a local folder written by save_to_disk or
holding data files), `Python` (`pkg.mod:fn`, called with the recipe's args, returning rows).
Every row keeps a location ("data.jsonl:17", "hub:org/ds[train][3]") so a bad row is a one-line
UserError that says where to look.

Local JSONL is read line by line with `json` rather than through `datasets`: it gives exact line
numbers, and Arrow's schema unification would add `None` keys to every message (e.g. a "name" that
one row has), which chat templates then render.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from backends.errors import UserError
from runner.recipe.schema import HF, DataSource, Jsonl, Python, RunOutput
from runner.recipe.targets import import_target

Message = dict[str, str]
Conversation = list[Message]


def load_rows(source: DataSource) -> tuple[list[Any], list[str]]:
    """(rows, location of each row)."""
    match source:
        case Jsonl(path=path):
            return _read_jsonl(Path(path))
        case HF(name=name, split=split, subset=subset):
            rows = _read_hf(name, split, subset)
            return rows, [f"{name}[{split}][{i}]" for i in range(len(rows))]
        case Python(target=target, args=args):
            rows = _call_python(target, args)
            return rows, [f"{target}()[{i}]" for i in range(len(rows))]
        case RunOutput(run=ref):
            return _read_run_output(ref)
    raise TypeError(f"unknown data source {source!r}")


def _read_run_output(ref: str) -> tuple[list[Any], list[str]]:
    """The rows a generate run wrote (generated/step_*.jsonl, in step order)."""
    from runner.engine.chain import resolve_ref  # reads run dirs: only for run_output sources
    from runner.engine.rundir import output_files

    stage = resolve_ref(ref, f"run_output {ref!r}")
    files = output_files(stage.run_dir)
    if not files:
        raise UserError(f"run_output {stage.label}: {stage.run_dir} has generated nothing yet; `runner run` of this "
                        "recipe runs it first")
    rows: list[Any] = []
    where: list[str] = []
    for f in files:
        r, w = _read_jsonl(f)
        rows += r
        where += w
    return rows, where


def load_conversations(source: DataSource) -> tuple[list[Conversation], list[str]]:
    rows, where = load_rows(source)
    if not rows:
        raise UserError(f"data source {_describe(source)} has no rows")
    return [conversation(row, w) for row, w in zip(rows, where, strict=True)], where


def conversation(row: Any, where: str) -> Conversation:
    """A row's messages, checked: {"messages": [{"role": str, "content": str}, ...]} with at least one
    message. Keys that are None (Arrow fills them in) are dropped; other extra keys are kept for the
    chat template (e.g. "name")."""
    if not isinstance(row, dict) or "messages" not in row:
        raise UserError(f"{where}: expected an object with a \"messages\" list")
    return messages_of(row["messages"], where, "messages")


def messages_of(messages: Any, where: str, key: str) -> Conversation:
    """`messages` (the value of `key` in the row at `where`) checked as a non-empty list of
    {"role": str, "content": str}; None-valued keys dropped."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: \"{key}\" must be a non-empty list of messages")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"{where}: {key}[{j}] must be an object with \"role\" and \"content\"")
        m = {k: v for k, v in m.items() if v is not None}
        for field in ("role", "content"):
            if not isinstance(m.get(field), str):
                raise UserError(f"{where}: {key}[{j}].{field} must be a string")
        if not m["role"]:
            raise UserError(f"{where}: {key}[{j}].role is empty")
        out.append(m)
    return out


def _read_jsonl(path: Path) -> tuple[list[Any], list[str]]:
    if not path.is_file():
        raise UserError(f"data file {path} not found (relative paths start at the working directory)")
    rows, where = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
            where.append(f"{path}:{n}")
    return rows, where


def _read_hf(name: str, split: str, subset: str | None) -> list[Any]:
    import datasets

    try:
        if (Path(name) / "dataset_info.json").exists() or (Path(name) / "dataset_dict.json").exists():
            ds = datasets.load_from_disk(name)  # a folder written by save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[split]
        else:
            ds = datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # noqa: BLE001 - the hub, the cache and the builders all raise their own types
        raise UserError(f"HF dataset {name!r} (split {split!r}): {type(e).__name__}: {_one_line(e)}") from None
    return list(ds)


def _call_python(target: str, args: dict[str, Any]) -> list[Any]:
    fn = import_target(target)
    try:
        rows = fn(**args)
    except Exception as e:  # noqa: BLE001 - user code: report, don't trace
        raise UserError(f"data target {target!r} raised {type(e).__name__}: {_one_line(e)}") from None
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Iterable):
        raise UserError(f"data target {target!r} must return an iterable of rows, got {type(rows).__name__}")
    return list(rows)


def _describe(source: DataSource) -> str:
    match source:
        case Jsonl(path=path):
            return path
        case HF(name=name):
            return name
        case Python(target=target):
            return target
    return repr(source)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
