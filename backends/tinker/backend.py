"""The hosted Tinker service (or any Tinker-compatible server) behind our backend protocol.

A thin adapter over the `tinker` SDK (0.38): our backends/types.py values are converted to `tinker.*`
values here and nowhere else, and every SDK future comes back as a backends.base.Future whose result
is already one of our types. Things the SDK does that shape this file:
- Plain SDK methods return at once with an APIFuture; ordering (seq ids) is reserved on the calling
  thread, so calling them in loop order is all the pipelining needs.
- We never put a timeout on a training future: a cancelled one leaves a hole in the model's seq ids
  and stalls every later request (docs/tinker-backend.md). Our Future's timeouts only stop waiting.
- The SDK retries transient failures (5xx, 429, dropped connections) itself; what it gives up on
  reaches us as an exception, which becomes a BackendError naming the request.
- The API key comes from $TINKER_API_KEY only and is scrubbed from every message we produce.
- Bounded failure (issue 22). The SDK retries a dead connection for ~5 min per request, silently, and creates
  its session on the calling thread (so an asyncio loop, and the first Ctrl-C, wait on it). Here the session
  is created on a thread of its own, and a service never reached fails every waiting call after
  `connect_timeout_s` (30 s) with one line. Once connected, a watchdog pings the session; when calls are in
  flight and the service has not answered for `lost_after_s` (60 s), every waiting call fails with one line
  ("lost the Tinker service ...") and so does every later one. Waiting is always interruptible.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, cast

import numpy as np
import tinker
from tinker.types import RequestErrorCategory

from backends import losses
from backends.base import BackendError, CustomLossFn, Future, loss_of
from backends.errors import UserError
from backends.tinker.convert import (
    fb_output,
    logprobs_output,
    optim_output,
    sample_output,
    tensor,
    to_tinker_adam,
    to_tinker_datum,
    to_tinker_sampling,
    weights_path,
)
from backends.tinker.options import TinkerOptions
from backends.tokenizer import Tokenizer, load_tokenizer
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

if TYPE_CHECKING:
    from tinker.lib.internal_client_holder import InternalClientHolder

log = logging.getLogger(__name__)
R = TypeVar("R")  # what an SDK call's future holds
T = TypeVar("T")  # what our Future holds (R converted)

API_KEY_ENV = "TINKER_API_KEY"
# close() waits this long for the session to finish; a dead server makes the SDK retry for 5 min,
# and a run that is already failing should not hang on its way out. LOST_CLOSE_TIMEOUT_S: after the service was lost.
CLOSE_TIMEOUT_S = 30.0
LOST_CLOSE_TIMEOUT_S = 2.0
# The watchdog pings the session this often (at most; a quarter of lost_after_s when that is shorter), each ping
# waiting up to PING_TIMEOUT_S for its answer (the SDK's own heartbeat waits 10 s).
PING_PERIOD_S = 5.0
PING_TIMEOUT_S = 5.0
# The quick TCP probe before the session: a refused port fails at once instead of after connect_timeout_s.
PROBE_TIMEOUT_S = 3.0

CloseStatus = Literal["success", "errored", "interrupted"]


# ---------------------------------------------------------------- key, errors, futures


# The key sent to a server on this machine when $TINKER_API_KEY is unset (`runner serve` takes any tml- key unless
# it was started with --api-key-env; docs/tinker-offline.md).
LOCAL_KEY = "tml-local"
_told_local: set[str] = set()


def is_loopback(url: str | None) -> bool:
    """A base URL on this machine: localhost, 127.0.0.0/8 or ::1."""
    try:
        host = urllib.parse.urlsplit(url).hostname if url else None
    except ValueError:
        return False
    if host is None:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def api_key_from_env(base_url: str | None = None) -> str:
    """The key, checked the way the SDK checks it, so a bad one fails before any network work. A server on this
    machine (`base_url` loopback) needs none: unset, the placeholder LOCAL_KEY is sent, said once per URL."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    if not key and base_url is not None and is_loopback(base_url):
        if base_url not in _told_local:
            _told_local.add(base_url)
            log.warning("%s is not set: sending the placeholder key %s to %s (a server on this machine)",
                        API_KEY_ENV, LOCAL_KEY, base_url)
        return LOCAL_KEY
    if not key:
        remote = f" ({base_url} is not on this machine)" if base_url else ""
        raise UserError(f"set {API_KEY_ENV} to your Tinker API key (it is read from the environment only){remote}")
    if not key.startswith(("tml-", "eyJ")):  # an API key, or a JWT
        raise UserError(f"set {API_KEY_ENV} to a Tinker API key: it must start with 'tml-'")
    return key


