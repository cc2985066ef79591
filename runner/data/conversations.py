"""Conversations: a recipe's data source -> validated chats, each with where it came from.

Rows are read by runner/data/files.py (jsonl, json, parquet, arrow, save_to_disk folders, hub datasets, `pkg.mod:fn`,
another run's output; each row keeps a location such as "data.jsonl:17" so a bad row is a one-line UserError that says
where to look). A source with a `format` (runner/recipe/formats.py: messages, prompt_response, hh_rlhf, gsm8k, math) has
its columns mapped to {"messages": [...]} first; without one a row must already be {"messages": [...]}.

Every message is {"role", "content"} with a role in ROLES: an unknown role (a typo such as "asistant", or "human"/"gpt"
from ShareGPT-style data) is an error naming file:line and the allowed roles, never trained on silently.

Local JSONL is read line by line with `json` rather than through `datasets`: it gives exact line numbers, and Arrow's
schema unification would add `None` keys to every message (e.g. a "name" that one row has), which chat templates then
render; columnar files do add them, and they are dropped here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from backends.errors import UserError
from runner.data.files import MAPPED, describe, iter_rows, load_rows, read_jsonl
from runner.recipe.common import DataSource, Json
from runner.recipe.formats import AUTO, FormatError, map_row, resolve_format

if TYPE_CHECKING:
    from runner.renderers.base import Renderer

__all__ = ["ROLES", "Conversation", "Message", "conversation", "describe", "load_conversations", "load_rows",
           "mapped_rows", "messages_of", "read_jsonl"]

Message = dict[str, str]
Conversation = list[Message]
# The roles a message may have (the cookbook's renderers: system, user, assistant, tool).
ROLES = ("system", "user", "assistant", "tool")


def mapped_rows(source: DataSource, shape: str) -> tuple[list[object], list[str], int]:
    """(rows as the canonical `shape`, their locations, rows the format drops): the source's rows through its format
    (runner/recipe/formats.py); rows as they are for "auto"."""
    name = resolve_format(source.format, source.fields) if isinstance(source, MAPPED) else AUTO
    if name == AUTO:
        rows, where = load_rows(source)
        return rows, where, 0
    fields = source.fields if isinstance(source, MAPPED) else {}
    rows, where, dropped = [], [], 0
    for row, w in iter_rows(source):
        try:
            mapped = map_row(row, name, fields, shape)
        except FormatError as e:
            raise UserError(f"{w}: {e}") from None
        if mapped is None:
            dropped += 1
            continue
        rows.append(mapped)
        where.append(w)
    if dropped:
        rows_text = "1 row" if dropped == 1 else f"{dropped} rows"
        print(f"note: {describe(source)}: {rows_text} dropped as the cookbook drops them (format {name!r}: "
              "no final answer, or transcripts that differ in more than the last turn)", file=sys.stderr)
    return rows, where, dropped


def load_conversations(source: DataSource) -> tuple[list[Conversation], list[str]]:
    rows, where, _ = mapped_rows(source, "conversation")
    if not rows:
        raise UserError(f"data source {describe(source)} has no rows")
    return [conversation(row, w) for row, w in zip(rows, where, strict=True)], where


def prompt_rows(sources: list[DataSource], renderer: Renderer, n: int) -> Iterator[Json]:
    """`runner render` of prompts (generate, distill): the first `n` generation prompts, nothing trained."""
    shown = 0
    for source in sources:
        convs, where = load_conversations(source)
        for conv, w in zip(convs, where, strict=True):
            if shown >= n:
                return
            tokens = renderer.build_generation_prompt(conv)
            yield {"where": w, "tokens": tokens, "weights": [0.0] * len(tokens)}
            shown += 1


def conversation(row: object, where: str) -> Conversation:
    """A row's messages, checked: {"messages": [{"role": str, "content": str}, ...]} with at least one
    message. Keys that are None (Arrow fills them in) are dropped; other extra keys are kept for the
    chat template (e.g. "name")."""
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object with a \"messages\" list")
    if "messages" not in row:
        have = ", ".join(map(repr, row)) or "none"
        raise UserError(f"{where}: expected an object with a \"messages\" list (the row's columns: {have}); a "
                        "source's `format` maps other columns (docs/datasets.md)")
    return messages_of(row["messages"], where, "messages")


def messages_of(messages: object, where: str, key: str) -> Conversation:
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
        if m["role"] not in ROLES:
            raise UserError(f"{where}: {key}[{j}].role {m['role']!r} is not a role; expected one of: "
                            f"{', '.join(ROLES)}")
        out.append(m)
    return out
