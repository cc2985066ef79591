"""The Tinker service's HTTP API (docs/serve.md, docs/tinker-offline.md) over the local backend: what `runner serve` runs.

`Service.handle(method, path, headers, body) -> Reply` is the whole API, independent of the HTTP server
(backends/serve/http.py). What it promises, as the hosted service does:
- submits answer at once with a promise; `retrieve_future` long-polls (holds the request until the result is
  ready, up to LONG_POLL_S, under the SDK's 45 s read timeout) and only then says try_again;
- a model's requests run strictly in seq_id order, whatever order they arrive in, and a refused request
  spends its seq_id (backends/serve/sessions.py);
- results are protobuf for forward_backward and sample, JSON otherwise; a request the engine refuses is a
  failed future with category "user" and the reason; a malformed request is a 4xx with a reason
  (backends/serve/limits.py), never a dropped connection;
- training runs and checkpoints live on disk (backends/serve/store.py): a restarted server lists, loads and
  resumes them, and session (hence run) ids never repeat; checkpoint ttl_seconds are honoured on every access;
- memory is bounded: live training runs and the bytes they, the base models and in-flight sampling hold are
  capped (backends/serve/memory.py: a new run over a cap is a 4xx naming it; a sampling request's bytes are
  reserved before it runs); the sampler pool (backends/serve/samplers.py) keeps few models loaded, sampling work in
  flight is capped (limits.Budget), and finished or silent sessions (no heartbeat for SESSION_TIMEOUT_S)
  free their clients (the reaper thread).

The routes live by job: training.py (models, FIFO ops, saves, loads), sampling.py, rest.py (runs,
checkpoints, weights), downloads.py (signed URLs), adapters.py (loss adapters).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hmac
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable

from backends.errors import UserError
from backends.serve.adapters import Stability
from backends.serve.downloads import Downloads
from backends.serve.limits import Budget, Fields, Limits, check_id, json_depth_ok
from backends.serve.memory import Memory, default_max_bytes
from backends.serve.openai_api import OpenAIRoutes
from backends.serve.replies import ApiError, Promises, Reply
from backends.serve.rest import RestRoutes
from backends.serve.samplers import MAX_LIVE_SAMPLERS, SAMPLER_IDLE_S, Gather, SamplerPool, trim_heap
from backends.serve.sampling import SamplingRoutes
from backends.serve.sessions import Run, ServedModel, Session
from backends.serve.store import Store
from backends.serve.training import TrainingRoutes
from backends.types import Json

log = logging.getLogger("runner.serve")

LONG_POLL_S = 30.0  # the SDK reads retrieve_future with a 45 s timeout
SESSION_TIMEOUT_S = 600.0  # the SDK heartbeats every 10 s; a session silent this long is gone
REAP_EVERY_S = 1.0
EXPIRE_EVERY_S = 30.0  # the sweep that deletes expired checkpoints nobody asked for
IDEMPOTENCY_KEYS = 20_000  # submits remembered by X-Idempotency-Key
# Routes whose JSON body names a training run's seq_id: refused, they still spend it.
SEQ_ROUTES = frozenset({"optim_step", "save_weights", "save_weights_for_sampler", "save_weights_external",
                        "load_weights"})
GET_OK = frozenset({"healthz", "get_server_capabilities"})  # also answered to POST
# Routes `handle` answers without waiting on anything (no disk, no model, no long-poll): the HTTP layer runs them on
# its event loop (`inline`), as a hand-off to a worker thread and back costs up to two of the interpreter's 5 ms GIL
# switch intervals while the sampler computes (measured: 19 ms per healthz beside a busy thread, 7 ms in place).
# (optim_step is not one: it rewrites its run's metadata file.)
INLINE = frozenset({"healthz", "session_heartbeat", "telemetry", "client/config", "client/dynamic_config"})


class Service(TrainingRoutes, SamplingRoutes, RestRoutes):
    def __init__(self, store: Store, models: dict[str, ServedModel], api_key: str | None = None,
                 long_poll_s: float = LONG_POLL_S, sampler_idle_s: float = SAMPLER_IDLE_S,
                 max_live_samplers: int = MAX_LIVE_SAMPLERS, session_timeout_s: float = SESSION_TIMEOUT_S,
                 limits: Limits | None = None):
        self.store = store
        self.models = models
        self.api_key = api_key
        self.limits = limits or Limits()
        self.session_timeout_s = session_timeout_s
        self.promises = Promises(long_poll_s)
        self.pool = SamplerPool(store.ephemeral_dir, sampler_idle_s, max_live_samplers)
        self.stability = Stability()
        self.downloads = Downloads(store)
        self.memory = Memory(self.limits.max_models, self.limits.max_bytes or default_max_bytes())
        self.budget = Budget(self.limits.max_live_tokens, self.memory, self.limits.max_sample_wait_s)
        self.gather = Gather()
        self.openai = OpenAIRoutes(self)  # /v1/...: OpenAI-compatible (its own auth and error shape)
        self._lock = threading.RLock()
        self._runs: dict[str, Run] = {}
        self._sessions: dict[str, Session] = {}
        self._idempotent: collections.OrderedDict[str, Reply] = collections.OrderedDict()
        self._extras = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="serve-extras")
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="serve-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        self.gather.close()
        self._extras.shutdown(wait=False, cancel_futures=True)
        for m in self.models.values():
            if m.backend is not None:
                m.backend.close()

    # ------------------------------------------------------------ dispatch

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes, base_url: str = "",
               gone: Callable[[], bool] | None = None) -> Reply:
        """One request. Blocks only in retrieve_future's long-poll and a /v1 request's sampling. Never raises: every
        failure is a reply. `gone()` tells whether the client hung up (a /v1 request then stops its work and
        answers Reply.GONE, which the HTTP layer does not send)."""
        try:
            return self._dispatch(method, path, headers, body, base_url, gone)
        except ApiError as exc:
            return exc.reply()
        except Exception as exc:  # a bug of ours: say so, and keep serving
            log.exception("error handling %s %s", method, path[:200])
            return Reply.error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")

    def inline(self, method: str, path: str, body: bytes) -> bool:
        """Whether `handle` answers this request without blocking (INLINE, and a sample request whose sampler is
        loaded): the HTTP layer then runs it on its event loop."""
        route = _route(path)
        if route in INLINE:
            return True
        if route != "asample" or method != "POST":
            return False
        try:
            sid = json.loads(body).get("sampling_session_id")
        except (ValueError, AttributeError, RecursionError):  # handle() says what is wrong with it
            return False
        found = self.pool.find([sid]) if isinstance(sid, str) else []
        return bool(found) and self.pool.loaded(found[0])

    def pending(self, method: str, path: str, headers: dict[str, str], body: bytes
                ) -> tuple[concurrent.futures.Future[Reply], float, Reply] | None:
        """A retrieve_future whose result is not ready yet: (its future, how long to wait for it, the reply when that
        wait ends first), for the HTTP layer to wait on without a thread. None: `handle` answers it at once."""
        if method != "POST" or _route(path) != "retrieve_future" or not self._authorized("retrieve_future", headers):
            return None
        try:
            rid = json.loads(body).get("request_id") if len(body) <= self.limits.max_body_bytes else None
        except (ValueError, AttributeError, RecursionError):  # handle() says what is wrong with it
            return None
        p = self.promises.find(rid) if isinstance(rid, str) else None
        if p is None or p.done():
            return None
        return p.future, self.promises.long_poll_s, self.promises.try_again(str(rid))

    def _authorized(self, route: str, headers: dict[str, str]) -> bool:
        return (self.api_key is None or route == "healthz"
                or hmac.compare_digest(headers.get("x-api-key", "").encode(), self.api_key.encode()))

    def _dispatch(self, method: str, path: str, headers: dict[str, str], body: bytes, base_url: str,
                  gone: Callable[[], bool] | None = None) -> Reply:
        route = _route(path)
        if route.startswith("files/"):  # signed download URLs carry their own authorisation
            return self.downloads.serve(route, path) if method == "GET" else Reply.error(405, "downloads are GET")
        if route == "v1" or route.startswith("v1/"):
            return self.openai.handle(method, route, headers, body, gone)
        if not self._authorized(route, headers):
            return Reply.error(401, "invalid API key")
        if len(body) > self.limits.max_body_bytes:
            raise ApiError(413, f"request body is {len(body)} bytes; at most {self.limits.max_body_bytes}")
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
        req: object = None  # the body, once parsed
        try:
            if route == "forward_backward":
                if method != "POST":
                    raise ApiError(405, "forward_backward is POST")
                return self._forward_backward(headers, body)
            if body and not json_depth_ok(body, self.limits.max_json_depth):
                raise ApiError(400, f"JSON nested deeper than {self.limits.max_json_depth} levels")
            req = json.loads(body) if body else {}
            if not isinstance(req, dict):
                raise ApiError(400, f"the request body must be a JSON object, not {type(req).__name__}")
            return self._route(method, route, req, path, base_url)
        except Exception as exc:
            if route in SEQ_ROUTES and isinstance(req, dict):
                self._spend(req)
            if not isinstance(exc, (ApiError, ValueError, KeyError, TypeError, UserError, RecursionError)):
                raise  # ours: a 500 (handle)
            if isinstance(exc, ApiError):
                return exc.reply()
            detail = "invalid JSON" if isinstance(exc, json.JSONDecodeError) else str(exc)[:300]
            return Reply.error(400, f"bad request: {type(exc).__name__}: {detail}")

    def _spend(self, req: Json) -> None:
        """A refused request that named a run's seq_id: later requests of that run must not wait for it."""
        model_id, seq_id = req.get("model_id"), req.get("seq_id")
        if isinstance(model_id, str):
            with self._lock:
                run = self._runs.get(model_id)
            if run is not None:
                run.spend(seq_id)

    def _route(self, method: str, route: str, req: Json, path: str, base_url: str) -> Reply:
        f = Fields(req, self.limits)
        simple: dict[str, Callable[[Fields], Reply]] = {
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
            "retrieve_future": lambda r: self.promises.retrieve(r.id("request_id")),
            "cancel_future": self._cancel,
            "weights_info": self._weights_info,
            "copy_weights": self._copy_weights,
        }
        if route in simple:
            if method != "POST" and not (method == "GET" and route in GET_OK):
                raise ApiError(405, f"{route} takes POST, not {method}")
            return simple[route](f)
        parts = route.split("/")
        if parts[0] == "sessions" and len(parts) == 3 and parts[2] == "finish" and method == "POST":
            check_id("session id", parts[1], self.limits)
            self._finish_session(parts[1])
            return Reply.json({})
        if parts[0] == "samplers" and len(parts) == 2 and method == "GET":
            s = self.pool.get(parts[1])
            return Reply.json({"sampler_id": s.sampler_id, "base_model": s.model.name, "model_path": s.model_path})
        if parts[0] == "training_runs":
            return self._training_runs(method, parts[1:], path, base_url, f)
        if route == "checkpoints" and method == "GET":
            return self._all_checkpoints()
        if route in ("create_custom_loss", "join_sampling_session", "retrieve_futures"):
            raise ApiError(404, f"{route} is not offered by runner serve (its client/config flags leave it off)")
        raise ApiError(404, f"no route {method} /api/v1/{route[:100]}")

    # ------------------------------------------------------------ sessions

    def _create_session(self, f: Fields) -> Reply:
        f.metadata()
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

    def _heartbeat(self, f: Fields) -> Reply:
        self._session(f.id("session_id"))
        return Reply.json({})

    def _finish_session(self, sid: str) -> None:
        with self._lock:
            s = self._sessions.pop(sid, None)
            if s is None:
                return
            for rid in s.runs:
                self._runs.pop(rid, None)
                self.memory.release(f"run:{rid}")
        self.budget.pump()  # sampling requests waiting for the bytes those runs held
        freed = self.pool.remove(s.samplers)
        log.info("session %s ended: freed %d training and %d sampling clients", sid, len(s.runs), freed)

    def _cancel(self, f: Fields) -> Reply:
        ids = f.req.get("request_ids")
        if ids is None:
            ids = [f.id("request_id")]
        if not isinstance(ids, list) or not all(isinstance(r, str) for r in ids):
            raise ApiError(400, "request_ids must be a list of request ids")
        self.promises.cancel(ids)
        return Reply.json({})

    # ------------------------------------------------------------ housekeeping

    def _reap_loop(self) -> None:
        last_expire = 0.0
        while not self._stop.wait(REAP_EVERY_S):
            try:
                self.reap()
                if time.monotonic() - last_expire > EXPIRE_EVERY_S:
                    last_expire = time.monotonic()
                    for p in self.store.expire():
                        log.info("checkpoint %s expired (ttl_seconds) and was deleted", p)
            except Exception:  # housekeeping must never stop
                log.exception("housekeeping failed")

    def reap(self) -> None:
        """Free idle samplers, forget old results and stability records, end silent sessions."""
        self.pool.evict()
        trim_heap()
        t = time.monotonic()
        self.budget.expire(t)
        self.promises.forget_old(t)
        self.stability.forget_old(t)
        with self._lock:
            silent = [s.session_id for s in self._sessions.values() if t - s.last_seen > self.session_timeout_s]
        for sid in silent:
            log.info("session %s sent no heartbeat for %.0f s", sid, self.session_timeout_s)
            self._finish_session(sid)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {"sessions": len(self._sessions), "runs": len(self._runs)}
        return {**out, **self.pool.stats(), "promises": len(self.promises), "stability_records": len(self.stability),
                "live_sample_tokens": self.budget.used, "waiting_samples": self.budget.waiting(),
                "held_bytes": self.memory.used, "sampling_bytes": self.memory.sampling, "max_bytes": self.memory.max_bytes}


def _route(path: str) -> str:
    return path.split("?", 1)[0].removeprefix("/api/v1/").strip("/")