def _scrub(text: str, key: str) -> str:
    return text.replace(key, "tml-***") if key else text


def _first_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# The reply code with which `runner serve` says it no longer holds a training run (it restarted): the run loads
# its last checkpoint and carries on (docs/serve.md "After a restart").
STATE_LOST_CODE = "training_run_not_loaded"


def _state_lost(exc: BaseException) -> bool:
    body = getattr(exc, "body", None)
    if isinstance(body, dict) and body.get("code") == STATE_LOST_CODE:
        return True
    return STATE_LOST_CODE in str(exc)  # the SDK's poller passes the reply's body on only as text


def to_backend_error(exc: BaseException, request: str, key: str) -> BackendError:
    """What the SDK gave up on, as one scrubbed line naming the request."""
    if isinstance(exc, BackendError):
        return exc
    text = str(exc) or type(exc).__name__
    if isinstance(exc, tinker.APIStatusError) and isinstance(exc.body, dict) and exc.body.get("detail"):
        text = str(exc.body["detail"])  # the server's reason, without the SDK's "Error code: ..." wrapping
    # RequestFailedError reads "Request failed: <reason> for self.request_id=... and expected type ...".
    text = re.sub(r" for self\.request_id=.*$", "", text.removeprefix("Request failed: "), flags=re.DOTALL)
    detail = _first_line(_scrub(text, key))
    if _state_lost(exc):
        return BackendError(f"{request}: the server no longer holds this client: {detail}", request=request,
                            state_lost=True)
    user = False
    if isinstance(exc, tinker.RequestFailedError):
        user = exc.category == RequestErrorCategory.User
        what = "server rejected request" if user else "request failed on the server"
    elif isinstance(exc, tinker.AuthenticationError | tinker.PermissionDeniedError):
        user = True
        what = f"not authorised (HTTP {exc.status_code}; check {API_KEY_ENV})"
    elif isinstance(exc, tinker.APIStatusError):
        code = exc.status_code
        # 408/409/429/5xx were retried by the SDK before it gave up; other 4xx are the request's fault.
        user = 400 <= code < 500 and code not in (408, 409, 429)
        what = f"server rejected request (HTTP {code})" if user else f"server error (HTTP {code}) after retries"
    elif isinstance(exc, tinker.APIConnectionError):
        what = "could not reach the Tinker service after retries"
    elif isinstance(exc, ValueError):
        what = "bad reply from the server"
    elif isinstance(exc, concurrent.futures.CancelledError):
        what = "cancelled"
    else:
        what = type(exc).__name__
    return BackendError(f"{request}: {what}: {detail}", request=request, user_error=user)


def _settle(fut: concurrent.futures.Future[T], value: T) -> bool:
    """Deliver a result unless the future is already settled (or cancelled); whether it was delivered."""
    try:
        fut.set_result(value)
    except concurrent.futures.InvalidStateError:
        return False
    return True


class _Pending(Protocol):
    """A call's future as _fail and the link's list of waiting calls see it, whatever its result type."""

    def set_exception(self, exception: BaseException | None, /) -> None: ...


def _fail(fut: _Pending, error: BaseException) -> bool:
    """Deliver an error unless the future is already settled (or cancelled); whether it was delivered."""
    try:
        fut.set_exception(error)
    except concurrent.futures.InvalidStateError:
        return False
    return True


