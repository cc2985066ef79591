"""The Tinker service's HTTP API (tinker-sdk.md §4.3, §1.5) over the local backend: what `runner serve` runs.

`Service.handle(method, path, headers, body) -> Reply` is the whole API, independent of the HTTP server
(backends/serve/http.py). What it promises, as the hosted service does:
- submits answer at once with a promise; `retrieve_future` long-polls (holds the request until the result is
  ready, up to LONG_POLL_S, under the SDK's 45 s read timeout) and only then says try_again;
- a model's requests run strictly in seq_id order, whatever order they arrive in (the SDK sends a
  forward_backward's chunks concurrently, chunk 0 last);
- results are protobuf for forward_backward and sample, JSON otherwise; a request the engine refuses is a
  failed future with category "user" and the reason;
- training runs and checkpoints live on disk (backends/serve/store.py): a restarted server lists, loads and
  resumes them, and session (hence run) ids never repeat;
- memory is bounded: a sampling session keeps only its weights' source (a checkpoint folder, or a spilled
  snapshot) and at most MAX_LIVE_SAMPLERS sessions hold a loaded model, each freed after SAMPLER_IDLE_S idle;
  finished or silent sessions (no heartbeat for SESSION_TIMEOUT_S) free their clients; checkpoint ttl_seconds
  are honoured.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import hmac
import importlib.util
import itertools
import json
import logging
import secrets
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import BackendError, Future
from backends.errors import UserError
from backends.serve import losses as extra_losses
from backends.serve import wire
from backends.serve.store import KINDS, Store, iso, now, valid_name
from backends.types import LOSS_FNS, AdamParams, Datum, ForwardBackwardOutput, LoraSpec, SamplingParams

log = logging.getLogger("runner.serve")

LONG_POLL_S = 30.0  # the SDK reads retrieve_future with a 45 s timeout
PROMISE_KEEP_S = 900.0  # a result stays retrievable this long after it is ready
SESSION_TIMEOUT_S = 600.0  # the SDK heartbeats every 10 s; a session silent this long is gone
SAMPLER_IDLE_S = 30.0
MAX_LIVE_SAMPLERS = 4
STABILITY_TTL_S = 86400.0  # recorded sequences for stable_reinforce (the service keeps them a day)
STABILITY_MAX = 200_000
DOWNLOAD_URL_TTL_S = 3600
REAP_EVERY_S = 1.0
IDEMPOTENCY_KEYS = 20_000  # submits remembered by X-Idempotency-Key


class ApiError(Exception):
    """An HTTP error reply: {"detail": ...} with this status. Never 408/409/429/5xx for the client's mistakes:
    the SDK retries those for up to 5 minutes."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    file: Path | None = None  # stream this file as the body (downloads)

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> Reply:
        return cls(status, json.dumps(obj).encode(), {"content-type": "application/json"})


def failed(message: str, category: str = "user") -> Reply:
    return Reply.json({"error": message, "category": category})


