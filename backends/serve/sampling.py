"""Sampling routes: create_sampling_session and asample (with prompt and top-k logprobs, stability records).

A sample request costs num_samples x (prompt + max_tokens) tokens: over Limits.max_request_tokens it is
refused at once (413); otherwise it waits until the tokens of all requests in flight fit under
Limits.max_live_tokens (limits.Budget) and returns them when it finishes, failed or not. Its memory (KV cache
and logits, backends/serve/memory.py) is reserved the same way against --max-bytes: over the cap outright, a
413; not fitting beside what live training runs hold, it waits (Limits.max_sample_wait_s, then fails).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING

import numpy as np

from backends.serve import memory, wire
from backends.serve.adapters import Stability
from backends.serve.limits import Budget, Fields, Limits, to_int
from backends.serve.memory import fmt_bytes
from backends.serve.replies import ApiError, Promise, Promises, Reply, error_reply, failed
from backends.serve.samplers import Gather, SamplerPool, SamplerSession
from backends.serve.sessions import ServedModel, Session
from backends.serve.store import Store
from backends.types import SampleOutput, SamplingParams

if TYPE_CHECKING:
    from backends.local.backend import LocalSamplingClient


class SamplingRoutes:
    store: Store
    limits: Limits
    promises: Promises
    pool: SamplerPool
    stability: Stability
    budget: Budget
    gather: Gather
    _lock: threading.RLock
    _extras: concurrent.futures.ThreadPoolExecutor

    def _session(self, sid: str) -> Session: ...
    def _served(self, name: str) -> ServedModel: ...
    def _parse_path(self, path: str) -> tuple[str, str, str]: ...
    def _shapes(self, model: ServedModel) -> memory.Shapes: ...

    def _create_sampling_session(self, f: Fields) -> Reply:
        session_id = f.id("session_id")
        sid = f"{session_id}:sample:{f.int('sampling_session_seq_id', lo=0)}"
        path = f.str("model_path", None)
        if path:
            run_id, kind, name = self._parse_path(path)
            meta = self.store.read_run(run_id)
            if meta is None:
                raise ApiError(404, f"no training run {run_id}")
            sess = SamplerSession(sid, self._served(meta["base_model"]), session_id, path,
                                  source=self.store.checkpoint_dir(run_id, kind, name))
        else:
            sess = SamplerSession(sid, self._served(f.str("base_model")), session_id, None)
        self.pool.add(sess)
        with self._lock:
            self._session(session_id).samplers.add(sid)
        return Reply.json({"sampling_session_id": sid})

    def _sample(self, f: Fields) -> Reply:
        sess = self.pool.get(f.id("sampling_session_id"))
        f.int("seq_id", None)  # the client's own counter: unused, but it must be one
        n = f.int("num_samples", 1, lo=1, hi=self.limits.max_num_samples)
        prompt = _prompt_tokens(f.req.get("prompt"))
        params = sampling_params(f.sub("sampling_params"))
        cost = n * (len(prompt) + params.max_tokens)
        if cost > self.limits.max_request_tokens:
            raise ApiError(413, f"num_samples x (prompt + max_tokens) = {n} x ({len(prompt)} + {params.max_tokens}) = "
                                f"{cost} tokens; runner serve takes at most {self.limits.max_request_tokens} per request")
        for unsupported in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
            if f.req.get(unsupported):
                raise ApiError(400, f"{unsupported} is not offered by runner serve")
        want_lps = f.bool("prompt_logprobs", False)
        nbytes = self._sample_bytes(sess.model, n, len(prompt), params.max_tokens, want_lps)
        k_prompt = f.int("topk_prompt_logprobs", 0, lo=0, hi=1024)
        k_sample = f.int("topk_sample_logprobs", 0, lo=0, hi=1024)
        last_n = f.int("prompt_logprobs_last_n", None, lo=0)
        record = f.bool("record_stability_info", False)
        seq_ids = [f"{sess.sampler_id}:seq:{self.promises.next_id()}" for _ in range(n)]
        promise, reply = self.promises.new("asample", {"sample_sequence_ids": seq_ids})
        held = _Held(self.budget, cost, nbytes)

        def run(sc: LocalSamplingClient) -> None:
            sample = sc.sample(prompt, n, params)
            lps = sc.compute_logprobs(prompt) if want_lps else None
            lock, finished = threading.Lock(), []

            def finish(_: object) -> None:
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
                    promise.resolve(error_reply(exc))
                    return
                if record:
                    self.stability.record(seq_ids, out)
                if k_prompt or k_sample:  # one more forward pass, off the sampler's thread
                    self._extras.submit(_with_topk, promise, sc, prompt, out, prompt_lps, k_prompt, k_sample,
                                        params.temperature, last_n)
                    return
                promise.resolve(Reply(200, wire.sample_proto(out, _last_n(prompt_lps, last_n)), dict(wire.PROTO)))

            sample.future().add_done_callback(finish)
            if lps is not None:
                lps.future().add_done_callback(finish)

        def dispatch() -> None:  # the budget is ours now
            held.acquired()
            if promise.done():  # cancelled while it waited for budget
                held.release()
                return
            try:
                client = self.pool.client(sess)
            except BaseException as exc:  # noqa: BLE001
                promise.resolve(error_reply(exc))
                return

            def start(_: object) -> None:
                exc = client.future().exception()
                if exc is not None:
                    promise.resolve(error_reply(exc))
                    return
                try:
                    run(client.result())
                except BaseException as e:  # noqa: BLE001
                    promise.resolve(error_reply(e))

            # Requests for one session reach the sampler together, so it decodes them as one batch (Gather).
            self.gather.add(sess.sampler_id, lambda: client.future().add_done_callback(start), sess.session_id)

        promise.future.add_done_callback(lambda _: held.release())  # however the request ends
        self.budget.acquire(cost, dispatch, nbytes, lambda why: promise.resolve(failed(why)))
        return reply

    def _sample_bytes(self, model: ServedModel, n: int, prompt: int, max_tokens: int, want_lps: bool) -> int:
        """The request's memory (backends/serve/memory.py), reserved before it runs; over --max-bytes: a 413."""
        engine = model.engine()
        chunk = memory.CPU_CHUNK_BYTES if engine.device.type == "cpu" else 1 << 62
        nbytes = memory.sample_bytes(self._shapes(model), engine.dtype.itemsize, n, prompt, max_tokens, want_lps,
                                     chunk_bytes=chunk)
        cap = self.budget.memory.max_bytes if self.budget.memory is not None else 1 << 62
        if nbytes > cap:
            raise ApiError(413, f"this sample request needs {fmt_bytes(nbytes)} (num_samples {n} x (prompt {prompt} + "
                                f"max_tokens {max_tokens}) tokens of KV cache and logits), over runner serve's "
                                f"--max-bytes {fmt_bytes(cap)}: ask for fewer samples or tokens, or restart runner "
                                f"serve with a higher --max-bytes")
        return nbytes


