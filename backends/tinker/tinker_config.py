"""The Tinker backend's recipe table: `backend = {kind = "tinker", ...}`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, ClassVar

from msgspec import Meta

from backends.backend_config import BackendConfig

if TYPE_CHECKING:
    from backends.base import Backend


class Tinker(BackendConfig):
    """The hosted Tinker service or any Tinker-compatible server (backends/tinker/backend.py)."""

    # None: $TINKER_BASE_URL, else the SDK's default (hosted service). The API key comes from
    # $TINKER_API_KEY only and is never written anywhere.
    base_url: str | None = None
    # Lifetime of periodic checkpoints on the service (its limits: 1 hour to 10 years); the final
    # checkpoint never expires. Not optional: TOML has no null, so `show` could not write None back.
    ttl_seconds: Annotated[int, Meta(ge=3600, le=10 * 365 * 24 * 3600)] = 7 * 24 * 3600

    # A service never reached fails the run after this long, with one line (the SDK alone retries for ~6 min).
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    # Once connected: while calls wait and the service has not answered a ping for this long, the run stops
    # with one line (the SDK alone retries each request for ~5 min, one after another).
    lost_after_s: Annotated[float, Meta(gt=0)] = 60.0

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