class _Link:
    """What a backend and its clients share: the key (to scrub), the service's address (for messages), the
    calls still waiting, and whether the service was lost (after which every waiting and later call fails)."""

    def __init__(self, key: str, url: str):
        self.key, self.url = key, url
        self._lock = threading.Lock()
        self._waiting: dict[_Pending, str] = {}
        self.lost: str | None = None

    def track(self, out: concurrent.futures.Future[T], request: str) -> None:
        with self._lock:
            lost = self.lost
            if lost is None:
                self._waiting[out] = request
        if lost is not None:
            _fail(out, BackendError(lost, request=request))
            return
        out.add_done_callback(self._forget)

    def _forget(self, out: _Pending) -> None:
        with self._lock:
            self._waiting.pop(out, None)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._waiting)

    def lose(self, reason: str) -> None:
        """Fail every waiting call, and every later one, with `reason`."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost = reason
            waiting, self._waiting = self._waiting, {}
        for out, request in waiting.items():
            _fail(out, BackendError(reason, request=request))


def _wrap(submit: Callable[[], tinker.APIFuture[R]], convert: Callable[[R], T], request: str, link: _Link) -> Future[T]:
    """Call an SDK method and return our Future of `convert(result)`.

    The SDK future is chained, not awaited: its exceptions become BackendErrors and its result is
    converted on the SDK's thread, so nothing `tinker.*` reaches the caller. Cancelling the returned
    future cannot cancel the SDK request (the chain only goes one way). The link fails it when the
    service is lost."""
    out: concurrent.futures.Future[T] = concurrent.futures.Future()
    link.track(out, request)
    if out.done():  # the service was lost before this call
        return Future(out)
    try:
        api_future = submit()
    except Exception as exc:  # noqa: BLE001 - e.g. a datum without the loss's inputs
        _fail(out, to_backend_error(exc, request, link.key))
        return Future(out)

    def done(fut: concurrent.futures.Future[R]) -> None:
        if out.done():  # cancelled by the caller, or failed by the link: nothing to deliver
            return
        try:
            value = convert(fut.result())
        except BaseException as exc:  # noqa: BLE001 - every failure is delivered, none raised here
            _fail(out, to_backend_error(exc, request, link.key))
            return
        _settle(out, value)

    api_future.future().add_done_callback(done)
    return Future(out)


def _registered_loss(spec: losses.LossSpec, config: dict[str, float]) -> CustomLossFn:
    """A registered loss as a custom loss over the learner's logprobs (torch tensors, one per datum)."""
    loss = loss_of(spec.name, config)

    def fn(data: list[Datum], lps: list[losses.Tensor]) -> tuple[losses.Tensor, dict[str, float]]:
        import torch

        terms = [loss(d, lp) for d, lp in zip(data, lps, strict=True)]
        return (sum(terms[1:], terms[0]) if terms else torch.zeros(())), {}  # a tensor even for no data

    return fn


# ---------------------------------------------------------------- clients


class TinkerSamplingClient:
    def __init__(self, client: tinker.SamplingClient, link: _Link, name: str):
        self._client = client
        self._link = link
        self._name = name  # names requests in errors, e.g. "sample #3 (sampler tinker://...)"
        self._calls = 0

    def _request(self, method: str) -> str:
        self._calls += 1
        return f"{method} #{self._calls} ({self._name})"

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        return _wrap(lambda: self._client.sample(tinker.ModelInput.from_ints(list(prompt)), num_samples,
                                                 to_tinker_sampling(params)),
                     sample_output, self._request("sample"), self._link)

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        return _wrap(lambda: self._client.compute_logprobs(tinker.ModelInput.from_ints(list(tokens))),
                     logprobs_output, self._request("compute_logprobs"), self._link)


