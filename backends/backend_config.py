"""How a recipe names a backend: `backend = {kind = "local" | "tinker" | "python", ...}`.

Each backend declares its own msgspec variant next to its code, in a file named for its package:
backends/NAME/NAME_config.py (backends/local/local_config.py, backends/tinker/tinker_config.py), found by the finder
every extension kind shares (backends/configs.py `found`); the recipe schema (runner/recipe/schema.py) takes the union
of them, so a new backend is its package and that file, with no list to edit. A variant knows how to make its backend,
lazily, so that validating a recipe never imports torch or the tinker SDK (a NAME_config.py imports neither at module
level). A user's own backend comes from a recipe, `kind = "python"` (runner/recipe/python_backend.py).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from backends.configs import ConfigStruct, found

if TYPE_CHECKING:
    from backends.base import Backend


class BackendConfig(ConfigStruct, tag_field="kind", tag=str.lower):  # pyright: ignore[reportGeneralTypeIssues]
    def make(self, model: str, tokenizer: str | None, storage_dir: Path, seed: int) -> Backend:
        """The backend this table describes. `model` is the base model, `tokenizer` its override, `storage_dir`
        where a backend that stores checkpoints itself keeps them (the run dir's checkpoints/)."""
        raise NotImplementedError

    def describe(self, model: str) -> str | None:
        """One line saying where this backend will run `model` and why (the local backend: device and dtype,
        backends/local/device.py), printed by --dry-run and as a run's first line; None: nothing to say."""
        return None

    def billed(self) -> bool:
        """Whether a service bills the tokens a run sends this backend: True, its price comes from the tables
        (runner/engine/cost.py `price_of`); False (the local backend: this machine), it costs 0 unless the recipe's
        own `price` or `price_file` names one."""
        return True

    def cache_problem(self, model: str, tokenizer: str | None) -> str | None:
        """For `runner check`: the line a run would stop with because a hub id it loads is not in the Hugging Face
        cache and downloads are off (backends/hub.py cache_miss); None: nothing to say. Default: loads nothing."""
        return None

    def sweep_parallel(self, cores: int, model: str | None = None) -> int:
        """How many runs of `model` on this backend a sweep starts at once on a machine with `cores` usable cores
        (runner/tools/sweep.py takes the smallest answer among its points). Default: one per core."""
        return max(1, cores)


# The backend of a recipe that names none (runner/recipe/schema.py `Recipe.backend`).
DEFAULT_KIND = "local"


@cache
def builtin_configs() -> tuple[type[BackendConfig], ...]:
    """Every built-in backend's variant: the BackendConfig subclasses of each backends/NAME/NAME_config.py, in package
    name order (local, then tinker: the order the schema's union and its messages list them in)."""
    return found(BackendConfig, __package__ or "backends")


def default_backend() -> BackendConfig:
    """The backend of a recipe that names none: the built-in variant tagged DEFAULT_KIND, with its defaults (found,
    so the schema names no particular backend)."""
    for config in builtin_configs():
        if config.__struct_config__.tag == DEFAULT_KIND:
            return config()
    raise LookupError(f"no built-in backend is tagged {DEFAULT_KIND!r}: {[c.__name__ for c in builtin_configs()]}")
