"""A plausible Tinker service for offline tests of the real `tinker` SDK (0.38).

`MockTinker(engine)` answers the SDK's HTTP routes (tinker-sdk.md §4.3) the way the service does:
submits return promises, `retrieve_future` long-polls and sometimes answers `try_again` first,
forward/backward and sample results are protobuf, a model's requests execute strictly in seq_id order
(out-of-order arrivals wait for the gap to fill), and every request is recorded. The compute is an
ENGINE: any object with our backend protocol's methods (backends/base.py), so the same service can
run on `NumpyEngine` (a bigram table, instant) or on `backends.local.LocalBackend` (the tiny model,
whose losses really fall). `respx_tinker(mock)` mounts it under respx; tests/tinker_server.py serves
it over real HTTP.

Faults (`mock.faults`) are consumed one request at a time: status bursts the SDK rides out (5xx, 429),
a 4xx rejection, a failed future (`{"error", "category"}`), dropped connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import respx
from tinker.proto import tinker_public_pb2 as pb

from backends import losses
from backends.base import Future
from backends.serve.wire import PROTO, decode_datum, fb_proto, sample_proto
from backends.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepOutput,
    SampledSequence,
    SampleOutput,
    SamplingParams,
)

BASE_URL = "http://tinker.test"
SESSION = "sess-mock"
# How long retrieve_future holds a poll open while the result is not ready (the service long-polls;
# the SDK re-polls at once on try_again, so a short hold keeps it from spinning).
LONG_POLL_S = 0.1


# ---------------------------------------------------------------- a numpy engine


class NumpyEngine:
    """A bigram language model in numpy: logits(next | prev) = b + W[prev]. Enough to make losses fall,
    samples depend on the prompt, and checkpoints matter. Same method names as our Backend."""

    def __init__(self, vocab_size: int = 259, eos_id: int = 258, decode: Callable[[list[int]], str] | None = None):
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.decode = decode
        self._saved: dict[str, dict[str, Any]] = {}
        self._n = itertools.count()

    def base_params(self, base_model: str) -> dict[str, np.ndarray]:
        # The "pretrained" weights depend on the model name only, so every client of a base model agrees.
        rng = np.random.default_rng(zlib.crc32(base_model.encode()))
        v = self.vocab_size
        return {"b": rng.normal(0, 0.5, v).astype(np.float64), "W": rng.normal(0, 0.5, (v, v)).astype(np.float64)}

    def create_training_client(self, spec: LoraSpec) -> Future[NumpyTrainer]:
        return Future.completed(NumpyTrainer(self, spec, self.base_params(spec.base_model)))

    def create_training_client_from_state(self, path: str, spec: LoraSpec, with_optimizer: bool = True) -> Future[NumpyTrainer]:
        saved = self._saved[path]
        tc = NumpyTrainer(self, saved["spec"], {k: v.copy() for k, v in saved["params"].items()})
        if with_optimizer:
            tc.step, tc.m, tc.v = saved["step"], {k: x.copy() for k, x in saved["m"].items()}, {
                k: x.copy() for k, x in saved["v"].items()}
        return Future.completed(tc)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> Future[NumpySampler]:
        params = self._saved[model_path]["params"] if model_path else self.base_params(str(base_model))
        return Future.completed(NumpySampler(self, params))

    def save(self, trainer: NumpyTrainer, name: str) -> str:
        path = f"numpy://{next(self._n)}/{name}"
        self._saved[path] = {"spec": trainer.spec, "params": {k: v.copy() for k, v in trainer.params.items()},
                             "step": trainer.step, "m": {k: x.copy() for k, x in trainer.m.items()},
                             "v": {k: x.copy() for k, x in trainer.v.items()}}
        return path


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _loss_coef(loss_fn: str, lp: np.ndarray, d: Datum, cfg: dict[str, float]) -> tuple[float, np.ndarray]:
    """(summed loss, dLoss/dlp per target): the loss registry's function (backends/losses.py, tinker-sdk.md §3),
    differentiated by autograd, so a loss added there is served here too. Tinker has no mask; no weights = 0."""
    import torch

    spec = losses.get(loss_fn)
    config = spec.resolve(cfg)

    def t(x: np.ndarray | None) -> torch.Tensor | None:
        return None if x is None else torch.as_tensor(np.asarray(x, np.float64))

    weights = d.weights if d.weights is not None or "weights" not in spec.inputs else np.zeros(lp.shape)
    lp_t = torch.tensor(np.asarray(lp, np.float64), requires_grad=True)
    loss = spec.masked_sum(lp_t, losses.LossInputs(t(weights), t(d.logprobs), t(d.advantages)), config)
    (g,) = torch.autograd.grad(loss, lp_t, allow_unused=True)
    return float(loss.detach()), np.zeros(lp.shape) if g is None else g.numpy()


class NumpyTrainer:
    def __init__(self, engine: NumpyEngine, spec: LoraSpec, params: dict[str, np.ndarray]):
        self.engine, self.spec, self.params = engine, spec, params
        self.grad = {k: np.zeros_like(v) for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.step = 0

    def _run(self, data: list[Datum], loss_fn: str, cfg: dict[str, float] | None, backward: bool) -> Future[ForwardBackwardOutput]:
        total, outs = 0.0, []
        for d in data:
            prev = np.asarray(d.model_input)
            if prev.max() >= self.engine.vocab_size or d.target_tokens.max() >= self.engine.vocab_size:
                raise ValueError(f"token id out of range for a vocabulary of {self.engine.vocab_size}")
            logp = _log_softmax(self.params["b"][None, :] + self.params["W"][prev])  # (N, V)
            tt = d.target_tokens if d.target_tokens.ndim == 2 else d.target_tokens[:, None]
            lp = np.take_along_axis(logp, tt, axis=1)  # (N, K)
            flat = lp if d.target_tokens.ndim == 2 else lp[:, 0]
            loss, coef = _loss_coef(loss_fn, flat, d, cfg or {})
            total += loss
            outs.append(flat.astype(np.float32))
            if backward:
                coef = coef if coef.ndim == 2 else coef[:, None]
                p = np.exp(logp)
                g = -coef.sum(axis=1, keepdims=True) * p  # d/dlogits of sum_k coef_k * logp[target_k]
                np.add.at(g, (np.arange(len(prev))[:, None], tt), coef)
                self.grad["b"] += g.sum(axis=0)
                np.add.at(self.grad["W"], prev, g)
        return Future.completed(ForwardBackwardOutput(logprobs=outs, metrics={"loss:sum": total}))

    def forward(self, data: list[Datum], loss_fn: str, loss_config: dict[str, float] | None = None):
        return self._run(data, loss_fn, loss_config, backward=False)

    def forward_backward(self, data: list[Datum], loss_fn: str, loss_config: dict[str, float] | None = None):
        return self._run(data, loss_fn, loss_config, backward=True)

    def optim_step(self, p: AdamParams) -> Future[OptimStepOutput]:
        norm = float(np.sqrt(sum((g**2).sum() for g in self.grad.values())))
        scale = min(1.0, p.grad_clip_norm / (norm + 1e-12)) if p.grad_clip_norm > 0 else 1.0
        self.step += 1
        for k, w in self.params.items():
            g = self.grad[k] * scale
            self.m[k] = p.beta1 * self.m[k] + (1 - p.beta1) * g
            self.v[k] = p.beta2 * self.v[k] + (1 - p.beta2) * g * g
            mhat, vhat = self.m[k] / (1 - p.beta1**self.step), self.v[k] / (1 - p.beta2**self.step)
            w *= 1 - p.learning_rate * p.weight_decay
            w -= p.learning_rate * mhat / (np.sqrt(vhat) + p.eps)
            self.grad[k][...] = 0
        return Future.completed(OptimStepOutput(metrics={"grad_norm:mean": norm}))

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return Future.completed(self.engine.save(self, name))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return Future.completed(self.engine.save(self, name))

    def save_weights_and_get_sampling_client(self) -> Future[NumpySampler]:
        return Future.completed(NumpySampler(self.engine, {k: v.copy() for k, v in self.params.items()}))


class NumpySampler:
    def __init__(self, engine: NumpyEngine, params: dict[str, np.ndarray]):
        self.engine, self.params = engine, params
        self._rng = np.random.default_rng(0)

    def _logits(self, prev: int) -> np.ndarray:
        return self.params["b"] + self.params["W"][prev]

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        rng = np.random.default_rng(params.seed) if params.seed is not None else self._rng
        stop = [self.engine.eos_id] if params.stop is None else params.stop
        if stop and isinstance(stop[0], str) and self.engine.decode is None:
            raise ValueError("stop strings need a tokenizer on the server")
        seqs = []
        for _ in range(num_samples):
            tokens: list[int] = []
            lps: list[float] = []
            reason = "length"
            prev = prompt[-1]
            while len(tokens) < params.max_tokens:
                logp = _log_softmax(self._logits(prev) / max(params.temperature, 1e-6))
                probs = np.exp(logp)
                if params.top_k > 0:
                    probs[np.argsort(probs)[: -params.top_k]] = 0
                if params.top_p < 1:
                    order = np.argsort(-probs)
                    keep = np.cumsum(probs[order]) - probs[order] < params.top_p
                    probs[order[~keep]] = 0
                tok = int(rng.choice(len(probs), p=probs / probs.sum()))
                tokens.append(tok)
                lps.append(float(logp[tok]))
                prev = tok
                if stop and isinstance(stop[0], int) and tok in stop:
                    reason = "stop"
                    break
                if stop and isinstance(stop[0], str) and self.engine.decode is not None:
                    text = self.engine.decode(tokens)
                    if any(text.endswith(s) for s in stop):  # type: ignore[arg-type]
                        reason = "stop"
                        break
            seqs.append(SampledSequence(tokens=tokens, logprobs=lps, stop_reason=reason))  # type: ignore[arg-type]
        return Future.completed(SampleOutput(sequences=seqs))

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        out: list[float | None] = [None]
        for prev, tok in itertools.pairwise(tokens):
            out.append(float(_log_softmax(self._logits(prev))[tok]))
        return Future.completed(out)


# ---------------------------------------------------------------- the service


@dataclass
class Record:
    route: str  # last path segment(s) after /api/v1/, e.g. "forward_backward", "retrieve_future"
    t: float  # time.monotonic() at arrival
    status: int = 200  # what the mock answered (0: connection dropped)
    seq_id: int | None = None
    model_id: str | None = None
    loss_fn: str | None = None
    n_datums: int | None = None
    forward_only: bool | None = None
    request_id: str | None = None
    body: Any = None  # the decoded JSON body (submits and sessions)


@dataclass
class Faults:
    """Switches, each consumed by the requests it hits. Route names as in Record.route."""

    # route -> HTTP statuses to answer its next requests with, one each (e.g. {"optim_step": [503]}).
    status: dict[str, list[int]] = field(default_factory=dict)
    # route -> (category, message): the next future of that route fails ("user" | "server" | "unknown").
    # forward_backward requests with forward_only count as route "forward" here.
    fail_future: dict[str, tuple[str, str]] = field(default_factory=dict)
    # route -> (n, category, message): let n more futures of that route through, then fail one.
    fail_after: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    # routes whose requests fail with a dropped connection; "*" drops everything. Not consumed.
    drop: set[str] = field(default_factory=set)
    # extra headers on injected statuses; a small retry-after-ms keeps the SDK's inner retries fast.
    retry_headers: dict[str, str] = field(default_factory=lambda: {"retry-after-ms": "20"})


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
        return cls(status, json.dumps(obj).encode(), {"content-type": "application/json", **(headers or {})})


class Dropped(Exception):
    """The connection is dropped: respx raises httpx.ConnectError, the HTTP server closes the socket."""


@dataclass
class _Slot:
    """One promise: the payload to answer retrieve_future with once `ready` resolves."""

    route: str
    ready: concurrent.futures.Future[Reply] = field(default_factory=concurrent.futures.Future)
    seq_id: int | None = None
    polls: int = 0


@dataclass
class _Model:
    model_id: str
    spec: LoraSpec
    tc: Future[Any]
    next_seq: int = 1
    pending: dict[int, Callable[[], None]] = field(default_factory=dict)


class MockTinker:
    def __init__(self, engine: Any, pyqwest: bool = False, try_again_every: int = 2):
        self.engine = engine
        self.pyqwest = pyqwest  # client/config leaves the pyqwest transport on (real sockets only)
        self.try_again_every = try_again_every  # every n-th future answers try_again on its first poll
        self.faults = Faults()
        self.records: list[Record] = []
        self.api_keys: set[str] = set()
        self.finished: list[dict[str, Any]] = []  # bodies of sessions/{id}/finish
        # Results stay unready until this many training submits have arrived (proves pipelining).
        self.hold_until_submits = 0
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._slots: dict[str, _Slot] = {}
        self._models: dict[str, _Model] = {}
        self._samplers: dict[str, tuple[Future[Any], str]] = {}  # id -> (engine sampler, base model)
        self._paths: dict[str, tuple[str, str]] = {}  # tinker:// path -> (engine path, base model)
        self._sessions = itertools.count()

    # ------------------------------------------------------------ public helpers for tests

    def submits(self, *routes: str) -> list[Record]:
        """Recorded requests on these routes that the mock accepted (status 200), in arrival order."""
        with self._lock:
            return [r for r in self.records if r.route in routes and r.status == 200]

    # ------------------------------------------------------------ dispatch

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Reply:
        """One request; raises Dropped for a dropped connection. Never blocks (see `wait_hint`)."""
        route = path.removeprefix("/api/v1/")
        if route.startswith("sessions/") and route.endswith("/finish"):
            route = "finish"
        elif route.startswith("samplers/"):
            route = "samplers"
        rec = Record(route=route, t=time.monotonic())
        with self._lock:
            self.records.append(rec)
            if route in self.faults.drop or "*" in self.faults.drop:
                rec.status = 0
                raise Dropped(route)
            statuses = self.faults.status.get(route)
            if statuses:
                rec.status = statuses.pop(0)
                return Reply.json({"detail": f"injected HTTP {rec.status}"}, rec.status, self.faults.retry_headers)
        key = headers.get("x-api-key", "")
        if route not in ("client/config", "client/dynamic_config", "telemetry"):
            self.api_keys.add(key)
            if not key.startswith("tml-"):
                rec.status = 401
                return Reply.json({"detail": "invalid API key"}, 401)
        try:
            reply = self._route(route, method, path, headers, body, rec)
        except (ValueError, KeyError) as exc:  # a malformed request is the client's fault
            reply = Reply.json({"detail": f"bad request: {exc}"}, 422)
        rec.status = reply.status
        return reply

    def wait_hint(self, path: str, body: bytes) -> Callable[[], bool] | None:
        """For a retrieve_future whose result cannot be handed out yet: a predicate to long-poll on
        (for up to LONG_POLL_S) before answering, as the service holds such polls open."""
        if not path.endswith("/retrieve_future"):
            return None
        with contextlib.suppress(Exception):
            slot = self._slots[json.loads(body)["request_id"]]
            if not self._deliverable(slot):
                return lambda: self._deliverable(slot)
        return None

    def _deliverable(self, slot: _Slot) -> bool:
        held = len(self.submits("forward_backward", "optim_step")) < self.hold_until_submits
        return slot.ready.done() and not held

    def _route(self, route: str, method: str, path: str, headers: dict[str, str], body: bytes, rec: Record) -> Reply:
        if route == "client/config":
            return Reply.json({} if self.pyqwest else {"use_pyqwest_transport": False})
        if route in ("client/dynamic_config", "session_heartbeat"):
            return Reply.json({})
        if route == "telemetry":
            return Reply.json({"status": "accepted"})
        if route == "forward_backward":
            return self._forward_backward(headers, body, rec)
        req = json.loads(body) if body else {}
        rec.body = req
        rec.model_id, rec.seq_id = req.get("model_id"), req.get("seq_id")
        match route:
            case "create_session":
                return Reply.json({"session_id": f"{SESSION}-{next(self._sessions)}"})
            case "create_model":
                return self._create_model(req)
            case "load_weights":
                return self._load_weights(req)
            case "get_info":
                m = self._models[req["model_id"]]
                return Reply.json({"model_id": m.model_id, "model_data": {"model_name": m.spec.base_model, "arch": "mock"},
                                   "is_lora": True, "lora_rank": m.spec.rank, "model_name": m.spec.base_model})
            case "optim_step":
                return self._optim_step(req)
            case "save_weights":
                return self._save(req, route, "weights")
            case "save_weights_for_sampler":
                return self._save(req, route, "sampler_weights")
            case "create_sampling_session":
                return self._create_sampling_session(req)
            case "samplers":
                sid = path.rsplit("/", 1)[-1]
                return Reply.json({"sampler_id": sid, "base_model": self._samplers[sid][1]})
            case "asample":
                return self._sample(req)
            case "retrieve_future":
                return self._retrieve(req, rec)
            case "finish":
                self.finished.append(req)
                return Reply.json(None)
        return Reply.json({"detail": f"no route {method} {path}"}, 404)

    # ------------------------------------------------------------ promises and per-model ordering

    def _promise(self, route: str, seq_id: int | None = None, extra: dict[str, Any] | None = None) -> tuple[_Slot, Reply]:
        rid = f"req-{route}-{next(self._ids)}"
        slot = _Slot(route=route, seq_id=seq_id)
        with self._lock:
            self._slots[rid] = slot
            failure = self.faults.fail_future.pop(route, None)
            if route in self.faults.fail_after:
                n, category, message = self.faults.fail_after[route]
                if n == 0:
                    failure = (category, message)
                    del self.faults.fail_after[route]
                else:
                    self.faults.fail_after[route] = (n - 1, category, message)
        if failure is not None:
            slot.ready.set_result(Reply.json({"error": failure[1], "category": failure[0]}))
        return slot, Reply.json({"request_id": rid, **(extra or {})})

    def _deliver(self, slot: _Slot, fut: Future[Any], to_reply: Callable[[Any], Reply]) -> None:
        """Resolve `slot` from an engine future: its result as a reply, an engine error as a failed request."""

        def done(_: Any) -> None:
            try:
                reply = to_reply(fut.result())
            except Exception as exc:  # noqa: BLE001 - input the engine refused: the user's fault, as the service says
                reply = Reply.json({"error": f"{type(exc).__name__}: {exc}", "category": "user"})
            if not slot.ready.done():
                slot.ready.set_result(reply)

        fut.future().add_done_callback(done)

    def _enqueue(self, model_id: str, seq_id: int, slot: _Slot, op: Callable[[Any], tuple[Future[Any], Callable[[Any], Reply]]]) -> None:
        """Run `op(training_client)` when every earlier seq_id of the model has run (the service's order)."""

        def run() -> None:
            if slot.ready.done():  # an injected failure: the seq id is spent, the engine never sees it
                return
            try:
                fut, to_reply = op(model.tc.result())
            except Exception as exc:  # noqa: BLE001 - reported to the client as a failed request
                slot.ready.set_result(Reply.json({"error": f"{type(exc).__name__}: {exc}", "category": "user"}))
                return
            self._deliver(slot, fut, to_reply)

        with self._lock:
            model = self._models[model_id]
            if seq_id < model.next_seq or seq_id in model.pending:
                raise ValueError(f"seq_id {seq_id} already used for {model_id}")
            model.pending[seq_id] = run
        self._drain(model)

    def _drain(self, model: _Model) -> None:
        if not model.tc.done():  # the engine is still creating the model; come back when it is
            model.tc.future().add_done_callback(lambda _: self._drain(model))
            return
        # Under the lock: two threads draining at once must not hand the engine seq 2 before seq 1.
        with self._lock:
            while (run := model.pending.pop(model.next_seq, None)) is not None:
                model.next_seq += 1
                run()

    def _retrieve(self, req: dict[str, Any], rec: Record) -> Reply:
        rid = req["request_id"]
        rec.request_id = rid
        with self._lock:
            slot = self._slots.get(rid)
            if slot is None:
                return Reply.json({"detail": f"unknown request {rid}"}, 404)
            slot.polls += 1
            rec.seq_id = slot.seq_id
            first_try_again = slot.polls == 1 and self.try_again_every and int(rid.rsplit("-", 1)[1]) % self.try_again_every == 0
            if first_try_again or not self._deliverable(slot):
                return Reply.json({"type": "try_again", "request_id": rid, "queue_state": "active"})
        return slot.ready.result()

    # ------------------------------------------------------------ routes

    def _create_model(self, req: dict[str, Any]) -> Reply:
        lora = req["lora_config"]
        spec = LoraSpec(base_model=req["base_model"], rank=lora["rank"], seed=lora.get("seed"),
                        train_attn=lora.get("train_attn", True), train_mlp=lora.get("train_mlp", True),
                        train_unembed=lora.get("train_unembed", True))
        model_id = f"{req['session_id']}:train:{req['model_seq_id']}"
        tc = self.engine.create_training_client(spec)
        with self._lock:
            self._models[model_id] = _Model(model_id, spec, tc)
        slot, reply = self._promise("create_model")
        self._deliver(slot, tc, lambda _: Reply.json({"model_id": model_id}))
        return reply

    def _load_weights(self, req: dict[str, Any]) -> Reply:
        model_id = f"{req['session_id']}:train:{req['model_seq_id']}"
        path = req["path"]
        if path not in self._paths or "/weights/" not in path:
            return Reply.json({"detail": f"no training checkpoint at {path}"}, 404)
        engine_path, _ = self._paths[path]
        spec = self._spec_of(path)
        tc = self.engine.create_training_client_from_state(engine_path, spec, with_optimizer=bool(req["optimizer"]))
        with self._lock:
            self._models[model_id] = _Model(model_id, spec, tc)
        slot, reply = self._promise("load_weights")
        self._deliver(slot, tc, lambda _: Reply.json({"path": path, "model_id": model_id}))
        return reply

    def _spec_of(self, path: str) -> LoraSpec:
        owner = path.removeprefix("tinker://").split("/", 1)[0]
        return self._models[owner].spec

    def _forward_backward(self, headers: dict[str, str], body: bytes, rec: Record) -> Reply:
        if headers.get("content-encoding") == "zstd":
            import zstandard

            body = zstandard.ZstdDecompressor().decompress(body)
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(body)
        data = [decode_datum(d) for d in msg.data]
        cfg = {k: v.number for k, v in msg.loss_fn_config_v2.items()} or dict(msg.loss_fn_config)
        rec.model_id, rec.seq_id, rec.loss_fn = msg.model_id, msg.seq_id, msg.loss_fn
        rec.n_datums, rec.forward_only = len(data), msg.forward_only
        slot, reply = self._promise("forward" if msg.forward_only else "forward_backward", msg.seq_id)
        method = "forward" if msg.forward_only else "forward_backward"
        self._enqueue(msg.model_id, msg.seq_id, slot,
                      lambda tc: (getattr(tc, method)(data, msg.loss_fn, cfg or None), fb_reply))
        return reply

    def _optim_step(self, req: dict[str, Any]) -> Reply:
        p = req["adam_params"]
        params = AdamParams(learning_rate=p["learning_rate"], beta1=p["beta1"], beta2=p["beta2"], eps=p["eps"],
                            weight_decay=p.get("weight_decay", 0.0), grad_clip_norm=p.get("grad_clip_norm", 0.0))
        slot, reply = self._promise("optim_step", req["seq_id"])
        self._enqueue(req["model_id"], req["seq_id"], slot,
                      lambda tc: (tc.optim_step(params), lambda out: Reply.json({"metrics": out.metrics})))
        return reply

    def _save(self, req: dict[str, Any], route: str, kind: str) -> Reply:
        model_id, seq_id, name = req["model_id"], req["seq_id"], req.get("path")
        slot, reply = self._promise(route, seq_id)
        base = self._models[model_id].spec.base_model
        if name is None:  # save_weights_and_get_sampling_client: an ephemeral sampling session
            sid = f"{model_id.split(':')[0]}:sample:{req['sampling_session_seq_id']}"

            def ephemeral(tc: Any) -> tuple[Future[Any], Callable[[Any], Reply]]:
                fut = tc.save_weights_and_get_sampling_client()
                with self._lock:
                    self._samplers[sid] = (fut, base)
                return fut, lambda _: Reply.json({"sampling_session_id": sid})

            self._enqueue(model_id, seq_id, slot, ephemeral)
            return reply
        path = f"tinker://{model_id}/{kind}/{name}"

        def named(tc: Any) -> tuple[Future[Any], Callable[[Any], Reply]]:
            # Names are per model on the service; an engine may keep one flat folder of them.
            flat = f"{model_id.replace(':', '_')}_{name}"
            fut = tc.save_state(flat) if kind == "weights" else tc.save_weights_for_sampler(flat)

            def to_reply(engine_path: str) -> Reply:
                with self._lock:
                    self._paths[path] = (engine_path, base)
                return Reply.json({"path": path})

            return fut, to_reply

        self._enqueue(model_id, seq_id, slot, named)
        return reply

    def _create_sampling_session(self, req: dict[str, Any]) -> Reply:
        sid = f"{req['session_id']}:sample:{req['sampling_session_seq_id']}"
        path, base = req.get("model_path"), req.get("base_model")
        if path is not None:
            if path not in self._paths:
                return Reply.json({"detail": f"no checkpoint at {path}"}, 404)
            engine_path, base = self._paths[path]
            fut = self.engine.create_sampling_client(model_path=engine_path)
        else:
            fut = self.engine.create_sampling_client(base_model=base)
        with self._lock:
            self._samplers[sid] = (fut, str(base))
        return Reply.json({"sampling_session_id": sid})

    def _sample(self, req: dict[str, Any]) -> Reply:
        n = int(req["num_samples"])
        prompt = [t for c in req["prompt"]["chunks"] for t in c["tokens"]]
        sp = req["sampling_params"]
        stop = sp.get("stop")
        params = SamplingParams(max_tokens=sp.get("max_tokens") or 64, temperature=sp.get("temperature", 1.0),
                                top_p=sp.get("top_p", 1.0), top_k=sp.get("top_k", -1),
                                stop=[stop] if isinstance(stop, str) else stop, seed=sp.get("seed"))
        sampler, _ = self._samplers[req["sampling_session_id"]]
        slot, reply = self._promise("asample", extra={"sample_sequence_ids": [f"seq-{next(self._ids)}" for _ in range(n)]})
        want_prompt_lps = bool(req.get("prompt_logprobs"))

        def run(_: Any) -> None:
            try:
                sc = sampler.result()
                out = sc.sample(prompt, n, params).result()
                lps = sc.compute_logprobs(prompt).result() if want_prompt_lps else None
                reply_ = Reply(200, sample_proto(out, lps), PROTO)
            except Exception as exc:  # noqa: BLE001 - reported to the client as a failed request
                reply_ = Reply.json({"error": f"{type(exc).__name__}: {exc}", "category": "user"})
            if not slot.ready.done():
                slot.ready.set_result(reply_)

        # Off the request thread: an engine sampler may take a while (the local model decodes token by token).
        sampler.future().add_done_callback(lambda f: threading.Thread(target=run, args=(f,), daemon=True).start())
        return reply


# ---------------------------------------------------------------- wire formats (shared with runner serve)


def fb_reply(out: ForwardBackwardOutput) -> Reply:
    return Reply(200, fb_proto(out), PROTO)


# ---------------------------------------------------------------- respx mounting


@contextlib.contextmanager
def respx_tinker(mock: MockTinker, base_url: str = BASE_URL) -> Iterator[respx.MockRouter]:
    """Mount `mock` for every httpx client in the process (the SDK's loop thread included).
    using="httpx" patches httpx itself, so it holds even if the pyqwest transport were chosen."""

    async def side_effect(request: httpx.Request) -> httpx.Response:
        headers = {k.lower(): v for k, v in request.headers.items()}
        args = (request.method, request.url.path, headers, request.content)
        ready = mock.wait_hint(request.url.path, request.content)
        if ready is not None:  # long-poll without blocking the SDK's event loop
            deadline = time.monotonic() + LONG_POLL_S
            while not ready() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        try:
            reply = mock.handle(*args)
        except Dropped as exc:
            raise httpx.ConnectError(f"connection dropped ({exc})", request=request) from None
        return httpx.Response(reply.status, content=reply.body, headers=reply.headers)

    with respx.mock(base_url=base_url, assert_all_called=False, using="httpx") as router:
        router.route().mock(side_effect=side_effect)
        yield router