class TinkerTrainingClient:
    def __init__(self, client: tinker.TrainingClient, link: _Link):
        self._client = client
        self._link = link
        self._calls: dict[str, int] = {}

    def _request(self, method: str, note: str = "") -> str:
        n = self._calls[method] = self._calls.get(method, 0) + 1
        return f"{method} #{n}" + (f" ({note})" if note else "")

    def _fb(self, method: str, data: list[Datum], loss_fn: LossFn,
            loss_config: dict[str, float] | None) -> Future[ForwardBackwardOutput]:
        """A loss the service knows goes by name; any other registered loss (backends/losses.py) runs as a custom
        loss with the registry's function (forward: the logprobs, then the loss computed here)."""
        try:
            spec = losses.get(loss_fn)
            config = spec.resolve(loss_config)
        except ValueError as exc:
            failed: concurrent.futures.Future[ForwardBackwardOutput] = concurrent.futures.Future()
            failed.set_exception(BackendError(str(exc), request=self._request(method), user_error=True))
            return Future(failed)
        if not spec.tinker_builtin:
            if method == "forward_backward":
                return self.forward_backward_custom(data, _registered_loss(spec, config))
            return self._forward_registered(data, spec, config)
        request = self._request(method)

        def submit() -> tinker.APIFuture[tinker.ForwardBackwardOutput]:
            for d in data:
                spec.check_datum(d)
            tdata = [to_tinker_datum(d, spec.inputs) for d in data]
            call = self._client.forward_backward if method == "forward_backward" else self._client.forward
            name = cast("tinker.types.LossFnType", loss_fn)  # spec.tinker_builtin: a name the service knows
            return call(tdata, name, dict(loss_config) if loss_config else None)

        return _wrap(submit, fb_output(data), request, self._link)

    def _forward_registered(self, data: list[Datum], spec: losses.LossSpec,
                            config: dict[str, float]) -> Future[ForwardBackwardOutput]:
        request = self._request("forward", spec.name)
        to_logprobs = fb_output(data)

        def submit() -> tinker.APIFuture[tinker.ForwardBackwardOutput]:
            for d in data:
                spec.check_datum(d)
            probe = [to_tinker_datum(d, ()) for d in data]  # cross_entropy with no weights: the logprobs only
            for t, d in zip(probe, data, strict=True):
                t.loss_fn_inputs["weights"] = tensor(np.zeros(d.target_tokens.shape, np.float32))
            return self._client.forward(probe, "cross_entropy")

        def convert(out: tinker.ForwardBackwardOutput) -> ForwardBackwardOutput:
            import torch

            lps = to_logprobs(out).logprobs
            total = _registered_loss(spec, config)(data, [torch.as_tensor(lp) for lp in lps])[0]
            return ForwardBackwardOutput(logprobs=lps, metrics={"loss:sum": float(total)})

        return _wrap(submit, convert, request, self._link)

    def forward(self, data: list[Datum], loss_fn: LossFn,
                loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        return self._fb("forward", data, loss_fn, loss_config)

    def forward_backward(self, data: list[Datum], loss_fn: LossFn,
                         loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        return self._fb("forward_backward", data, loss_fn, loss_config)

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        # The SDK runs a forward pass, calls the loss with its own tinker.Datums, then a weighted
        # cross-entropy backward pass; we hand the loss our original data (same order) instead.
        tdata = [to_tinker_datum(d, ("weights",)) for d in data]
        return _wrap(lambda: self._client.forward_backward_custom(tdata, lambda _t, lps: loss_fn(data, lps)),
                     fb_output(data), self._request("forward_backward_custom"), self._link)

    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]:
        return _wrap(lambda: self._client.optim_step(to_tinker_adam(params)), optim_output,
                     self._request("optim_step"), self._link)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return _wrap(lambda: self._client.save_state(name, ttl_seconds=ttl_seconds), weights_path,
                     self._request("save_state", repr(name)), self._link)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return _wrap(lambda: self._client.save_weights_for_sampler(name, ttl_seconds=ttl_seconds), weights_path,
                     self._request("save_weights_for_sampler", repr(name)), self._link)

    def save_weights_and_get_sampling_client(self) -> Future[TinkerSamplingClient]:
        request = self._request("save_weights_and_get_sampling_client")
        return _wrap(self._client.save_weights_and_get_sampling_client,
                     lambda c: TinkerSamplingClient(c, self._link, request), request, self._link)


class TinkerBackend:
    """The Tinker service. Constructing it checks the key and makes no network call; the first client it is
    asked for starts the session (bounded by `connect_timeout_s`) and the watchdog (`lost_after_s`)."""

    def __init__(self, cfg: TinkerOptions, model: str, tokenizer: str | None = None):
        base_url = cfg.base_url or os.environ.get("TINKER_BASE_URL") or None
        self._key = api_key_from_env(base_url)
        self.model = model
        self._tokenizer_name = tokenizer
        self._tokenizer: Tokenizer | None = None
        # The key is passed explicitly so the SDK's other credential sources (files, commands) are not used.
        self._service = tinker.ServiceClient(base_url=base_url, api_key=self._key)
        self._base_url = base_url
        self._link = _Link(self._key, base_url or "the hosted service")
        self._closed = threading.Event()
        self._ttl = cfg.ttl_seconds
        self._connect_timeout_s, self._lost_after_s = cfg.connect_timeout_s, cfg.lost_after_s
        self._lock = threading.Lock()
        self._session: concurrent.futures.Future[InternalClientHolder] | None = None
        self._port_opened = False  # the probe before the session opened a TCP connection (for the timeout's message)

    def checkpoint_ttl_seconds(self) -> int | None:
        return self._ttl

    def get_tokenizer(self) -> Tokenizer:
        tokenizer = self._tokenizer
        if tokenizer is None:
            tokenizer = self._tokenizer = load_tokenizer(self._tokenizer_name or self.model)
        return tokenizer

    # ------------------------------------------------------------ the session, bounded

    def _session_future(self) -> concurrent.futures.Future[InternalClientHolder]:
        """The SDK's session, created once on a thread of its own (the SDK blocks while it retries)."""
        with self._lock:
            if self._session is None:
                self._session = concurrent.futures.Future()
                threading.Thread(target=self._connect, name="tinker-connect", daemon=True).start()
                timer = threading.Timer(self._connect_timeout_s, self._connect_timed_out)
                timer.daemon = True
                timer.start()
            return self._session

    def _connect(self) -> None:
        assert self._session is not None
        refused, self._port_opened = _probe(self._base_url, min(self._connect_timeout_s, PROBE_TIMEOUT_S))
        if refused is not None:
            # The SDK would retry a closed port until connect_timeout_s; nothing listens there: say so now.
            _fail(self._session, BackendError(
                f"could not reach the Tinker service at {self._link.url}: {refused} (a wrong base_url, or the "
                "service is not running); nothing ran", user_error=True))
            return
        try:
            holder = self._service.holder  # fetches the client config, then creates the session (SDK retries)
        except Exception as exc:  # noqa: BLE001 - delivered to every call waiting on the session
            _fail(self._session, to_backend_error(exc, "", self._key))
            return
        if _settle(self._session, holder):
            threading.Thread(target=self._watch, args=(holder,), name="tinker-watchdog", daemon=True).start()

    def _connect_timed_out(self) -> None:
        assert self._session is not None
        # user_error: the service was never reached, so nothing ran (no "can be resumed"); exit 2.
        why = ("its port accepts connections but no session was created: the service is stalled or overloaded"
               if self._port_opened else "no network, a wrong base_url, or the service is down")
        _fail(self._session, BackendError(
            f"could not reach the Tinker service at {self._link.url} within {self._connect_timeout_s:g} s ({why}; "
            "backend.connect_timeout_s waits longer); nothing ran", user_error=True))

    def _watch(self, holder: InternalClientHolder) -> None:
        """Ping the session; while calls wait and the service has not answered for lost_after_s, lose it."""
        period = min(PING_PERIOD_S, self._lost_after_s / 4)
        last_answer, last_error = time.monotonic(), "no answer"
        while not self._closed.wait(period):
            try:
                holder.run_coroutine_threadsafe(_ping(holder, PING_TIMEOUT_S)).result(PING_TIMEOUT_S + 5)
                last_answer = time.monotonic()
            except tinker.APIStatusError as exc:  # it answered; 5xx: a proxy answered for a service that is down
                if exc.status_code < 500:
                    last_answer = time.monotonic()
                else:
                    last_error = f"HTTP {exc.status_code}"
            except (tinker.APIConnectionError, TimeoutError, concurrent.futures.TimeoutError) as exc:
                last_error = _first_line(_scrub(str(exc) or type(exc).__name__, self._key), 120)
            except Exception as exc:  # noqa: BLE001 - the SDK's internals moved: stop watching rather than guess
                log.debug("Tinker watchdog stopped: %s", type(exc).__name__)
                return
            silent = time.monotonic() - last_answer
            if silent >= self._lost_after_s and self._link.busy():
                self._link.lose(f"lost the Tinker service at {self._link.url}: no answer for {silent:.0f} s "
                                f"({last_error})")
                return

    def _call(self, submit: Callable[[], tinker.APIFuture[R]], convert: Callable[[R], T], request: str) -> Future[T]:
        """_wrap once the session exists; until then the call waits for it (bounded) off the calling thread."""
        session = self._session_future()
        if session.done() and session.exception() is None:
            return _wrap(submit, convert, request, self._link)
        out: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._link.track(out, request)

        def go(ready: concurrent.futures.Future[InternalClientHolder]) -> None:
            error = ready.exception()
            if error is not None:
                _fail(out, BackendError(str(error), request=request,
                                                user_error=getattr(error, "user_error", False)))
                return
            def relay(f: concurrent.futures.Future[T]) -> None:
                error = f.exception()
                if error is not None:
                    _fail(out, error)
                else:
                    _settle(out, f.result())

            _wrap(submit, convert, request, self._link).future().add_done_callback(relay)

        session.add_done_callback(go)
        return Future(out)

    # ------------------------------------------------------------ the protocol

    def create_training_client(self, spec: LoraSpec) -> Future[TinkerTrainingClient]:
        if spec.rank < 1:
            raise UserError("Tinker trains LoRA adapters only: set lora.rank >= 1")
        return self._call(
            lambda: self._service.create_lora_training_client(
                base_model=spec.base_model, rank=spec.rank, seed=spec.seed, train_mlp=spec.train_mlp,
                train_attn=spec.train_attn, train_unembed=spec.train_unembed),
            lambda c: TinkerTrainingClient(c, self._link), f"create_training_client {spec.base_model!r}")

    def create_training_client_from_state(self, path: str, spec: LoraSpec,
                                          with_optimizer: bool = True) -> Future[TinkerTrainingClient]:
        # The checkpoint knows its base model and LoRA shape; `spec` is what the caller expects it to be.
        def submit() -> tinker.APIFuture[tinker.TrainingClient]:
            method = (self._service.create_training_client_from_state_with_optimizer if with_optimizer
                      else self._service.create_training_client_from_state)
            return method(path)

        return self._call(submit, lambda c: TinkerTrainingClient(c, self._link),
                          f"create_training_client_from_state {path!r}")

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> Future[TinkerSamplingClient]:
        name = model_path or base_model
        if name is None:
            raise ValueError("create_sampling_client needs model_path or base_model")
        return self._call(lambda: self._service.create_sampling_client(model_path=model_path, base_model=base_model),
                          lambda c: TinkerSamplingClient(c, self._link, f"sampler {name}"),
                          f"create_sampling_client {name!r}")

    def close(self, status: str = "success") -> None:
        """Finish the session; this also stops the SDK's heartbeat and config-refresh tasks. No session (never
        connected): nothing to finish. A lost service gets a short try."""
        if self._closed.is_set():
            return
        self._closed.set()
        session = self._session
        if session is None or not session.done() or session.exception() is not None:
            return
        st: CloseStatus = status if status in ("success", "errored", "interrupted") else "errored"  # type: ignore[assignment]
        try:
            self._service.close(st).result(timeout=LOST_CLOSE_TIMEOUT_S if self._link.lost else CLOSE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - closing must not hide the error that ended the run
            log.warning("closing the Tinker session failed: %s", _first_line(_scrub(str(exc), self._key)))


def _probe(base_url: str | None, timeout: float) -> tuple[str | None, bool]:
    """(why a TCP connection to `base_url` is refused outright ("connection refused on host:port") or None, whether
    one opened). Timed out or a name that did not resolve: (None, False), the SDK's bounded tries decide those. No
    base_url (the hosted service): (None, False)."""
    if not base_url:
        return None, False
    url = urllib.parse.urlsplit(base_url)
    try:
        host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    except ValueError:  # a port that is not a number: the SDK says so
        return None, False
    if not host:
        return None, False
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None, True
    except ConnectionRefusedError:
        return f"connection refused on {host}:{port}", False
    except OSError:
        return None, False


async def _ping(holder: InternalClientHolder, timeout: float) -> None:
    """One session heartbeat, no retries (what the SDK's own heartbeat loop sends every 10 s)."""
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

    with holder.aclient(ClientConnectionPoolType.SESSION) as client:
        await client.service.session_heartbeat(session_id=holder.get_session_id(), max_retries=0, timeout=timeout)