class _Held:
    """A request's share of the sampling budget: released once, and only if it was acquired."""

    def __init__(self, budget: Budget, cost: int, nbytes: int):
        self.budget, self.cost, self.nbytes = budget, cost, nbytes
        self._lock = threading.Lock()
        self._acquired = self._released = False

    def acquired(self) -> None:
        with self._lock:
            self._acquired = True

    def release(self) -> None:
        with self._lock:
            if not self._acquired or self._released:
                return
            self._released = True
        self.budget.release(self.cost, self.nbytes)


def sampling_params(f: Fields) -> SamplingParams:
    stop = f.req.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and (all(isinstance(s, str) for s in stop)
                                                             or all(type(s) is int for s in stop))):
        raise ApiError(400, "sampling_params.stop must be a string, a list of strings or a list of token ids")
    # Values too small to sample with are greedy in the sampler itself (backends/types.py TEMPERATURE_FLOOR, TOP_P_FLOOR).
    return SamplingParams(max_tokens=f.int("max_tokens", 64, lo=1), temperature=f.float("temperature", 1.0, lo=0.0),
                          top_p=f.float("top_p", 1.0, lo=1e-300, hi=1.0),
                          top_k=f.int("top_k", -1, lo=-1), stop=stop, seed=f.int("seed", None))


def _prompt_tokens(prompt: object) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks", []), list):
        raise ApiError(400, "prompt must be an object {chunks: [{type: 'encoded_text', tokens: [...]}]}")
    tokens: list[int] = []
    for c in prompt.get("chunks", []):
        if not isinstance(c, dict):
            raise ApiError(400, "prompt chunks must be objects")
        if c.get("type", "encoded_text") != "encoded_text":
            raise ApiError(400, f"prompt chunks of type {str(c.get('type'))[:40]!r} are not supported (text tokens only)")
        toks = c.get("tokens")
        if not isinstance(toks, list):
            raise ApiError(400, "prompt chunk tokens must be a list of token ids")
        tokens.extend(to_int("prompt token", t, lo=0) for t in toks)
    if not tokens:
        raise ApiError(400, "the prompt has no tokens")
    return tokens


def _last_n(lps: list[float | None] | None, last_n: int | None) -> list[float | None] | None:
    if lps is None or not last_n:
        return lps
    cut = max(0, len(lps) - int(last_n))
    return [None] * cut + lps[cut:]


def _with_topk(promise: Promise, sc: LocalSamplingClient, prompt: list[int], out: SampleOutput, prompt_lps: list[float | None] | None,
               k_prompt: int, k_sample: int, temperature: float, last_n: int | None) -> None:
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
                topk_sampled.append(topk_logprobs(sc.model, full, k_sample, temperature, range(len(prompt), len(full))))
        promise.resolve(Reply(200, wire.sample_proto(out, _last_n(prompt_lps, last_n), topk_prompt, topk_sampled),
                              dict(wire.PROTO)))
    except BaseException as exc:  # noqa: BLE001
        promise.resolve(error_reply(exc))
