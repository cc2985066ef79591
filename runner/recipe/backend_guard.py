"""A user's backend (`kind = "python"`, runner/recipe/python_backend.py) held to the protocol at every call.

The loop trusts what a backend returns (backends/base.py): a Future of a client, outputs of our types with one
logprob per token, metrics that are numbers. A user's backend that breaks that (a method returning None instead of
a Future, `"big"` as a metric, fewer logprobs than tokens, a future that raises KeyboardInterrupt) used to surface
as a traceback from deep in the loop, or as the user's own Ctrl-C (exit 130). Here each call and each result is
checked, and a violation is one line naming the target, the call and what it returned (a UserError: exit 2).

An exception the backend's own code raises is one line too; its BackendErrors and UserErrors pass through as they
are (the loop knows them). A KeyboardInterrupt is the backend's while the loop's Ctrl-C handler is installed (a
real Ctrl-C then raises nothing, runner/engine/loop.py StopFlag) or when it comes out of a finished future; else it
is the user's and passes through.
"""

from __future__ import annotations

import numbers
import signal
import threading
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar, cast

import numpy as np

from backends.base import Backend, BackendError, CustomLossFn, Future, SamplingClient, TrainingClient
from backends.errors import UserError, one_line
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
PROTOCOL = "backends/base.py"


def _what(value: object) -> str:
    """How a returned value is named in a message: its type, and the value itself when short."""
    if value is None:
        return "None"
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else type(value).__name__


def _ctrl_c_possible() -> bool:
    """Whether a KeyboardInterrupt here may be the user's Ctrl-C (Python's own SIGINT handler, main thread)."""
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)  # fmt: skip


