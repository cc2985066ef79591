"""The recipe's cost tables: `price` (USD per million tokens, overriding the shipped table) and `budget` (where a
run stops). What they do: runner/engine/cost.py and docs/cost.md."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from backends.backend_config import ConfigStruct

NonNegFloat = Annotated[float, Meta(ge=0)]


class Price(ConfigStruct):  # pyright: ignore[reportGeneralTypeIssues] (see ConfigStruct)
    """USD per million tokens: prompt tokens prefilled (sampling prompts, forward-only passes, compute_logprobs),
    tokens sampled, and tokens in the datums sent to forward_backward."""

    prefill: NonNegFloat = 0.0
    sample: NonNegFloat = 0.0
    train: NonNegFloat = 0.0


class Budget(ConfigStruct):  # pyright: ignore[reportGeneralTypeIssues] (see ConfigStruct)
    """Stop the run once its totals reach either limit (checked before each step; see docs/cost.md)."""

    usd: Annotated[float, Meta(gt=0)] | None = None
    tokens: Annotated[int, Meta(ge=1)] | None = None

    def __post_init__(self) -> None:
        if self.usd is None and self.tokens is None:
            raise ValueError("budget needs usd = ... or tokens = ... (or both)")
