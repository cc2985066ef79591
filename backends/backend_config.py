"""How a recipe names a backend: `backend = {kind = "local" | "tinker", ...}`.

Each backend declares its own msgspec variant next to its code (backends/local/local_config.py,
backends/tinker/tinker_config.py); the recipe schema (runner/recipe/schema.py) takes their union. A variant knows how to
make its backend, lazily, so that validating a recipe never imports torch or the tinker SDK.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from backends.base import Backend


class ConfigStruct(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A recipe table: unknown keys are errors, values immutable, fields by name.

    Subclasses inherit frozen=True (msgspec). pyright reports "a non-frozen class cannot inherit from a
    frozen class" for each of them: its dataclass_transform model does not inherit the option."""


class BackendConfig(ConfigStruct, tag_field="kind", tag=str.lower):  # pyright: ignore[reportGeneralTypeIssues]
    def make(self, model: str, tokenizer: str | None, storage_dir: Path, seed: int) -> Backend:
        """The backend this table describes. `model` is the base model, `tokenizer` its override, `storage_dir`
        where a backend that stores checkpoints itself keeps them (the run dir's checkpoints/)."""
        raise NotImplementedError

    def describe(self, model: str) -> str | None:
        """One line saying where this backend will run `model` and why (the local backend: device and dtype,
        backends/local/device.py), printed by --dry-run and as a run's first line; None: nothing to say."""
        return None

    def sweep_parallel(self, cores: int, model: str | None = None) -> int:
        """How many runs of `model` on this backend a sweep starts at once on a machine with `cores` usable cores
        (runner/tools/sweep.py takes the smallest answer among its points). Default: one per core."""
        return max(1, cores)
