"""The recipe's data sources that read files or datasets: `jsonl`, `file`, `hf` (part of runner/recipe/schema.py,
which adds `python` and `run_output` and the DataSource union; kept here so the schema module stays small).

`format` and `fields` map a dataset's columns (runner/recipe/formats.py, docs/datasets.md); they are validated when the
recipe is decoded. Reading is runner/data/files.py.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from backends.backend_config import ConfigStruct

PosInt = Annotated[int, Meta(ge=1)]


class DataBase(ConfigStruct, tag_field="kind", tag=str.lower):  # pyright: ignore[reportGeneralTypeIssues]
    pass


class Mapped(DataBase):
    """Rows read from data: `format` maps a dataset's columns (messages, prompt_response, hh_rlhf, gsm8k, math:
    runner/recipe/formats.py, docs/datasets.md; "auto": rows as they are), `fields` names them (e.g. {prompt = "q"}),
    `max_rows` reads only the first rows. The subclasses declare these fields after their own required ones."""

    def __post_init__(self) -> None:
        from runner.recipe.formats import resolve_format  # pure: no I/O, no recipe types

        resolve_format(getattr(self, "format"), getattr(self, "fields"))  # noqa: B009


class Jsonl(Mapped):
    """A local JSONL file, one example per line; relative paths are relative to the working directory."""

    path: str
    format: str = "auto"
    fields: dict[str, str] = {}
    max_rows: PosInt | None = None


class File(Mapped):
    """A local data file by its suffix (.jsonl, .json array, .parquet, .arrow) or a `save_to_disk` folder (`split`
    picks from a DatasetDict). `streaming`: read one row group / batch at a time instead of whole."""

    path: str
    split: str = "train"
    streaming: bool = False
    format: str = "auto"
    fields: dict[str, str] = {}
    max_rows: PosInt | None = None


class HF(Mapped):
    """A Hugging Face dataset by hub name (needs the hub, or its offline cache) or a local dataset folder.
    `streaming`: iterate without downloading or loading the whole set."""

    name: str
    split: str = "train"
    subset: str | None = None
    streaming: bool = False
    format: str = "auto"
    fields: dict[str, str] = {}
    max_rows: PosInt | None = None