def _error_reply(exc: BaseException) -> Reply:
    """An engine failure as a failed future: the user's fault when the backend says so."""
    if isinstance(exc, BackendError):
        msg = str(exc)
        if exc.request and msg.startswith(exc.request + ": "):
            msg = msg[len(exc.request) + 2:]
        return failed(msg, "user" if exc.user_error else "server")
    if isinstance(exc, (UserError, ValueError, KeyError)):
        return failed(str(exc), "user")
    log.warning("request failed: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))
    return failed(f"{type(exc).__name__}: {exc}", "server")


class Promise:
    def __init__(self, route: str):
        self.route = route
        self.future: concurrent.futures.Future[Reply] = concurrent.futures.Future()
        self.done_at: float | None = None
        self.future.add_done_callback(self._stamp)

    def _stamp(self, _: Any) -> None:
        self.done_at = time.monotonic()

    def resolve(self, reply: Reply) -> None:
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            self.future.set_result(reply)


def deliver(promise: Promise, fut: Future[Any] | concurrent.futures.Future[Any], to_reply: Callable[[Any], Reply]) -> None:
    """Resolve `promise` from an engine future: to_reply(result), or the error as a failed request."""
    inner = fut.future() if isinstance(fut, Future) else fut

    def done(f: concurrent.futures.Future[Any]) -> None:
        try:
            reply = to_reply(f.result())
        except BaseException as exc:  # noqa: BLE001 - reported to the client as a failed request
            reply = _error_reply(exc)
        promise.resolve(reply)

    inner.add_done_callback(done)


# ---------------------------------------------------------------- models, runs, samplers


@dataclass
class ServedModel:
    """A base model under the name clients ask for (`--model NAME=PATH`)."""

    name: str
    path: str  # "tiny", a HF folder, or a cached hub id (backends/local/model.py)
    make_backend: Callable[[], Any]
    backend: Any = None
    tokenizer_dir: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def engine(self) -> Any:
        with self.lock:
            if self.backend is None:
                self.backend = self.make_backend()
            return self.backend


@dataclass
class Run:
    """A training client: requests execute in seq_id order."""

    run_id: str
    model: ServedModel
    spec: LoraSpec
    tc: Future[Any]
    session_id: str
    next_seq: int = 1
    pending: dict[int, Callable[[], None]] = field(default_factory=dict)


@dataclass
class SamplerSession:
    """A sampling session. `source` (a checkpoint or spilled-snapshot folder; None = the base model) or
    `weights` (a snapshot still in memory) is what rebuilds its model after it was freed."""

    sampler_id: str
    model: ServedModel
    session_id: str
    model_path: str | None
    source: Path | None = None
    weights: tuple[dict[str, Any], Any, int] | None = None  # (trainable tensors, TrainSetup, step)
    client: Future[Any] | None = None
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class Session:
    session_id: str
    last_seen: float = field(default_factory=time.monotonic)
    runs: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


class Service:
    def __init__(self, store: Store, models: dict[str, ServedModel], api_key: str | None = None,
                 long_poll_s: float = LONG_POLL_S, sampler_idle_s: float = SAMPLER_IDLE_S,
                 max_live_samplers: int = MAX_LIVE_SAMPLERS, session_timeout_s: float = SESSION_TIMEOUT_S):
        self.store = store
        self.models = models
        self.api_key = api_key
        self.long_poll_s = long_poll_s
        self.sampler_idle_s = sampler_idle_s
        self.max_live_samplers = max_live_samplers
        self.session_timeout_s = session_timeout_s
        self._secret = secrets.token_bytes(32)  # signs download URLs
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._promises: dict[str, Promise] = {}
        self._runs: dict[str, Run] = {}
        self._samplers: dict[str, SamplerSession] = {}
        self._sessions: dict[str, Session] = {}
        self._idempotent: collections.OrderedDict[str, Reply] = collections.OrderedDict()
        self._stability: collections.OrderedDict[str, tuple[np.ndarray, np.ndarray, float]] = collections.OrderedDict()
        self._extras = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="serve-extras")
        self._gather = _Gather()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="serve-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        self._gather.close()
        self._extras.shutdown(wait=False, cancel_futures=True)
        for m in self.models.values():
            if m.backend is not None:
                m.backend.close()

    # ------------------------------------------------------------ dispatch

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, base_url: str = "") -> Reply:
        """One request. Blocks only in retrieve_future's long-poll."""
        route = path.split("?", 1)[0].removeprefix("/api/v1/").strip("/")
        if route.startswith("files/"):  # signed download URLs carry their own authorisation
            return self._download(route, path)
        if (self.api_key is not None and route != "healthz"
                and not hmac.compare_digest(headers.get("x-api-key", "").encode(), self.api_key.encode())):
            return Reply.json({"detail": "invalid API key"}, 401)
        # A submit the SDK retries (its answer was lost) carries the same idempotency key: answer it again
        # instead of running it twice (or refusing its seq id as used).
        key = headers.get("x-idempotency-key") if method == "POST" and route != "retrieve_future" else None
        if key is not None:
            with self._lock:
                seen = self._idempotent.get(key)
            if seen is not None:
                return seen
        reply = self._handle(method, route, path, headers, body, base_url)
        if key is not None and reply.status == 200:
            with self._lock:
                self._idempotent[key] = reply
                while len(self._idempotent) > IDEMPOTENCY_KEYS:
                    self._idempotent.popitem(last=False)
        return reply

    def _handle(self, method: str, route: str, path: str, headers: dict[str, str], body: bytes, base_url: str) -> Reply:
        try:
            if route == "forward_backward":
                return self._forward_backward(headers, body)
            req = json.loads(body) if body else {}
            if not isinstance(req, dict):
                raise ApiError(422, "the request body must be a JSON object")
            return self._route(method, route, req, path, base_url)
        except ApiError as exc:
            return Reply.json({"detail": exc.detail}, exc.status)
        except (ValueError, KeyError, TypeError, UserError) as exc:  # a malformed request is the client's fault
            return Reply.json({"detail": f"bad request: {type(exc).__name__}: {exc}"}, 422)

    def _route(self, method: str, route: str, req: dict[str, Any], path: str, base_url: str) -> Reply:
        simple: dict[str, Callable[[dict[str, Any]], Reply]] = {
            # SDKs before 0.38 load a checkpoint with one 0.38-style load_weights only when told to.
            "client/config": lambda _: Reply.json({"create_model_via_load_weights": True}),
            "client/dynamic_config": lambda _: Reply.json({}),
            "healthz": lambda _: Reply.json({"status": "ok"}),
            "telemetry": lambda _: Reply.json({"status": "accepted"}),
            "create_session": self._create_session,
            "session_heartbeat": self._heartbeat,
            "get_server_capabilities": self._capabilities,
            "create_model": self._create_model,
            "get_info": self._get_info,
            "load_weights": self._load_weights,
            "optim_step": self._optim_step,
            "save_weights": lambda r: self._save(r, "weights"),
            "save_weights_for_sampler": lambda r: self._save(r, "sampler_weights"),
            "save_weights_external": lambda r: self._save(r, "external_weights"),
            "create_sampling_session": self._create_sampling_session,
            "asample": self._sample,
            "retrieve_future": self._retrieve,
            "cancel_future": self._cancel,
            "weights_info": self._weights_info,
            "copy_weights": self._copy_weights,
        }
        if route in simple:
            return simple[route](req)
        parts = route.split("/")
        if parts[0] == "sessions" and len(parts) == 3 and parts[2] == "finish":
            self._finish_session(parts[1])
            return Reply.json({})
        if parts[0] == "samplers" and len(parts) == 2:
            s = self._sampler(parts[1])
            return Reply.json({"sampler_id": s.sampler_id, "base_model": s.model.name, "model_path": s.model_path})
        if parts[0] == "training_runs":
            return self._training_runs(method, parts[1:], path, base_url, req)
        if route == "checkpoints" and method == "GET":
            cps = [c for r in self.store.list_runs() for c in self.store.list_checkpoints(r["training_run_id"])]
            cps.sort(key=lambda c: c["time"], reverse=True)
            return Reply.json({"checkpoints": cps, "cursor": {"offset": 0, "limit": len(cps), "total_count": len(cps)}})
        if route in ("create_custom_loss", "join_sampling_session", "retrieve_futures"):
            raise ApiError(404, f"{route} is not offered by runner serve (its client/config flags leave it off)")
        raise ApiError(404, f"no route {method} /api/v1/{route}")

    # ------------------------------------------------------------ sessions

    def _create_session(self, req: dict[str, Any]) -> Reply:
        sid = self.store.new_session_id(lambda: f"s{time.strftime('%Y%m%d')}-{secrets.token_hex(4)}")
        with self._lock:
            self._sessions[sid] = Session(sid)
        log.info("session %s started", sid)
        return Reply.json({"session_id": sid})

    def _session(self, sid: str) -> Session:
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:  # a session from before a restart: adopt it (its runs resume from disk)
                s = self._sessions[sid] = Session(sid)
            s.last_seen = time.monotonic()
            return s

    def _heartbeat(self, req: dict[str, Any]) -> Reply:
        self._session(req["session_id"])
        return Reply.json({})

    def _finish_session(self, sid: str) -> None:
        with self._lock:
            s = self._sessions.pop(sid, None)
            if s is None:
                return
            for rid in s.runs:
                self._runs.pop(rid, None)
            gone = [self._samplers.pop(x) for x in s.samplers if x in self._samplers]
        for sampler in gone:
            if sampler.source is not None and sampler.source.is_relative_to(self.store.ephemeral_dir):
                shutil.rmtree(sampler.source, ignore_errors=True)
        log.info("session %s ended: freed %d training and %d sampling clients", sid, len(s.runs), len(gone))

    # ------------------------------------------------------------ promises

    def _promise(self, route: str, extra: dict[str, Any] | None = None) -> tuple[Promise, Reply]:
        rid = f"req-{next(self._ids)}-{secrets.token_hex(3)}"
        p = Promise(route)
        with self._lock:
            self._promises[rid] = p
        return p, Reply.json({"request_id": rid, **(extra or {})})

    def _retrieve(self, req: dict[str, Any]) -> Reply:
        rid = req["request_id"]
        with self._lock:
            p = self._promises.get(rid)
        if p is None:  # unknown or expired: the SDK resubmits on 410
            raise ApiError(410, f"request {rid} is unknown or expired")
        try:
            return p.future.result(timeout=self.long_poll_s)
        except concurrent.futures.TimeoutError:
            return Reply.json({"type": "try_again", "request_id": rid, "queue_state": "active"})
        except concurrent.futures.CancelledError:
            return failed("cancelled", "user")

    def _cancel(self, req: dict[str, Any]) -> Reply:
        ids = req.get("request_ids") or [req.get("request_id")]
        for rid in [str(r) for r in ids if r]:
            with self._lock:
                p = self._promises.get(rid)
            if p is not None and p.route == "asample":  # training requests hold seq ids: never cancelled
                p.resolve(failed("cancelled by the client", "user"))
        return Reply.json({})

    # ------------------------------------------------------------ models and training

    def _served(self, name: str) -> ServedModel:
        m = self.models.get(name)
        if m is None:
            raise ApiError(400, f"model {name!r} is not served here; runner serve offers: {', '.join(self.models)} "
                                f"(serve another with --model {name}=PATH)")
        return m

    def _capabilities(self, req: dict[str, Any]) -> Reply:
        return Reply.json({"server_name": "runner-serve", "supported_models": [
            {"model_name": m.name, "trainable": True, "sampleable": True, "max_context_length": self._context(m)}
            for m in self.models.values()]})

    @staticmethod
    def _context(m: ServedModel) -> int | None:
        with contextlib.suppress(Exception):
            from backends.local import model as M

            cfg = json.loads((M.resolve_model_dir(m.path) / "config.json").read_text())
            return int(cfg.get("max_position_embeddings") or 0) or None
        return None

    def _new_run(self, run_id: str, model: ServedModel, spec: LoraSpec, tc: Future[Any], session_id: str,
                 user_metadata: dict[str, str] | None, source: str | None = None) -> Run:
        run = Run(run_id, model, spec, tc, session_id)
        self.store.write_run(run_id, {
            "training_run_id": run_id, "base_model": model.name, "model_owner": "runner-serve", "is_lora": True,
            "corrupted": False, "lora_rank": spec.rank, "last_request_time": iso(now()), "created": iso(now()),
            "user_metadata": user_metadata or None, "train_attn": spec.train_attn, "train_mlp": spec.train_mlp,
            "train_unembed": spec.train_unembed, "seed": spec.seed, "loaded_from": source})
        with self._lock:
            self._runs[run_id] = run
            self._session(session_id).runs.add(run_id)
        return run

    def _create_model(self, req: dict[str, Any]) -> Reply:
        model = self._served(req["base_model"])
        lora = req.get("lora_config") or {}
        opt = (req.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise ApiError(400, f"optimizer {opt!r} is not offered by runner serve (AdamW only)")
        rank = int(lora.get("rank", 32))
        if rank < 1:
            raise ApiError(400, f"lora rank must be >= 1, not {rank}")
        spec = LoraSpec(base_model=model.path, rank=rank, seed=lora.get("seed"),
                        train_attn=lora.get("train_attn", True), train_mlp=lora.get("train_mlp", True),
                        train_unembed=lora.get("train_unembed", True))
        run_id = f"{req['session_id']}:train:{req['model_seq_id']}"
        with self._lock:
            if run_id in self._runs or self.store.read_run(run_id) is not None:
                raise ApiError(400, f"training run {run_id} already exists")
        tc = model.engine().create_training_client(spec)
        self._new_run(run_id, model, spec, tc, req["session_id"], req.get("user_metadata"))
        log.info("run %s: %s, LoRA rank %d", run_id, model.name, rank)
        promise, reply = self._promise("create_model")
        deliver(promise, tc, lambda _: Reply.json({"model_id": run_id}))
        return reply

    def _run(self, run_id: str) -> Run:
        with self._lock:
            run = self._runs.get(run_id)
        if run is None:
            known = self.store.read_run(run_id) is not None
            raise ApiError(404, f"training run {run_id} is not loaded (its session ended; load a checkpoint of it with "
                                f"create_training_client_from_state)" if known else f"unknown training run {run_id}")
        return run

    def _get_info(self, req: dict[str, Any]) -> Reply:
        run = self._run(req["model_id"])
        return Reply.json({"model_id": run.run_id, "is_lora": True, "lora_rank": run.spec.rank,
                           "model_name": run.model.name,
                           "model_data": {"model_name": run.model.name, "arch": "runner-serve-local",
                                          "tokenizer_id": self.tokenizer_id(run.model)}})

    def tokenizer_id(self, m: ServedModel) -> str | None:
        """A folder AutoTokenizer.from_pretrained loads offline: the model's own, or (tiny) a copy of the
        embedded tokenizer saved under storage/tokenizers/."""
        with m.lock:
            if m.tokenizer_dir is None:
                from backends.local import model as M

                src = M.resolve_model_dir(m.path)
                if (src / "tokenizer_config.json").is_file() and m.path != "tiny":
                    m.tokenizer_dir = src
                else:
                    import transformers

                    dest = self.store.root / "tokenizers" / (hashlib.sha1(m.name.encode()).hexdigest()[:10])
                    if not (dest / "tokenizer_config.json").is_file():
                        transformers.AutoTokenizer.from_pretrained(src).save_pretrained(dest)
                    m.tokenizer_dir = dest
            return str(m.tokenizer_dir)

    def _parse_path(self, path: str) -> tuple[str, str, str]:
        """tinker://<run>/<kind>/<name> -> (run, kind, name); 404 when there is no such checkpoint."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS or not valid_name(parts[0]) or not valid_name(parts[2]):
            raise ApiError(400, f"{path!r} is not a checkpoint path (tinker://<run_id>/weights/<name>)")
        if self.store.checkpoint_meta(*parts) is None:
            raise ApiError(404, f"no checkpoint at {path} (never saved, deleted, or expired)")
        return parts[0], parts[1], parts[2]

    def _load_weights(self, req: dict[str, Any]) -> Reply:
        src_run, kind, name = self._parse_path(req["path"])
        if kind != "weights":
            raise ApiError(400, f"{req['path']} is a {KINDS[kind]} checkpoint; training state loads from "
                                f"tinker://<run_id>/weights/<name> (save_state)")
        meta = self.store.read_run(src_run)
        if meta is None:
            raise ApiError(404, f"no training run {src_run}")
        model = self._served(meta["base_model"])
        spec = LoraSpec(base_model=model.path, rank=int(meta["lora_rank"]), seed=meta.get("seed"),
                        train_attn=meta["train_attn"], train_mlp=meta["train_mlp"], train_unembed=meta["train_unembed"])
        run_id = f"{req['session_id']}:train:{req['model_seq_id']}"
        tc = model.engine().create_training_client_from_state(
            str(self.store.checkpoint_dir(src_run, kind, name)), spec, with_optimizer=bool(req.get("optimizer")))
        self._new_run(run_id, model, spec, tc, req["session_id"], meta.get("user_metadata"), req["path"])
        log.info("run %s: loaded %s%s", run_id, req["path"], " with optimizer state" if req.get("optimizer") else "")
        promise, reply = self._promise("load_weights")
        deliver(promise, tc, lambda _: Reply.json({"path": req["path"], "model_id": run_id}))
        return reply

    def _enqueue(self, run: Run, seq_id: int, promise: Promise,
                 op: Callable[[Any], tuple[Future[Any], Callable[[Any], Reply]]]) -> None:
        """Run op(training client) once every earlier seq_id of the run has been handed to it (its worker then
        executes them in that order)."""

        def go() -> None:
            if promise.future.done():
                return
            try:
                fut, to_reply = op(run.tc.result())
            except BaseException as exc:  # noqa: BLE001 - reported to the client as a failed request
                promise.resolve(_error_reply(exc))
                return
            deliver(promise, fut, to_reply)

        with self._lock:
            if seq_id < run.next_seq or seq_id in run.pending:
                raise ApiError(400, f"seq_id {seq_id} was already used for {run.run_id}")
            run.pending[seq_id] = go
        self._drain(run)

    def _drain(self, run: Run) -> None:
        if not run.tc.done():  # still being created; come back when it is
            run.tc.future().add_done_callback(lambda _: self._drain(run))
            return
        if run.tc.future().exception() is not None:
            with self._lock:
                jobs = list(run.pending.values())
                run.pending.clear()
            for job in jobs:  # each fails with the creation error
                job()
            return
        with self._lock:  # two threads draining at once must not hand over seq 2 before seq 1
            while (job := run.pending.pop(run.next_seq, None)) is not None:
                run.next_seq += 1
                job()

    def _forward_backward(self, headers: dict[str, str], body: bytes) -> Reply:
        msg = wire.decode_forward_backward(body, headers.get("content-encoding"))
        run = self._run(msg.model_id)
        route = "forward" if msg.forward_only else "forward_backward"
        promise, reply = self._promise(route)
        try:
            wds = [wire.decode_wire_datum(d) for d in msg.data]
            op: Callable[[Any], tuple[Future[Any], Callable[[Any], Reply]]] | None = self._loss_op(
                msg.loss_fn, wds, wire.loss_config(msg), msg.forward_only)
        except (ValueError, KeyError) as exc:
            promise.resolve(failed(str(exc)))
            op = None
        # A refused request spends its seq id all the same (later requests must not wait for it): its
        # promise is already resolved, so the op never runs.
        self._enqueue(run, msg.seq_id, promise, op or (lambda tc: (Future.completed(None), fb_reply)))
        return reply

    def _loss_op(self, loss_fn: str, wds: list[wire.WireDatum], cfg: dict[str, float | str], forward_only: bool
                 ) -> Callable[[Any], tuple[Future[Any], Callable[[Any], Reply]]]:
        if not wds:
            raise ValueError("no data")
        data = [w.datum for w in wds]
        if loss_fn in LOSS_FNS:
            numbers = {k: float(v) for k, v in cfg.items()}
            method = "forward" if forward_only else "forward_backward"
            return lambda tc: (getattr(tc, method)(data, loss_fn, numbers or None), fb_reply)
        if loss_fn not in extra_losses.EXTRA_LOSSES:
            raise ValueError(f"unknown loss_fn {loss_fn!r}; runner serve offers {', '.join([*LOSS_FNS, *extra_losses.EXTRA_LOSSES])} "
                             "(custom losses run on the client: forward_backward_custom)")
        conf = extra_losses.resolve(loss_fn, cfg)
        per_datum = [self._rl_inputs(loss_fn, w) for w in wds]
        fn = _custom_loss(loss_fn, per_datum, conf)
        if forward_only:
            probe = [dataclasses.replace(d, weights=np.zeros(d.target_tokens.shape, np.float32)) for d in data]

            def fwd(tc: Any) -> tuple[Future[Any], Callable[[Any], Reply]]:
                return tc.forward(probe, "cross_entropy"), lambda out: fb_reply(_forward_value(out, fn, data))

            return fwd
        return lambda tc: (tc.forward_backward_custom(data, fn), lambda out: fb_reply(_builtin_metrics(out)))

    def _rl_inputs(self, loss_fn: str, w: wire.WireDatum) -> dict[str, np.ndarray]:
        d = w.datum
        n = d.length
        if d.target_tokens.ndim != 1:
            raise ValueError(f"loss {loss_fn!r} needs 1-D target_tokens")
        if d.advantages is None:
            raise ValueError(f"loss {loss_fn!r} needs loss input 'advantages'")
        if loss_fn == "gspo":
            if d.logprobs is None:
                raise ValueError("loss 'gspo' needs loss input 'logprobs'")
            mask = w.extra.get("sequence_ratio_mask")
            if mask is None:
                raise ValueError("loss 'gspo' needs loss input 'sequence_ratio_mask'")
            return {"q": d.logprobs, "adv": d.advantages, "mask": mask.reshape(n)}
        # stable_reinforce: the sampler's logprobs come from the recorded sequences the spans name.
        if w.target_spans is None:
            raise ValueError("loss 'stable_reinforce' needs provenance on every datum (Datum.with_provenance) naming "
                             "sequences sampled with record_stability_info=True")
        q = np.zeros(n, np.float32) if d.logprobs is None else d.logprobs.copy()
        sampled = np.zeros(n, np.float32)
        pos = 0
        now_ = time.monotonic()
        for span in w.target_spans:
            if span.sampled:
                with self._lock:
                    rec = self._stability.get(span.sequence_id)
                    if rec is not None:
                        self._stability[span.sequence_id] = (rec[0], rec[1], now_)  # each use restarts its day
                if rec is None:
                    raise ValueError(f"sequence {span.sequence_id} has no stability record (sample with "
                                     "record_stability_info=True; records are kept one day)")
                tokens, lps, _ = rec
                end = span.offset + span.length
                if end > len(tokens) or pos + span.length > n:
                    raise ValueError(f"provenance span of {span.sequence_id} runs past its sequence or the datum")
                if not np.array_equal(tokens[span.offset:end], d.target_tokens[pos:pos + span.length]):
                    raise ValueError(f"datum targets do not match the tokens of sequence {span.sequence_id}")
                q[pos:pos + span.length] = lps[span.offset:end]
                sampled[pos:pos + span.length] = 1
            pos += span.length
        if pos != n:
            raise ValueError(f"provenance spans cover {pos} positions, the datum has {n}")
        return {"q": q, "adv": d.advantages, "sampled": sampled}

    def _optim_step(self, req: dict[str, Any]) -> Reply:
        run = self._run(req["model_id"])
        p = req.get("adam_params")
        if p is None:
            raise ApiError(400, "runner serve offers AdamW only (adam_params)")
        params = AdamParams(**{k: float(v) for k, v in p.items() if k in {f.name for f in dataclasses.fields(AdamParams)}})
        promise, reply = self._promise("optim_step")
        self._enqueue(run, int(req["seq_id"]), promise,
                      lambda tc: (tc.optim_step(params), lambda out: Reply.json({"metrics": out.metrics})))
        self._touch_run(run)
        return reply

    def _touch_run(self, run: Run) -> None:
        meta = self.store.read_run(run.run_id)
        if meta is not None:
            meta["last_request_time"] = iso(now())
            self.store.write_run(run.run_id, meta)

    def _save(self, req: dict[str, Any], kind: str) -> Reply:
        run = self._run(req["model_id"])
        seq_id = int(req["seq_id"])
        name = req.get("path")
        if name is None and kind == "sampler_weights":
            return self._ephemeral(run, seq_id, req)
        if name is None or not valid_name(name):
            raise ApiError(400, f"checkpoint name {name!r} must be a plain file name (no '/', not starting with '.')")
        ttl = req.get("ttl_seconds")
        if kind == "external_weights" and req.get("age_encryption_recipients"):
            # Encryption needs pyrage (optional: the cookbook's weights.download asks for it); checked now, so the
            # failure is immediate.
            if importlib.util.find_spec("pyrage") is None:
                raise ApiError(400, "age encryption needs the pyrage package on the server (pip install pyrage)")
        promise, reply = self._promise(f"save_{kind}")
        target = f"{run.run_id}/{kind}/{name}"
        path = self.store.checkpoint_dir(run.run_id, kind, name)
        tinker_path = f"tinker://{target}"

        def op(tc: Any) -> tuple[Future[Any], Callable[[Any], Reply]]:
            if path.exists():
                if not req.get("overwrite"):
                    raise UserError(f"checkpoint {tinker_path} already exists (save_state(..., overwrite=True) replaces it)")
                self.store.delete_checkpoint(run.run_id, kind, name)
            fut = tc.save_state(target) if kind == "weights" else tc.save_weights_for_sampler(target)

            def to_reply(_: Any) -> Reply:
                if kind == "external_weights" and req.get("age_encryption_recipients"):
                    _encrypt_folder(path, req["age_encryption_recipients"])
                meta = self.store.write_checkpoint_meta(run.run_id, kind, name, ttl, req.get("user_metadata"))
                out: dict[str, Any] = {"path": tinker_path}
                if kind == "external_weights":
                    out["size_bytes"] = meta["size_bytes"]
                return Reply.json(out)

            return fut, to_reply

        self._enqueue(run, seq_id, promise, op)
        return reply

    # ------------------------------------------------------------ sampling sessions

    def _ephemeral(self, run: Run, seq_id: int, req: dict[str, Any]) -> Reply:
        """save_weights_and_get_sampling_client: a sampler over the weights at this point of the sequence."""
        sid = f"{run.session_id}:sample:{req['sampling_session_seq_id']}"
        promise, reply = self._promise("save_weights_for_sampler")

        def op(tc: Any) -> tuple[Future[Any], Callable[[Any], Reply]]:
            client = tc.save_weights_and_get_sampling_client()
            weights = tc.trained_weights()  # the next job in the same FIFO: the same weights
            sess = SamplerSession(sid, run.model, run.session_id, None, client=client)
            step = getattr(tc, "step", 0)
            weights.future().add_done_callback(
                lambda f: setattr(sess, "weights", (f.result(), tc.setup, step)) if f.exception() is None else None)
            self._add_sampler(sess)
            return client, lambda _: Reply.json({"sampling_session_id": sid})

        self._enqueue(run, seq_id, promise, op)
        return reply

    def _add_sampler(self, sess: SamplerSession) -> None:
        with self._lock:
            self._samplers[sess.sampler_id] = sess
            self._session(sess.session_id).samplers.add(sess.sampler_id)
        self._evict(keep=sess.sampler_id)

    def _create_sampling_session(self, req: dict[str, Any]) -> Reply:
        sid = f"{req['session_id']}:sample:{req['sampling_session_seq_id']}"
        path = req.get("model_path")
        if path:
            run_id, kind, name = self._parse_path(path)
            meta = self.store.read_run(run_id)
            if meta is None:
                raise ApiError(404, f"no training run {run_id}")
            sess = SamplerSession(sid, self._served(meta["base_model"]), req["session_id"], path,
                                  source=self.store.checkpoint_dir(run_id, kind, name))
        else:
            sess = SamplerSession(sid, self._served(req["base_model"]), req["session_id"], None)
        self._add_sampler(sess)
        return Reply.json({"sampling_session_id": sid})

    def _sampler(self, sid: str) -> SamplerSession:
        with self._lock:
            s = self._samplers.get(sid)
        if s is None:
            raise ApiError(404, f"unknown sampling session {sid} (its session ended, or the server restarted: "
                                f"create a new sampling client)")
        return s

    def _client(self, sess: SamplerSession) -> Future[Any]:
        """The session's loaded sampling client, rebuilding it if it was freed."""
        with self._lock:
            sess.last_used = time.monotonic()
            if sess.client is not None and not (sess.client.done() and sess.client.future().exception()):
                return sess.client
            engine = sess.model.engine()
            if sess.source is None and sess.weights is not None:
                self._spill(sess)
            if sess.source is not None:
                client = engine.create_sampling_client(model_path=str(sess.source))
            else:
                client = engine.create_sampling_client(base_model=sess.model.path)
            sess.client = client
        self._evict(keep=sess.sampler_id)
        return client

    def _spill(self, sess: SamplerSession) -> None:
        """Write an in-memory snapshot to disk, so its model can be freed and rebuilt later."""
        from backends.local import model as M

        assert sess.weights is not None
        weights, setup, step = sess.weights
        dest = self.store.ephemeral_dir / sess.sampler_id
        dest.mkdir(parents=True, exist_ok=True)
        M.write_weights_only(dest, weights, setup, sess.model.engine().model_name, step)
        sess.source, sess.weights = dest, None

    def _evict(self, keep: str | None = None) -> None:
        """Free loaded samplers idle longer than sampler_idle_s, and the least recently used ones beyond
        max_live_samplers."""
        t = time.monotonic()
        with self._lock:
            live = sorted((s for s in self._samplers.values() if s.client is not None), key=lambda s: s.last_used)
            excess = len(live) - self.max_live_samplers
            victims = []
            for s in live:
                if s.sampler_id == keep or (s.client is not None and not s.client.done()):
                    continue
                if excess > 0 or t - s.last_used > self.sampler_idle_s:
                    victims.append(s)
                    excess -= 1
        for s in victims:
            with self._lock:
                if s.source is None and s.weights is None:
                    continue  # its snapshot is not in memory yet: keep the model
                if s.source is None:
                    self._spill(s)
                s.client = None
            log.debug("freed sampler %s", s.sampler_id)

    def _sample(self, req: dict[str, Any]) -> Reply:
        sess = self._sampler(req["sampling_session_id"])
        n = int(req.get("num_samples", 1))
        prompt = _prompt_tokens(req["prompt"])
        sp = req.get("sampling_params") or {}
        stop = sp.get("stop")
        params = SamplingParams(max_tokens=int(sp.get("max_tokens") or 64), temperature=float(sp.get("temperature", 1.0)),
                                top_p=float(sp.get("top_p", 1.0)), top_k=int(sp.get("top_k", -1)),
                                stop=[stop] if isinstance(stop, str) else stop, seed=sp.get("seed"))
        for unsupported in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
            if req.get(unsupported):
                raise ApiError(400, f"{unsupported} is not offered by runner serve")
        want_lps = bool(req.get("prompt_logprobs"))
        k_prompt = int(req.get("topk_prompt_logprobs") or 0)
        k_sample = int(req.get("topk_sample_logprobs") or 0)
        last_n = req.get("prompt_logprobs_last_n")
        record = bool(req.get("record_stability_info"))
        seq_ids = [f"{sess.sampler_id}:seq:{next(self._ids)}" for _ in range(n)]
        promise, reply = self._promise("asample", {"sample_sequence_ids": seq_ids})
        client = self._client(sess)

        def run(sc: Any) -> None:
            sample = sc.sample(prompt, n, params)
            lps = sc.compute_logprobs(prompt) if want_lps else None
            lock, finished = threading.Lock(), []

            def finish(_: Any) -> None:
                if not sample.done() or (lps is not None and not lps.done()):
                    return  # the other one calls again
                with lock:
                    if finished:
                        return
                    finished.append(True)
                try:
                    out = sample.result()
                    prompt_lps = lps.result() if lps is not None else None
                except BaseException as exc:  # noqa: BLE001
                    promise.resolve(_error_reply(exc))
                    return
                if record:
                    self._record(seq_ids, out)
                if k_prompt or k_sample:  # one more forward pass, off the sampler's thread
                    self._extras.submit(self._with_topk, promise, sc, prompt, out, prompt_lps, k_prompt, k_sample,
                                        params.temperature, last_n)
                    return
                promise.resolve(Reply(200, wire.sample_proto(out, _last_n(prompt_lps, last_n)), dict(wire.PROTO)))

            sample.future().add_done_callback(finish)
            if lps is not None:
                lps.future().add_done_callback(finish)

        def start(f: concurrent.futures.Future[Any]) -> None:
            if f.exception() is not None:
                promise.resolve(_error_reply(f.exception()))  # type: ignore[arg-type]
                return
            try:
                run(f.result())
            except BaseException as exc:  # noqa: BLE001
                promise.resolve(_error_reply(exc))

        # Requests for one session reach the sampler together, so it decodes them as one batch (see _Gather).
        self._gather.add(sess.sampler_id, lambda: client.future().add_done_callback(start))
        return reply

    def _with_topk(self, promise: Promise, sc: Any, prompt: list[int], out: Any, prompt_lps: Any, k_prompt: int,
                   k_sample: int, temperature: float, last_n: int | None) -> None:
        try:
            from backends.serve.topk import topk_logprobs

            topk_prompt = None
            if k_prompt:
                ids, lps = topk_logprobs(sc.model, prompt, k_prompt, 1.0, range(1, len(prompt)))
                pad_ids, pad_lps = np.zeros((1, k_prompt), np.int32), np.full((1, k_prompt), wire.TOPK_EMPTY[1], np.float32)
                ids, lps = np.concatenate([pad_ids, ids]), np.concatenate([pad_lps, lps])
                if last_n:
                    ids[: len(prompt) - int(last_n)] = 0
                    lps[: len(prompt) - int(last_n)] = wire.TOPK_EMPTY[1]
                topk_prompt = (ids, lps)
            topk_sampled = None
            if k_sample:
                topk_sampled = []
                for s in out.sequences:
                    full = [*prompt, *s.tokens]
                    topk_sampled.append(topk_logprobs(sc.model, full, k_sample, temperature,
                                                      range(len(prompt), len(full))))
            promise.resolve(Reply(200, wire.sample_proto(out, _last_n(prompt_lps, last_n), topk_prompt, topk_sampled),
                                  dict(wire.PROTO)))
        except BaseException as exc:  # noqa: BLE001
            promise.resolve(_error_reply(exc))

    def _record(self, seq_ids: list[str], out: Any) -> None:
        t = time.monotonic()
        with self._lock:
            for sid, s in zip(seq_ids, out.sequences, strict=True):
                self._stability[sid] = (np.asarray(s.tokens, np.int64), np.asarray(s.logprobs, np.float32), t)
            while len(self._stability) > STABILITY_MAX:
                self._stability.popitem(last=False)

    # ------------------------------------------------------------ REST: runs, checkpoints, weights

    def _run_view(self, meta: dict[str, Any]) -> dict[str, Any]:
        cps = self.store.list_checkpoints(meta["training_run_id"])
        last = {t: next((c for c in reversed(cps) if c["checkpoint_type"] == t), None) for t in ("training", "sampler")}
        keys = ("training_run_id", "base_model", "model_owner", "is_lora", "corrupted", "lora_rank",
                "last_request_time", "user_metadata")
        return {**{k: meta.get(k) for k in keys}, "last_checkpoint": last["training"],
                "last_sampler_checkpoint": last["sampler"]}

    def _training_runs(self, method: str, parts: list[str], path: str, base_url: str, req: dict[str, Any]) -> Reply:
        if not parts:
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
            limit = int(query.get("limit", ["20"])[0])
            offset = int(query.get("offset", ["0"])[0])
            runs = self.store.list_runs()
            page = [self._run_view(r) for r in runs[offset:offset + limit]]
            return Reply.json({"training_runs": page, "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}})
        run_id = parts[0]
        meta = self.store.read_run(run_id)
        if meta is None:
            raise ApiError(404, f"unknown training run {run_id}")
        if len(parts) == 1:
            return Reply.json(self._run_view(meta))
        if parts[1] != "checkpoints":
            raise ApiError(404, f"no route {method} training_runs/{'/'.join(parts)}")
        if len(parts) == 2:
            return Reply.json({"checkpoints": self.store.list_checkpoints(run_id)})
        if len(parts) < 4 or parts[2] not in KINDS:
            raise ApiError(404, f"no checkpoint {'/'.join(parts[2:])} in {run_id}")
        kind, name, action = parts[2], parts[3], "/".join(parts[4:])
        if self.store.checkpoint_meta(run_id, kind, name) is None:
            raise ApiError(404, f"no checkpoint tinker://{run_id}/{kind}/{name}")
        if action == "" and method == "DELETE":
            self.store.delete_checkpoint(run_id, kind, name)
            log.info("deleted tinker://%s/%s/%s", run_id, kind, name)
            return Reply.json({})
        if action == "" and method == "GET":
            return Reply.json(self.store.checkpoint_meta(run_id, kind, name))
        if action == "ttl" and method == "PUT":
            ttl = req.get("ttl_seconds")
            self.store.set_ttl(run_id, kind, name, int(ttl) if ttl else None)
            return Reply.json({})
        if action == "external_weights_urls" and method == "GET":
            if kind != "external_weights":
                raise ApiError(400, "download URLs exist for external_weights checkpoints only")
            return self._download_urls(run_id, kind, name, base_url)
        if action == "publish":
            raise ApiError(400, "runner serve has no public checkpoints")
        raise ApiError(404, f"no route {method} training_runs/{'/'.join(parts)}")

    def _download_urls(self, run_id: str, kind: str, name: str, base_url: str) -> Reply:
        root = self.store.checkpoint_dir(run_id, kind, name)
        expires = int(time.time()) + DOWNLOAD_URL_TTL_S
        urls = {}
        for f in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = f.relative_to(root).as_posix()
            target = f"{run_id}/{kind}/{name}/{rel}"
            sig = self._sign(target, expires)
            urls[rel] = f"{base_url}/api/v1/files/{urllib.parse.quote(target)}?expires={expires}&sig={sig}"
        exp = iso(now().fromtimestamp(expires, now().tzinfo))
        return Reply.json({"urls": urls, "expires": exp})

    def _sign(self, target: str, expires: int) -> str:
        mac = hmac.new(self._secret, f"{target}\n{expires}".encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).decode().rstrip("=")

    def _download(self, route: str, path: str) -> Reply:
        target = urllib.parse.unquote(route.removeprefix("files/"))
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
        try:
            expires = int(query["expires"][0])
            sig = query["sig"][0]
        except (KeyError, ValueError):
            return Reply.json({"detail": "unsigned download URL"}, 403)
        if expires < time.time() or not hmac.compare_digest(sig, self._sign(target, expires)):
            return Reply.json({"detail": "download URL expired or invalid"}, 403)
        parts = target.split("/", 3)
        if len(parts) != 4:
            return Reply.json({"detail": "not found"}, 404)
        root = self.store.checkpoint_dir(parts[0], parts[1], parts[2])
        f = (root / parts[3]).resolve()
        if not f.is_relative_to(root) or not f.is_file():
            return Reply.json({"detail": "not found"}, 404)
        return Reply(200, b"", {"content-type": "application/octet-stream"}, file=f)

    def _weights_info(self, req: dict[str, Any]) -> Reply:
        run_id, _, _ = self._parse_path(req["tinker_path"])
        meta = self.store.read_run(run_id)
        if meta is None:
            raise ApiError(404, f"no training run {run_id}")
        return Reply.json({"base_model": meta["base_model"], "is_lora": True, "lora_rank": meta["lora_rank"],
                           "train_unembed": meta["train_unembed"], "train_mlp": meta["train_mlp"],
                           "train_attn": meta["train_attn"]})

    def _copy_weights(self, req: dict[str, Any]) -> Reply:
        src_run, kind, name = self._parse_path(req["source_path"])
        if req.get("session_id") is None or req.get("model_seq_id") is None:
            raise ApiError(400, "runner serve has no projects: copy_weights needs session_id and model_seq_id")
        meta = self.store.read_run(src_run)
        assert meta is not None
        run_id = f"{req['session_id']}:train:{req['model_seq_id']}"
        if self.store.read_run(run_id) is None:
            self.store.write_run(run_id, {**meta, "training_run_id": run_id, "created": iso(now()),
                                          "last_request_time": iso(now()), "loaded_from": req["source_path"]})
        dest = self.store.checkpoint_dir(run_id, kind, name)
        if dest.exists():
            raise ApiError(400, f"tinker://{run_id}/{kind}/{name} already exists")
        shutil.copytree(self.store.checkpoint_dir(src_run, kind, name), dest)
        self.store.write_checkpoint_meta(run_id, kind, name, req.get("ttl_seconds"), None)
        return Reply.json({"tinker_path": f"tinker://{run_id}/{kind}/{name}"})

    # ------------------------------------------------------------ housekeeping

    def _reap_loop(self) -> None:
        last_expire = 0.0
        while not self._stop.wait(REAP_EVERY_S):
            try:
                self.reap()
                if time.monotonic() - last_expire > 30:
                    last_expire = time.monotonic()
                    for p in self.store.expire():
                        log.info("checkpoint %s expired (ttl_seconds) and was deleted", p)
            except Exception:  # housekeeping must never stop
                log.exception("housekeeping failed")

    def reap(self) -> None:
        """Free idle samplers, forget old results and stability records, end silent sessions."""
        self._evict()
        _trim_heap()
        t = time.monotonic()
        with self._lock:
            for rid in [r for r, p in self._promises.items() if p.done_at is not None and t - p.done_at > PROMISE_KEEP_S]:
                del self._promises[rid]
            while self._stability and t - next(iter(self._stability.values()))[2] > STABILITY_TTL_S:
                self._stability.popitem(last=False)
            silent = [s.session_id for s in self._sessions.values() if t - s.last_seen > self.session_timeout_s]
        for sid in silent:
            log.info("session %s sent no heartbeat for %.0f s", sid, self.session_timeout_s)
            self._finish_session(sid)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"sessions": len(self._sessions), "runs": len(self._runs), "samplers": len(self._samplers),
                    "live_samplers": sum(s.client is not None for s in self._samplers.values()),
                    "promises": len(self._promises), "stability_records": len(self._stability)}


# ---------------------------------------------------------------- helpers


_libc: list[Any] = []


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise, so RSS would not show models freed)."""
    if not _libc:
        import ctypes
        import ctypes.util

        try:
            _libc.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim)
        except (OSError, AttributeError):
            _libc.append(None)
    if _libc[0] is not None:
        _libc[0](0)


class _Gather:
    """Holds a sampling session's requests while more keep arriving (at most GAP_S apart, for at most MAX_S),
    then submits them back to back. A program's concurrent sample calls (an RL step's groups) reach the server
    a few ms apart over HTTP, while the local sampler batches only what is queued within ~2 ms
    (backends/local/worker.py): submitted as they came, the first ran alone and the rest waited for it
    (rl_basic over HTTP: sampling took 3.2x as long as in process)."""

    GAP_S = 0.004
    MAX_S = 0.02

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: dict[str, tuple[float, float, list[Callable[[], None]]]] = {}  # key -> (first, last, jobs)
        self._closed = False
        threading.Thread(target=self._loop, name="serve-gather", daemon=True).start()

    def add(self, key: str, job: Callable[[], None]) -> None:
        t = time.monotonic()
        with self._cond:
            first, _, jobs = self._pending.get(key, (t, t, []))
            jobs.append(job)
            self._pending[key] = (first, t, jobs)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    t = time.monotonic()
                    due = {k: min(first + self.MAX_S, last + self.GAP_S) for k, (first, last, _) in self._pending.items()}
                    ready = [k for k, d in due.items() if d <= t]
                    if ready:
                        batches = [self._pending.pop(k)[2] for k in ready]
                        break
                    self._cond.wait(min(due.values()) - t if due else None)
            for jobs in batches:
                for job in jobs:
                    try:
                        job()
                    except Exception:  # a job reports its own errors; this thread must live
                        log.exception("sampling dispatch failed")


def fb_reply(out: ForwardBackwardOutput) -> Reply:
    return Reply(200, wire.fb_proto(out), dict(wire.PROTO))


def _builtin_metrics(out: ForwardBackwardOutput) -> ForwardBackwardOutput:
    """A built-in loss run through the custom path reports like the others: loss:sum only."""
    return ForwardBackwardOutput(out.logprobs, {k: v for k, v in out.metrics.items() if k != "surrogate_loss:sum"})


def _custom_loss(loss_fn: str, per_datum: list[dict[str, np.ndarray]], conf: dict[str, float]) -> Callable[..., Any]:
    import torch

    def fn(data: list[Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
        total = torch.zeros((), dtype=torch.float32)
        for lp, x in zip(logprobs, per_datum, strict=True):
            t = {k: torch.as_tensor(v, dtype=lp.dtype) for k, v in x.items()}
            if loss_fn == "gspo":
                total = total + extra_losses.gspo(lp, t["q"], t["adv"], t["mask"], conf)
            else:
                total = total + extra_losses.stable_reinforce(lp, t["q"], t["adv"], t["sampled"], conf)
        return total, {}

    return fn


def _forward_value(out: ForwardBackwardOutput, fn: Callable[..., Any], data: list[Datum]) -> ForwardBackwardOutput:
    import torch

    with torch.no_grad():
        loss, _ = fn(data, [torch.as_tensor(lp) for lp in out.logprobs])
    return ForwardBackwardOutput(out.logprobs, {"loss:sum": float(loss)})


def _prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for c in prompt.get("chunks", []):
        if c.get("type", "encoded_text") != "encoded_text":
            raise ApiError(400, f"prompt chunks of type {c.get('type')!r} are not supported (text tokens only)")
        tokens.extend(int(t) for t in c["tokens"])
    return tokens


def _last_n(lps: list[float | None] | None, last_n: int | None) -> list[float | None] | None:
    if lps is None or not last_n:
        return lps
    cut = max(0, len(lps) - int(last_n))
    return [None] * cut + lps[cut:]


def _encrypt_folder(path: Path, recipients: list[str]) -> None:
    """age-encrypt every file of an export in place (name + '.age'), as the service does for
    save_weights_external(age_encryption_recipients=...)."""
    import importlib

    pyrage: Any = importlib.import_module("pyrage")  # optional; ships no type information
    keys = []
    for r in recipients:
        keys.append(pyrage.ssh.Recipient.from_str(r) if r.startswith("ssh-") else pyrage.x25519.Recipient.from_str(r))
    for f in [p for p in path.rglob("*") if p.is_file()]:
        f.with_name(f.name + ".age").write_bytes(pyrage.encrypt(f.read_bytes(), keys))
        f.unlink()
