"""The nouns that cross the backend line.

Everything the loop hands to a backend, and everything a backend hands back, is one of these.
No `tinker.*` or `torch.*` type appears here: the Tinker adapter converts at its own boundary,
and the local backend converts to tensors inside its worker.

Alignment follows Tinker: position i of `model_input` predicts `target_tokens[i]`, i.e. for a
full sequence `seq`, `model_input = seq[:-1]` and `target_tokens = seq[1:]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from backends import losses

# A registered loss's name (backends/losses.py: Tinker's built-ins and any registered since). The inputs each
# reads are its LossSpec's; `mask` is ours: Tinker has no mask input, so the Tinker adapter folds it into
# weights/advantages.
LossFn = str
LOSS_FNS: Sequence[str] = losses.LOSS_NAMES  # follows later registrations
StopReason = Literal["stop", "length"]
# A JSON object as json.loads (or a TOML table as tomllib) gives it: a chat message, a .jsonl row, a request body, a
# table whose keys are open. The one spelling of `dict[str, Any]` for such data, for backends/ and runner/ alike.
Json = dict[str, Any]


@dataclass(frozen=True)
class Datum:
    """One training sequence.

    target_tokens: int64, shape (N,) or (N, K) for top-K / soft-target cross entropy.
    weights: float32, same shape as target_tokens (cross_entropy).
    logprobs: float32 (N,), the sampler's logprobs of the targets (ratio losses).
    advantages: float32 (N,) (ratio losses).
    mask: float32 (N,), 1 on action tokens; the local backend multiplies every per-token loss by it.
    """

    model_input: list[int]
    target_tokens: np.ndarray
    weights: np.ndarray | None = None
    logprobs: np.ndarray | None = None
    advantages: np.ndarray | None = None
    mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.model_input)
        if n == 0:
            raise ValueError("Datum.model_input is empty")
        tt = np.asarray(self.target_tokens, dtype=np.int64)
        object.__setattr__(self, "target_tokens", tt)
        if tt.ndim not in (1, 2) or tt.shape[0] != n:
            raise ValueError(f"target_tokens shape {tt.shape} does not match model_input length {n}")
        for name in ("weights", "logprobs", "advantages", "mask"):
            v = getattr(self, name)
            if v is None:
                continue
            arr = np.asarray(v, dtype=np.float32)
            object.__setattr__(self, name, arr)
            want = tt.shape if name == "weights" else (n,)
            if arr.shape != want:
                raise ValueError(f"{name} shape {arr.shape} != expected {want}")
            # A NaN or infinite weight, advantage or logprob makes the loss and every gradient NaN: one step
            # would leave the adapter NaN for good (an optim_step applies it), so such a datum is refused.
            finite = np.isfinite(arr)
            if not finite.all():
                at = int(np.flatnonzero(~finite.reshape(-1))[0])
                raise ValueError(f"{name} holds {arr.reshape(-1)[at]} at position {at}: loss inputs must be finite")

    @property
    def length(self) -> int:
        return len(self.model_input)

    @property
    def full_sequence(self) -> list[int]:
        """model_input plus the last target token (the sequence the datum was cut from; 1-D targets)."""
        last = self.target_tokens[-1]
        return [*self.model_input, int(last if self.target_tokens.ndim == 1 else last[0])]

    def check_for(self, loss_fn: LossFn) -> None:
        """Raise ValueError if `loss_fn` is not registered or this datum lacks an input it needs."""
        losses.get(loss_fn).check_datum(self)


@dataclass(frozen=True)
class ForwardBackwardOutput:
    """Per-datum target logprobs (before any update, shaped like target_tokens) and
    metrics keyed `name:reduction`, at least `loss:sum`."""

    logprobs: list[np.ndarray]
    metrics: dict[str, float]


@dataclass(frozen=True)
class OptimStepOutput:
    """Metrics keyed `name:reduction`, e.g. `grad_norm:mean` (pre-clip global norm) when the backend knows it."""

    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AdamParams:
    """Tinker's AdamW parameters and defaults. grad_clip_norm 0 = no clipping; decoupled weight decay."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


# Floors every sampler here applies alike (the local one, the fake; docs/local-backend.md): a temperature below
# TEMPERATURE_FLOOR samples greedily (as 0 does), a top_p below TOP_P_FLOOR keeps only the most likely token (as
# top_k = 1 does). Below them logits / T overflows and top_p · mass rounds to 0, and no token could be drawn.
TEMPERATURE_FLOOR = 1e-5
TOP_P_FLOOR = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """stop=None stops on EOS only; stop=[] never stops before max_tokens; strings or token ids otherwise.
    top_k=-1 means no limit. A seed makes a sample reproducible. temperature < TEMPERATURE_FLOOR is greedy;
    top_p < TOP_P_FLOOR keeps only the most likely token."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] | list[int] | None = None
    seed: int | None = None


@dataclass(frozen=True)
class SampledSequence:
    """tokens include the stop string / stop token that ended the sample (as Tinker);
    logprobs are per sampled token at the sampling temperature."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass(frozen=True)
class SampleOutput:
    sequences: list[SampledSequence]


@dataclass(frozen=True)
class LoraSpec:
    """What `create_training_client` trains. rank 0 = full fine-tune (local backend only)."""

    base_model: str
    rank: int = 32
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