class _Guard:
    def __init__(self, where: str):
        self.where = where

    def fail(self, call: str, what: str) -> NoReturn:
        raise UserError(f"{self.where}: {call} {what}")

    def raised(self, call: str, e: BaseException) -> NoReturn:
        if isinstance(e, KeyboardInterrupt):
            self.fail(call, "raised KeyboardInterrupt (the backend's own, not a Ctrl-C)")
        self.fail(call, f"raised {one_line(e)}")

    def call(self, call: str, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        try:
            return fn(*args, **kwargs)
        except (UserError, BackendError):
            raise
        except KeyboardInterrupt as e:
            if _ctrl_c_possible():
                raise
            self.raised(call, e)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - user code: one line naming it, not a traceback
            self.raised(call, e)

    def future(self, call: str, value: object, check: Callable[[object], T]) -> Future[T]:
        if not isinstance(value, Future):
            self.fail(call, f"returned {_what(value)}, not a backends.base.Future ({PROTOCOL})")
        return _CheckedFuture(value, self, call, check)

    def numbers(self, call: str, metrics: object) -> None:
        if not isinstance(metrics, dict):
            self.fail(call, f"returned metrics {_what(metrics)}, not a dict of numbers ({PROTOCOL})")
        for k, v in metrics.items():
            if not isinstance(k, str) or not isinstance(v, numbers.Real):
                self.fail(call, f"returned the metric {k!r} = {_what(v)}, not a number ({PROTOCOL})")


class _CheckedFuture(Future[T]):
    """The backend's future, its result checked; an exception out of it is the backend's (one line)."""

    def __init__(self, outer: Future[object], guard: _Guard, call: str, check: Callable[[object], T]):
        super().__init__(outer.future(), lambda raw: check(outer._finish(raw)))  # pyright: ignore[reportPrivateUsage]
        self._guard, self._call = guard, call

    def _reraise(self, e: BaseException) -> NoReturn:
        inner = self.future()
        ours = inner.done() and not inner.cancelled() and inner.exception() is e
        if ours and not isinstance(e, (UserError, BackendError)):
            self._guard.raised(self._call, e)
        raise e

    def result(self, timeout: float | None = None) -> T:
        try:
            return super().result(timeout)
        except BaseException as e:  # noqa: BLE001 - sorted in _reraise: only the future's own are reworded
            self._reraise(e)

    async def result_async(self) -> T:
        try:
            return await super().result_async()
        except BaseException as e:  # noqa: BLE001
            self._reraise(e)


class CheckedBackend:
    """`inner` (the target's Backend) behind the checks of this module; other attributes are the inner's."""

    def __init__(self, inner: Backend, where: str):
        self._inner = inner
        self._g = _Guard(where)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_tokenizer(self) -> Tokenizer:
        tok: object = self._g.call("get_tokenizer()", self._inner.get_tokenizer)
        if tok is None or not callable(getattr(tok, "encode", None)):
            self._g.fail("get_tokenizer()", f"returned {_what(tok)}, not a tokenizer ({PROTOCOL})")
        return cast(Tokenizer, tok)  # checked: it encodes

    def _training(self, call: str, fut: object) -> Future[TrainingClient]:
        def check(client: object) -> TrainingClient:
            if isinstance(client, type) or not isinstance(client, TrainingClient):
                self._g.fail(call, f"gave {_what(client)}, not a TrainingClient ({PROTOCOL})")
            return CheckedTrainingClient(client, self._g)

        return self._g.future(call, fut, check)

    def create_training_client(self, spec: LoraSpec) -> Future[TrainingClient]:
        call = "create_training_client()"
        return self._training(call, self._g.call(call, self._inner.create_training_client, spec))

    def create_training_client_from_state(self, path: str, spec: LoraSpec,
                                          with_optimizer: bool = True) -> Future[TrainingClient]:  # fmt: skip
        call = "create_training_client_from_state()"
        fut = self._g.call(call, self._inner.create_training_client_from_state, path, spec, with_optimizer)
        return self._training(call, fut)

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> Future[SamplingClient]:  # fmt: skip
        call = "create_sampling_client()"
        fut = self._g.call(call, self._inner.create_sampling_client, model_path, base_model)
        return self._g.future(call, fut, lambda c: sampling(c, self._g, call))

    def checkpoint_ttl_seconds(self) -> int | None:
        ttl = self._g.call("checkpoint_ttl_seconds()", self._inner.checkpoint_ttl_seconds)
        if ttl is not None and (not isinstance(ttl, numbers.Integral) or isinstance(ttl, bool)):
            self._g.fail("checkpoint_ttl_seconds()", f"returned {_what(ttl)}, not an int or None ({PROTOCOL})")
        return ttl

    def close(self, status: str = "success") -> None:
        self._g.call("close()", self._inner.close, status)


def sampling(client: object, g: _Guard, call: str) -> SamplingClient:
    if isinstance(client, type) or not isinstance(client, SamplingClient):
        g.fail(call, f"gave {_what(client)}, not a SamplingClient ({PROTOCOL})")
    return CheckedSamplingClient(client, g)


class CheckedTrainingClient:
    def __init__(self, inner: TrainingClient, g: _Guard):
        self._inner, self._g = inner, g

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _outputs(self, call: str, data: list[Datum]) -> Callable[[object], ForwardBackwardOutput]:
        def check(out: object) -> ForwardBackwardOutput:
            lps, metrics = getattr(out, "logprobs", None), getattr(out, "metrics", None)
            if not isinstance(lps, list):
                self._g.fail(call, f"gave {_what(out)}, not a ForwardBackwardOutput with a list of logprobs "
                                   f"({PROTOCOL})")  # fmt: skip
            if len(lps) != len(data):
                self._g.fail(call, f"gave logprobs for {len(lps)} datums of {len(data)} ({PROTOCOL})")
            for i, (lp, d) in enumerate(zip(lps, data, strict=True)):
                shape = np.shape(lp)
                if shape != d.target_tokens.shape:
                    self._g.fail(call, f"gave logprobs of shape {shape} for datum {i}, whose target_tokens are "
                                       f"{d.target_tokens.shape} ({PROTOCOL})")  # fmt: skip
            self._g.numbers(call, metrics)
            return cast(ForwardBackwardOutput, out)  # checked: logprobs per datum, numeric metrics

        return check

    def forward(self, data: list[Datum], loss_fn: LossFn,
                loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:  # fmt: skip
        fut = self._g.call("forward()", self._inner.forward, data, loss_fn, loss_config)
        return self._g.future("forward()", fut, self._outputs("forward()", data))

    def forward_backward(self, data: list[Datum], loss_fn: LossFn,
                         loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:  # fmt: skip
        fut = self._g.call("forward_backward()", self._inner.forward_backward, data, loss_fn, loss_config)
        return self._g.future("forward_backward()", fut, self._outputs("forward_backward()", data))

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        call = "forward_backward_custom()"
        fut = self._g.call(call, self._inner.forward_backward_custom, data, loss_fn)
        return self._g.future(call, fut, self._outputs(call, data))

    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]:
        def check(out: object) -> OptimStepOutput:
            self._g.numbers("optim_step()", getattr(out, "metrics", out))
            return cast(OptimStepOutput, out)  # checked: numeric metrics

        return self._g.future("optim_step()", self._g.call("optim_step()", self._inner.optim_step, params), check)

    def _path(self, call: str, fut: object) -> Future[str]:
        def check(path: object) -> str:
            if not isinstance(path, str) or not path:
                self._g.fail(call, f"gave {_what(path)}, not a path string ({PROTOCOL})")
            return path

        return self._g.future(call, fut, check)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return self._path("save_state()", self._g.call("save_state()", self._inner.save_state, name, ttl_seconds))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        call = "save_weights_for_sampler()"
        return self._path(call, self._g.call(call, self._inner.save_weights_for_sampler, name, ttl_seconds))

    def save_weights_and_get_sampling_client(self) -> Future[SamplingClient]:
        call = "save_weights_and_get_sampling_client()"
        fut = self._g.call(call, self._inner.save_weights_and_get_sampling_client)
        return self._g.future(call, fut, lambda c: sampling(c, self._g, call))


class CheckedSamplingClient:
    def __init__(self, inner: SamplingClient, g: _Guard):
        self._inner, self._g = inner, g

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        call = "sample()"

        def check(out: object) -> SampleOutput:
            seqs = getattr(out, "sequences", None)
            if not isinstance(seqs, list):
                self._g.fail(call, f"gave {_what(out)}, not a SampleOutput ({PROTOCOL})")
            if len(seqs) != num_samples:
                self._g.fail(call, f"gave {len(seqs)} sequences for num_samples = {num_samples} ({PROTOCOL})")
            for s in seqs:
                tokens, lps = getattr(s, "tokens", None), getattr(s, "logprobs", None)
                if not isinstance(tokens, list) or not all(isinstance(t, numbers.Integral) for t in tokens):
                    self._g.fail(call, f"gave tokens {_what(tokens)}, not a list of ints ({PROTOCOL})")
                if not isinstance(lps, list) or len(lps) != len(tokens):
                    n = len(lps) if isinstance(lps, list) else _what(lps)
                    self._g.fail(call, f"gave {n} logprobs for {len(tokens)} tokens (one per token: {PROTOCOL})")
                if not all(isinstance(x, numbers.Real) for x in lps):
                    self._g.fail(call, f"gave a logprob that is not a number ({PROTOCOL})")
                if getattr(s, "stop_reason", None) not in ("stop", "length"):
                    self._g.fail(call, f"gave stop_reason {_what(getattr(s, 'stop_reason', None))}, not 'stop' or "
                                       f"'length' ({PROTOCOL})")  # fmt: skip
            return cast(SampleOutput, out)  # checked: every sequence's tokens, logprobs and stop reason

        return self._g.future(call, self._g.call(call, self._inner.sample, prompt, num_samples, params), check)

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        call = "compute_logprobs()"

        def check(out: object) -> list[float | None]:
            if not isinstance(out, list) or len(out) != len(tokens):
                n = f"{len(out)} logprobs" if isinstance(out, list) else _what(out)
                self._g.fail(call, f"gave {n} for {len(tokens)} tokens (one per token, None first: {PROTOCOL})")
            if not all(x is None or isinstance(x, numbers.Real) for x in out):
                self._g.fail(call, f"gave a logprob that is neither a number nor None ({PROTOCOL})")
            return out

        return self._g.future(call, self._g.call(call, self._inner.compute_logprobs, tokens), check)
