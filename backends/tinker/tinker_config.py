"""The Tinker backend's recipe table: `backend = {kind = "tinker", ...}`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from backends.backend_config import BackendConfig
from backends.tinker.options import TinkerOptions

if TYPE_CHECKING:
    from backends.base import Backend


class Tinker(BackendConfig, TinkerOptions):  # pyright: ignore[reportGeneralTypeIssues] - see ConfigStruct
    """The hosted Tinker service or any Tinker-compatible server (backends/tinker/backend.py). Its fields and their
    limits: options.py."""

    # Runs a sweep keeps in flight at once: the work is on the service, the client mostly waits.
    SWEEP_PARALLEL: ClassVar[int] = 8

    def make(self, model: str, tokenizer: str | None, storage_dir: Path, seed: int) -> Backend:
        # Checkpoints live on the service (tinker:// paths); storage_dir and seed are the local backend's.
        from backends.tinker.backend import TinkerBackend  # the SDK loads here, not when a recipe is validated

        return TinkerBackend(self, model, tokenizer)

    def cache_problem(self, model: str, tokenizer: str | None) -> str | None:
        from backends.hub import cache_miss  # the service runs the model; only its tokenizer is loaded here

        return cache_miss(tokenizer or model, "tokenizer")

    def sweep_parallel(self, cores: int, model: str | None = None) -> int:
        return self.SWEEP_PARALLEL
