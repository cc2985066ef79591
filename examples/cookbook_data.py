"""Data sources for examples/cookbook.toml: the cookbook's hub datasets in the row formats runner reads.

Each function is a `{kind = "python", target = "cookbook_data:<fn>", args = {...}}` data source (imported from the
recipe file's folder). With `path` it reads a local JSONL file of the hub's rows instead of the hub, which is what
the recipes' `smoke` tables do: the same conversion, offline, on a few shipped rows (examples/data/).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from backends.errors import UserError


def _rows(name: str, split: str, path: str | None, limit: int | None, subset: str | None = None) -> list[Any]:
    """The hub dataset `name` (or the local JSONL `path` of the same rows), the first `limit` rows."""
    if path is not None:
        p = _local(path)
        if not p.is_file():
            raise UserError(f"cookbook_data: file not found: {path}")
        rows = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        import datasets

        ds = datasets.load_dataset(name, subset, split=split)
        rows = list(ds if limit is None else ds.select(range(min(limit, len(ds)))))  # type: ignore[union-attr]
    return rows[:limit] if limit else rows


def _local(path: str) -> Path:
    """A relative path: from the working directory, else next to this file (as recipe data paths)."""
    p = Path(path)
    return p if p.is_absolute() or p.is_file() else Path(__file__).parent / p


# ---------------------------------------------------------------- Anthropic/hh-rlhf (preference/dpo, preference/rlhf)

_TURN = re.compile(r"\n\n(Human|Assistant): ")


def hh_conversation(text: str) -> list[dict[str, str]]:
    """"\\n\\nHuman: ...\\n\\nAssistant: ..." -> messages (the cookbook's _hhh_parse_conversation)."""
    parts = _TURN.split(text)
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[parts[i]], "content": parts[i + 1].strip()} for i in range(1, len(parts) - 1, 2)]


def hh_comparison(row: dict[str, str]) -> dict[str, Any] | None:
    """One hh-rlhf row as {"prompt", "chosen", "rejected"}; None when the two transcripts differ before their last
    turn (the malformed rows the cookbook skips too)."""
    chosen, rejected = hh_conversation(row["chosen"]), hh_conversation(row["rejected"])
    if len(chosen) != len(rejected) or not chosen or chosen[:-1] != rejected[:-1] or chosen[-1] == rejected[-1]:
        return None
    if chosen[-1]["role"] != "assistant":
        return None
    return {"prompt": chosen[:-1], "chosen": [chosen[-1]], "rejected": [rejected[-1]]}


def hh_rlhf(split: str = "train", path: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """Anthropic/hh-rlhf as comparisons (chosen = the preferred transcript's last reply)."""
    rows = _rows("Anthropic/hh-rlhf", split, path, limit)
    out = [c for row in rows if (c := hh_comparison(row)) is not None]
    if not out:
        raise UserError(f"cookbook_data.hh_rlhf: no usable comparison in {path or 'Anthropic/hh-rlhf'}")
    return out


# ---------------------------------------------------------------- prompts (distillation)


def first_user_prompts(name: str = "allenai/tulu-3-sft-mixture", split: str = "train", path: str | None = None,
                       limit: int | None = None) -> list[dict[str, Any]]:
    """{"messages": [the first user message]} of each chat row (the cookbook's load_tulu3_prompts)."""
    out = []
    for row in _rows(name, split, path, limit):
        first = next((m["content"] for m in row["messages"] if m["role"] == "user" and m["content"]), None)
        if first:
            out.append({"messages": [{"role": "user", "content": first}]})
    return out


def question_prompts(name: str = "zwhe99/DeepMath-103K", split: str = "train", path: str | None = None,
                     limit: int | None = None, field: str = "question") -> list[dict[str, Any]]:
    """{"messages": [user: row[field]]} (the cookbook's load_deepmath_prompts)."""
    return [{"messages": [{"role": "user", "content": str(row[field])}]} for row in _rows(name, split, path, limit)]


# ---------------------------------------------------------------- prompt distillation (language classification)


def lines_as_prompts(path: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """One user prompt per non-empty line of a text file; default: the cookbook's example_data/multilingual.txt
    (from an installed tinker-cookbook)."""
    if path is None:
        try:
            from importlib.resources import files

            path = str(files("tinker_cookbook") / "example_data" / "multilingual.txt")
        except ModuleNotFoundError:
            raise UserError("cookbook_data.lines_as_prompts: give args.path, or pip install tinker-cookbook for its "
                            "example_data/multilingual.txt") from None
    p = _local(path)
    if not p.is_file():
        raise UserError(f"cookbook_data.lines_as_prompts: file not found: {path}")
    lines = [s.strip() for s in p.read_text(encoding="utf-8").splitlines() if s.strip()]
    return [{"messages": [{"role": "user", "content": s}]} for s in lines[:limit] if s]
