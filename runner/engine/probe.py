"""The dry run's stand-in backend (runner/engine/estimate.py): the whole backend protocol, answered at once, to count
the tokens an algorithm submits without training anything.

Every reply of its sampler is max_tokens of one ordinary token, cut at the length limit (the longest a sampler
returns), so the counts are upper bounds on sampling and on what is trained on the replies. Its "model" is uniform:
every target token's logprob is -log(vocab), whatever the weights; forward and forward_backward compute the
registry's loss on those logprobs (backends/losses, so a loss the backend would refuse fails here too), a custom loss
runs on them with autograd (its metrics and `loss:sum` come back as a backend's), and optim_step changes nothing.
No test double is involved: a probe only has to be shaped like a backend, and its answers never change what an
algorithm submits (the replies are fixed, so the prompts, datums and references that follow from them are too).
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from backends.base import CustomLossFn, Future, loss_of
from backends.tokenizer import Tokenizer
from backends.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraSpec,
    LossFn,
    OptimStepOutput,
    SampledSequence,
    SampleOutput,
    SamplingParams,
)

T = TypeVar("T")


def _now(fn: Callable[[], T]) -> Future[T]:
    """fn's result as a finished Future; an exception it raises is the Future's (raised when it is awaited, as a
    backend's worker would)."""
    f: concurrent.futures.Future[T] = concurrent.futures.Future()
    try:
        f.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the call, as any backend does
        f.set_exception(exc)
    return Future(f)


class ProbeSampler:
    """Every reply is max_tokens of one ordinary token, cut at the length limit: the longest a sampler returns."""

    def __init__(self, token: int):
        self.token = token

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        n = params.max_tokens
        seqs = [SampledSequence(tokens=[self.token] * n, logprobs=[0.0] * n, stop_reason="length")
                for _ in range(num_samples)]
        return Future.completed(SampleOutput(sequences=seqs))

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        return Future.completed([None] + [0.0] * (len(tokens) - 1))


class ProbeTraining:
    """A training client whose model is uniform over `vocab` tokens and never changes."""

    def __init__(self, sampler: ProbeSampler, vocab: int):
        self.sampler = sampler
        self.logprob = -math.log(max(1, vocab))

    def _logprobs(self, d: Datum) -> np.ndarray:
        return np.full(np.shape(d.target_tokens), self.logprob, dtype=np.float32)

    def _loss(self, data: list[Datum], loss_fn: LossFn, config: dict[str, float]) -> ForwardBackwardOutput:
        import torch

        loss_of_datum = loss_of(loss_fn, config)
        lps, total = [], 0.0
        for d in data:
            lp = self._logprobs(d)
            total += float(loss_of_datum(d, torch.as_tensor(lp, dtype=torch.float64)))
            lps.append(lp)
        return ForwardBackwardOutput(logprobs=lps, metrics={"loss:sum": total})

    def forward(self, data: list[Datum], loss_fn: LossFn,
                loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        return _now(lambda: self._loss(data, loss_fn, loss_config or {}))

    def forward_backward(self, data: list[Datum], loss_fn: LossFn,
                         loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        return _now(lambda: self._loss(data, loss_fn, loss_config or {}))

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        def run() -> ForwardBackwardOutput:
            import torch

            lps = [torch.tensor(self._logprobs(d), dtype=torch.float64, requires_grad=True) for d in data]
            loss, metrics = loss_fn(data, lps)
            loss.backward()
            grads = [lp.grad.numpy() if lp.grad is not None else np.zeros(lp.shape) for lp in lps]
            surrogate = sum(float((g * lp.detach().numpy()).sum()) for g, lp in zip(grads, lps, strict=True))
            return ForwardBackwardOutput(logprobs=[lp.detach().numpy().astype(np.float32) for lp in lps],
                                         metrics={**metrics, "loss:sum": float(loss.detach().sum()),
                                                  "surrogate_loss:sum": surrogate})

        return _now(run)

    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]:
        return Future.completed(OptimStepOutput(metrics={"grad_norm:mean": 0.0}))

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return Future.completed(f"probe://weights/{name}")

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return Future.completed(f"probe://sampler_weights/{name}")

    def save_weights_and_get_sampling_client(self) -> Future[ProbeSampler]:
        return Future.completed(self.sampler)


class ProbeBackend:
    """The service: every training client is a ProbeTraining, every sampling client the one ProbeSampler."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        ids = tokenizer.encode("a", add_special_tokens=False) or [0]
        self.sampler = ProbeSampler(int(ids[0]))
        self.vocab = len(tokenizer)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def create_training_client(self, spec: LoraSpec) -> Future[ProbeTraining]:
        return Future.completed(ProbeTraining(self.sampler, self.vocab))

    def create_training_client_from_state(self, path: str, spec: LoraSpec,
                                          with_optimizer: bool = True) -> Future[ProbeTraining]:
        return self.create_training_client(spec)

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> Future[ProbeSampler]:
        return Future.completed(self.sampler)

    def checkpoint_ttl_seconds(self) -> int | None:
        return None

    def close(self, status: str = "success") -> None:
        pass
