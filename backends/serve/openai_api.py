"""`runner serve`'s OpenAI-compatible routes: `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`
(docs/openai.md). `model` names a served base model, a sampler checkpoint of this server
(`tinker://<run>/sampler_weights/<name>`), or a local checkpoint (a run dir, `RUN_DIR:NAME`, or a checkpoint folder)
that the `local_model` hook resolves. Requests are read and answered by backends/serve/chat_api.py; streamed ones
leave token by token (backends/serve/streaming.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hmac
import itertools
import json
import queue
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from backends.errors import UserError
from backends.serve import responses, streaming
from backends.serve.chat_api import (
    MODEL_NOT_FOUND,
    ChatFormat,
    Plan,
    TopK,
    chat_plan,
    chat_response,
    completion_plan,
    completion_response,
    error_body,
    lone_surrogate,
    new_id,
    sse,
)
from backends.serve.files import copy_folder
from backends.serve.limits import json_depth_ok
from backends.serve.memory import Memory, fmt_bytes
from backends.serve.replies import ApiError, Reply
from backends.tokenizer import Tokenizer
from backends.types import Json, SampleOutput, SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from backends.base import Future, SamplingClient
    from backends.serve.limits import Budget, Limits
    from backends.serve.samplers import SamplerPool, SamplerSession
    from backends.serve.sessions import ServedModel
    from backends.serve.store import Store

T = TypeVar("T")

# ---------------------------------------------------------------- runner serve's routes


@dataclass(frozen=True)
class LocalModel:
    """A local checkpoint the `local_model` hook found: its base model (as its run named it), its sampler folder,
    and its run's renderer (None: the served model's)."""

    base_model: str
    path: Path
    renderer: str | None = None


@dataclass
class OpenAIHooks:
    """What runner gives `runner serve` (backends never import runner): the chat format of a model (its name as
    served, its tokenizer, a renderer name or None for the model's own) and the resolver of local checkpoints
    (a run dir, `RUN_DIR:NAME`, a checkpoint folder; None when `spec` names none)."""

    chat: Callable[[str, Tokenizer, str | None], ChatFormat]
    local_model: Callable[[str], LocalModel | None] = lambda _: None


class Served(Protocol):
    """What the /v1 routes use of the Tinker service (backends/serve/service.py Service, which imports this module)."""

    api_key: str | None
    limits: Limits
    models: dict[str, ServedModel]
    memory: Memory
    budget: Budget
    pool: SamplerPool
    store: Store

    def _served(self, name: str) -> ServedModel: ...
    def _parse_path(self, path: str) -> tuple[str, str, str]: ...
    def _sample_bytes(self, model: ServedModel, n: int, prompt: int, max_tokens: int, want_lps: bool) -> int: ...


class OpenAIRoutes:
    """`/v1/...` on runner serve. Each distinct `model` gets one sampling session in the service's sampler pool
    (loaded on demand, freed when idle like the SDK's), so the pool's caps hold for these requests too."""

    def __init__(self, service: Served, hooks: OpenAIHooks | None = None):
        self.service = service
        self.hooks = hooks
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[SamplerSession, str | None]] = {}  # model spec -> (session, renderer)
        self._formats: dict[tuple[str, str | None], ChatFormat] = {}
        self._ids = itertools.count()
        self._started = int(time.time())

    def handle(self, method: str, route: str, headers: dict[str, str], body: bytes,
               gone: Callable[[], bool] | None = None) -> Reply:
        try:
            return self._handle(method, route, headers, body, gone or _never)
        except ClientGone:
            return Reply(Reply.GONE)
        except ApiError as exc:
            return Reply.json(error_body(exc.status, exc.detail, exc.param, exc.code), exc.status)
        except (UserError, ValueError) as exc:
            return Reply.json(error_body(400, str(exc)[:300]), 400)

    def _authorized(self, headers: dict[str, str]) -> bool:
        key = self.service.api_key
        if key is None:
            return True
        given = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    def _handle(self, method: str, route: str, headers: dict[str, str], body: bytes, gone: Callable[[], bool]) -> Reply:
        if not self._authorized(headers):
            raise ApiError(401, "invalid API key (send it as Authorization: Bearer <key>)")
        if route == "v1/models" or route.startswith("v1/models/"):
            if method != "GET":
                raise ApiError(405, f"{route} takes GET, not {method}")
            return self._models(urllib.parse.unquote(route.removeprefix("v1/models").strip("/")))
        if route not in ("v1/chat/completions", "v1/completions", "v1/responses"):
            raise ApiError(404, f"no route {method} /{route[:100]}")
        if method != "POST":
            raise ApiError(405, f"/{route} takes POST, not {method}")
        limits = self.service.limits
        if len(body) > limits.max_body_bytes:  # aio.py refuses it unread; a transport that reads it whole, here
            raise ApiError(413, f"request body is {len(body)} bytes; at most {limits.max_body_bytes}")
        if body and not json_depth_ok(body, limits.max_json_depth):
            raise ApiError(400, f"JSON nested deeper than {limits.max_json_depth} levels")
        try:
            req = json.loads(body) if body else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON") from None
        if not isinstance(req, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if (bad := lone_surrogate(req)) is not None:
            raise ApiError(400, f"{bad}: a string with a lone surrogate (\\ud800-\\udfff) is not valid Unicode")
        asked = req
        if route == "v1/responses":  # OpenAI's Responses API, sampled as the chat completion it amounts to
            req = responses.to_chat(req)
        model = req.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model is required (a served model's name or a checkpoint)", param="model")
        sess, renderer = self._session(model)
        engine = sess.model.engine()
        tokenizer = engine.get_tokenizer()
        fmt: ChatFormat | None = None
        if route in ("v1/chat/completions", "v1/responses"):
            fmt = self._format(sess.model.name, tokenizer, renderer)
            plan = chat_plan(req, fmt, limits)
        else:
            plan = completion_plan(req, tokenizer, limits)
        if plan.cost > limits.max_request_tokens:
            raise ApiError(413, f"n x (prompt + max_tokens) = {plan.cost} tokens; runner serve takes at most "
                                f"{limits.max_request_tokens} per request")
        if route == "v1/responses" and asked.get("stream"):  # its events, made from the chat stream's chunks
            plan = dataclasses.replace(plan, stream=True, include_usage=True)
            return self._stream(sess, plan, fmt, tokenizer, gone,
                                lambda chunks: responses.stream(asked, chunks, plan.model))
        if plan.stream and not plan.echo and plan.params is not None:
            return self._stream(sess, plan, fmt, tokenizer, gone, streaming.sse)
        result = self._run(sess, plan, fmt, tokenizer, gone)
        if route == "v1/responses":
            return Reply.json(responses.from_chat(asked, result))
        if plan.stream:  # echo: the prompt's logprobs come from a pass after sampling; one chunk per choice
            return Reply(200, sse(result, plan.include_usage), {"content-type": "text/event-stream"})
        return Reply.json(result)

    def _format(self, name: str, tokenizer: Tokenizer, renderer: str | None) -> ChatFormat:
        if self.hooks is None:
            raise ApiError(400, "this server was started without chat formats: use /v1/completions")
        key = (name, renderer)
        with self._lock:
            fmt = self._formats.get(key)
        if fmt is None:
            fmt = self.hooks.chat(name, tokenizer, renderer)
            with self._lock:
                self._formats[key] = fmt
        return fmt

    def _reserve(self, sess: SamplerSession, plan: Plan, gone: Callable[[], bool]) -> _Share:
        """The request's share of the sampling budget, once it is its turn (ClientGone if its client left first)."""
        svc = self.service
        gen = plan.params.max_tokens if plan.params is not None else 0
        # The request's memory (backends/serve/memory.py), as the Tinker API's sample requests reserve it: over
        # --max-bytes a 413 now; otherwise it waits, in arrival order, with them for tokens and bytes (and after
        # Limits.max_sample_wait_s of waiting on memory only ending sessions free, a 429).
        nbytes = sum(svc._sample_bytes(sess.model, plan.n, len(p), max(gen, 1), plan.echo and plan.logprobs)
                     for p in plan.prompts)
        cap = svc.memory.max_bytes
        if nbytes > cap:
            raise ApiError(413, f"this request needs {fmt_bytes(nbytes)} of sampling memory ({len(plan.prompts)} "
                                f"prompt(s) x n {plan.n}), over runner serve's --max-bytes {fmt_bytes(cap)}: send "
                                "fewer prompts, samples or tokens per request")
        ready, refused = threading.Event(), []

        def fail(why: str) -> None:
            refused.append(why)
            ready.set()

        start = ready.set
        svc.budget.acquire(plan.cost, start, nbytes, fail)
        while not ready.wait(POLL_S):
            if gone() and svc.budget.withdraw(start):
                raise ClientGone
        if refused:
            raise ApiError(429, refused[0])
        return _Share(svc.budget, plan.cost, nbytes)

    def _run(self, sess: SamplerSession, plan: Plan, fmt: ChatFormat | None, tokenizer: Tokenizer,
             gone: Callable[[], bool] = lambda: False) -> Json:
        svc = self.service
        held = self._reserve(sess, plan, gone)
        try:
            try:
                sc = svc.pool.client(sess).result()
            except Exception as exc:  # the checkpoint is gone or does not load
                raise ApiError(404, f"model {plan.model!r} does not load: {str(exc)[:200]}") from None
            topk = _topk_of(sc)
            cancelled = threading.Event()
            outs: list[SampleOutput | None] = [None] * len(plan.prompts)
            if plan.params is not None:
                # Every row checks `cancelled` at each token (backends/local/decoding.py Row.add): a client that
                # hangs up ends its rows at their next token, queued or decoding.
                params = Watched(**_fields(plan.params), watch=lambda i, t, r: not cancelled.is_set())
                futs = [sc.sample(p, plan.n, params) for p in plan.prompts]
                held.after(futs)  # its memory is in use until the sampler is done with every prompt
                _wait(futs, gone, cancelled)
                outs = [_user_result(f) for f in futs]
            try:
                if fmt is not None:
                    out = outs[0]
                    assert out is not None
                    return chat_response(plan, out, fmt, topk)
                prompt_lps = None
                if plan.echo and plan.logprobs:
                    lps = [sc.compute_logprobs(p) for p in plan.prompts]
                    _wait(lps, gone, cancelled)
                    prompt_lps = [_user_result(f) for f in lps]
                return completion_response(plan, outs, tokenizer, topk, prompt_lps)
            finally:
                sess.last_used = time.monotonic()
        finally:
            held.release()

    def _stream(self, sess: SamplerSession, plan: Plan, fmt: ChatFormat | None, tokenizer: Tokenizer,
                gone: Callable[[], bool], encode: Callable[[Iterator[Json]], Iterator[bytes]]) -> Reply:
        """A `stream = true` request whose tokens leave as they are sampled (backends/serve/streaming.py), its chunk
        objects written by `encode` (chat / completion SSE, or the Responses API's events). Whatever fails before
        its first token (a prompt over the context, a checkpoint that does not load) is still an error reply; the
        headers go out with the first token."""
        assert plan.params is not None
        held = self._reserve(sess, plan, gone)
        cancelled = threading.Event()
        try:
            try:
                sc = self.service.pool.client(sess).result()
            except Exception as exc:  # the checkpoint is gone or does not load
                raise ApiError(404, f"model {plan.model!r} does not load: {str(exc)[:200]}") from None
            topk = _topk_of(sc)
            events: queue.SimpleQueue[tuple[int, int, int | None]] = queue.SimpleQueue()

            def watcher(p: int) -> Callable[[int, int, str | None], bool]:
                def watch(k: int, tok: int, reason: str | None) -> bool:
                    events.put((p, k, tok))
                    return not cancelled.is_set()
                return watch

            futs = [sc.sample(prompt, plan.n, Watched(**_fields(plan.params), watch=watcher(p)))
                    for p, prompt in enumerate(plan.prompts)]
            held.after(futs)
            for p, f in enumerate(futs):
                f.future().add_done_callback(lambda _, p=p: events.put((p, streaming.DONE, None)))
            while True:  # the first event, before any header is sent
                try:
                    first = events.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if gone():
                        raise ClientGone from None
            if first[1] == streaming.DONE:
                _user_result(futs[first[0]])  # a request refused at once: its 4xx, not a stream
        except BaseException:
            cancelled.set()
            held.release()
            raise
        chat = fmt is not None
        if fmt is not None:
            text_of = streaming.chat_text(fmt)
            own = [len(x) for x in fmt.stop if isinstance(x, str)]
        else:
            text_of, own = streaming.completion_text(tokenizer), []
        holdback = max([0, *(len(x) - 1 for x in plan.user_stop), *(n - 1 for n in own)])
        head = {"id": new_id("chatcmpl" if chat else "cmpl"), "created": int(time.time()), "model": plan.model,
                "system_fingerprint": None}

        def finish(p: int, out: SampleOutput) -> list[Json]:
            one = streaming.one_prompt(plan, p)
            if fmt is not None:
                choices = chat_response(one, out, fmt, topk)["choices"]
            else:
                choices = completion_response(one, [out], tokenizer, topk)["choices"]
            for c, seq in zip(choices, out.sequences, strict=True):
                c["index"] = p * plan.n + c["index"]
                c["_tokens"] = len(seq.tokens)
            return choices

        def done() -> None:
            sess.last_used = time.monotonic()
            held.release()

        body = streaming.chunks(first, events, futs, plan, head, chat, text_of, holdback, finish, _user_result, gone,
                                cancelled, done)
        return Reply(200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"},
                     stream=encode(body))

    def _session(self, spec: str) -> tuple[SamplerSession, str | None]:
        from backends.serve.samplers import SamplerSession

        svc = self.service
        run_id = kind = name = ""
        if spec.startswith("tinker://"):
            try:
                run_id, kind, name = svc._parse_path(spec)  # 404 once expired or deleted
            except ApiError as exc:
                raise ApiError(exc.status, exc.detail, exc.code or (MODEL_NOT_FOUND if exc.status == 404 else None)) from None
            if kind == "weights":
                raise ApiError(400, f"{spec} is a training state; sample from its sampler_weights checkpoint")
        with self._lock:
            hit = self._sessions.get(spec)
        if hit is not None:
            return hit
        renderer = None
        if spec in svc.models:
            sess = SamplerSession(f"openai:{next(self._ids)}", svc.models[spec], "openai", None)
        elif spec.startswith("tinker://"):
            meta = svc.store.read_run(run_id)
            if meta is None:
                raise ApiError(404, f"no training run {run_id}", code=MODEL_NOT_FOUND)
            sess = SamplerSession(f"openai:{next(self._ids)}", svc._served(meta["base_model"]), "openai", spec,
                                  source=svc.store.checkpoint_dir(run_id, kind, name))
        else:
            if any(len(part.encode("utf-8", "replace")) > 255 for part in spec.split("/")):
                raise ApiError(400, f"model {spec[:60]!r}... ({len(spec.encode('utf-8', 'replace'))} bytes) is no "
                                    "served model, and a path's parts are at most 255 bytes")
            try:
                local = self.hooks.local_model(spec) if self.hooks is not None else None
            except OSError as exc:  # a name too long for the file system, say
                raise ApiError(400, f"model {spec[:100]!r}: {exc.strerror or type(exc).__name__}") from None
            if local is None:
                raise ApiError(404, f"model {spec[:200]!r} is neither a served model ({', '.join(svc.models)}), "
                                    "a tinker:// sampler checkpoint, nor a run under a folder runner serve was "
                                    "given with --runs", code=MODEL_NOT_FOUND)
            served = self._served_for(local.base_model)
            sid = f"openai:{next(self._ids)}"
            # The checkpoint's files, copied into the server's storage as regular files (backends/serve/files.py):
            # the sampler then reads only what the server owns, and a FIFO or link there is refused now.
            copy = svc.store.ephemeral_dir / sid.replace(":", "-")
            copy_folder(local.path, copy, skip=frozenset({"optimizer.pt"}))
            sess = SamplerSession(sid, served, "openai", spec, source=copy)
            renderer = local.renderer
        with self._lock:
            hit = self._sessions.setdefault(spec, (sess, renderer))
        if hit[0] is sess:
            svc.pool.add(sess)
        elif sess.source is not None and sess.source.is_relative_to(svc.store.ephemeral_dir):
            shutil.rmtree(sess.source, ignore_errors=True)  # a concurrent request's copy won
        return hit

    def _served_for(self, base: str) -> ServedModel:
        svc = self.service
        for m in svc.models.values():
            if base in (m.name, m.path) or _same_dir(base, m.path):
                return m
        raise ApiError(404, f"that checkpoint was trained on {base!r}, which this server does not serve "
                            f"(it serves {', '.join(svc.models)})", code=MODEL_NOT_FOUND)

    def _models(self, one: str) -> Reply:
        svc = self.service
        # `created`: when this server started serving a base model, when a checkpoint was saved (stable across calls).
        names = [(name, self._started) for name in svc.models]
        for run in svc.store.list_runs():
            names += [(c["tinker_path"], _epoch(c.get("time"), self._started))
                      for c in svc.store.list_checkpoints(run["training_run_id"])
                      if c.get("checkpoint_type") == "sampler"]
        rows = [{"id": n, "object": "model", "created": t, "owned_by": "runner"} for n, t in names]
        if one:
            row = next((r for r in rows if r["id"] == one), None)
            if row is None:
                raise ApiError(404, f"no model {one[:200]!r}", code=MODEL_NOT_FOUND)
            return Reply.json(row)
        return Reply.json({"object": "list", "data": rows})


POLL_S = 0.1  # how often a waiting /v1 request looks whether its client hung up


class ClientGone(Exception):
    """The client of a /v1 request hung up: its work was stopped, and no reply is sent."""


def _never() -> bool:
    return False


@dataclass(frozen=True)
class Watched(SamplingParams):
    """SamplingParams with a per-token hook the local sampler calls for each row (backends/local/decoding.py
    Row.add): watch(sample index, token, stop reason or None); False ends the row there."""

    watch: Callable[[int, int, str | None], bool] | None = field(default=None, compare=False)


def _fields(p: SamplingParams) -> Json:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(SamplingParams)}


def _wait(futs: Sequence[Future[object]], gone: Callable[[], bool], cancelled: threading.Event) -> None:
    """Wait for the futures; when the client hangs up meanwhile, end their rows (`cancelled`) and raise ClientGone."""
    inner = [f.future() for f in futs]
    while True:
        _, pending = concurrent.futures.wait(inner, timeout=POLL_S)
        if not pending:
            return
        if gone():
            cancelled.set()
            raise ClientGone


class _Share:
    """A /v1 request's share of the sampling budget: given back once, when the request is done with it and the
    sampler is done with every prompt it was sent (a request whose client left still decodes up to a token)."""

    def __init__(self, budget: Budget, cost: int, nbytes: int):
        self.budget, self.cost, self.nbytes = budget, cost, nbytes
        self._lock = threading.Lock()
        self._left = 1  # the request itself, plus each future handed to the sampler
        self._done = False

    def after(self, futs: Sequence[Future[object]]) -> None:
        with self._lock:
            self._left += len(futs)
        for f in futs:
            f.future().add_done_callback(lambda _: self.release())

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left > 0 or self._done:
                return
            self._done = True
        self.budget.release(self.cost, self.nbytes)


def _epoch(iso: object, default: int) -> int:
    try:
        return int(datetime.datetime.fromisoformat(str(iso).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return default


def _same_dir(a: str, b: str) -> bool:
    try:
        pa, pb = Path(a), Path(b)
        return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()
    except OSError:
        return False


def _user_result(fut: Future[T]) -> T:
    """A sampling future's result; a refusal that is the request's own (a prompt that fills the model's context:
    BackendError.user_error, as the Tinker API's futures fail with category `user`) is a 400, not a 500."""
    from backends.base import BackendError

    try:
        return fut.result()
    except BackendError as exc:
        if not exc.user_error:
            raise
        raise ApiError(400, exc.detail) from None


def _topk_of(sc: SamplingClient) -> TopK | None:
    """Top-k logprobs over the sampler's model: a LocalBackend sampler's (a test's scripted sampler has none)."""
    from backends.local.backend import LocalSamplingClient
    from backends.serve.topk import topk_and_own

    if not isinstance(sc, LocalSamplingClient):
        return None
    model = sc.model

    def topk(tokens: list[int], k: int, temperature: float, positions: Sequence[int]
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return topk_and_own(model, tokens, k, temperature, positions)

    return topk

