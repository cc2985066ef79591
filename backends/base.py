"""The backend protocol: Tinker's primitives, with our own types (backends/types.py) on the wire.

A `Backend` is the service client; it makes `TrainingClient`s and `SamplingClient`s. Every client
method returns a `Future` at once. Guarantees every backend keeps (the loop relies on them):
- calls on one training client execute strictly in submission order (one FIFO: forward,
  forward_backward, optim_step, save/load all share it);
- optim_step applies the summed gradients of every forward_backward submitted before it, then
  zeroes them; forward accumulates nothing;
- a sampling client keeps the weights it was made with, whatever the training client does later.

The interface is not a vehicle for code reuse: the local and Tinker backends share only `Future`, and the Tinker
backend and the test doubles (backends/fake.py, runner/engine/probe.py) a registered loss's torch function (`loss_of`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Generator, Mapping
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from backends import losses
from backends.tokenizer import Tokenizer
from backends.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraSpec,
    LossFn,
    OptimStepOutput,
    SampleOutput,
    SamplingParams,
)

T = TypeVar("T")
U = TypeVar("U")
# Covariant: a Future[TinkerTrainingClient] is a Future[TrainingClient] (a future is only read).
T_co = TypeVar("T_co", covariant=True)

# A custom loss: (data, per-datum target logprobs as torch tensors requiring grad) -> (scalar loss, metrics).
# losses.Tensor is torch.Tensor, named without importing torch (`runner check` / `runner list` must not load it).
CustomLossFn = Callable[[list[Datum], list[losses.Tensor]], tuple[losses.Tensor, dict[str, float]]]


def loss_of(loss_fn: LossFn, config: Mapping[str, float] | None) -> Callable[[Datum, losses.Tensor], losses.Tensor]:
    """The registered loss `loss_fn` under `config` as one datum's summed loss, given the datum and its target logprobs
    `lp` (a torch tensor; the datum's loss inputs become tensors of its dtype, on its device). An unknown loss or a bad
    config: a BackendError (user_error) now; a datum without an input the loss reads: ValueError when it is called."""
    try:
        spec = losses.get(loss_fn)
        cfg = spec.resolve(config)
    except ValueError as exc:
        raise BackendError(str(exc), user_error=True) from None

    def loss(datum: Datum, lp: losses.Tensor) -> losses.Tensor:
        spec.check_datum(datum)
        return spec.masked_sum(lp, losses.LossInputs.of(datum, lp.new_tensor), cfg)

    return loss


class BackendError(RuntimeError):
    """A request the backend gave up on. `request` names the call (e.g. 'forward_backward #12'); the message
    always starts with it, so callers print str(error) as is. `state_lost`: the service no longer holds the
    training client's state (a restarted `runner serve`); the run carries on from its last checkpoint
    (runner/engine/loop.py)."""

    def __init__(self, message: str, request: str = "", user_error: bool = False, state_lost: bool = False):
        if request and not message.startswith(request):
            message = f"{request}: {message}"
        super().__init__(message)
        self.request = request
        self.user_error = user_error
        self.state_lost = state_lost

    @property
    def detail(self) -> str:
        """The message without its leading "request: " (a server's reply is already about that request)."""
        msg = str(self)
        return msg[len(self.request) + 2:] if self.request and msg.startswith(self.request + ": ") else msg


class Future(Generic[T_co]):
    """An awaitable handle on a result, shaped like Tinker's APIFuture.

    `await fut` and `fut.result(timeout)` never cancel the underlying request: a timeout only stops
    waiting (cancelling a Tinker training request would leave a hole in its sequence ids).
    """

    def __init__(self, inner: concurrent.futures.Future[Any], convert: Callable[[Any], T_co] | None = None):
        self._inner = inner
        self._convert = convert

    @staticmethod
    def completed(value: T) -> Future[T]:
        f: concurrent.futures.Future[T] = concurrent.futures.Future()
        f.set_result(value)
        return Future(f)

    def _finish(self, raw: Any) -> T_co:
        return self._convert(raw) if self._convert is not None else raw

    def result(self, timeout: float | None = None) -> T_co:
        return self._finish(self._inner.result(timeout))

    async def result_async(self) -> T_co:
        raw = await asyncio.shield(asyncio.wrap_future(self._inner))
        return self._finish(raw)

    def __await__(self) -> Generator[object, None, T_co]:
        return self.result_async().__await__()

    def done(self) -> bool:
        return self._inner.done()

    def future(self) -> concurrent.futures.Future[Any]:
        return self._inner

    def map(self, fn: Callable[[T_co], U]) -> Future[U]:
        return Future(self._inner, lambda raw: fn(self._finish(raw)))


@runtime_checkable
class SamplingClient(Protocol):
    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        """num_samples sequences continuing `prompt`."""
        ...

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        """logprob of each token given the ones before it; position 0 is None."""
        ...


@runtime_checkable
class TrainingClient(Protocol):
    def forward(
        self, data: list[Datum], loss_fn: LossFn, loss_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]: ...

    def forward_backward(
        self, data: list[Datum], loss_fn: LossFn, loss_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]: ...

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        """Gradient of loss_fn(data, logprobs) w.r.t. the weights; metrics: the user's, plus `loss:sum`
        (the custom loss value) and `surrogate_loss:sum` (as Tinker's two-pass implementation reports)."""
        ...

    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]: ...

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        """Weights and optimizer state; returns a path that Backend.create_training_client_from_state takes."""
        ...

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        """Weights only; returns a path that Backend.create_sampling_client takes."""
        ...

    def save_weights_and_get_sampling_client(self) -> Future[SamplingClient]:
        """A sampling client over the weights as of this point in the FIFO (ephemeral)."""
        ...


@runtime_checkable
class Backend(Protocol):
    """The service: makes clients, owns the tokenizer, and is closed at the end of a run."""

    def get_tokenizer(self) -> Tokenizer:
        """A transformers tokenizer for the base model (with a chat template)."""
        ...

    def create_training_client(self, spec: LoraSpec) -> Future[TrainingClient]: ...

    def create_training_client_from_state(
        self, path: str, spec: LoraSpec, with_optimizer: bool = True
    ) -> Future[TrainingClient]:
        """Weights (and, with_optimizer, Adam state and step count) from a save_state path."""
        ...

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> Future[SamplingClient]:
        """From a save_weights_for_sampler path, or the base model (e.g. a KL / DPO reference)."""
        ...

    def checkpoint_ttl_seconds(self) -> int | None:
        """How long periodic checkpoints should live (Tinker's ttl_seconds); None: as long as the backend keeps
        files. The final checkpoint is always saved without a ttl."""
        ...

    def close(self, status: str = "success") -> None: ...
