"""A deterministic toy backend for loop tests: the full protocol, no torch model.

The "model" is a unigram: one logit per token id (ids fold into `vocab` slots), so
logprob(t) = theta[t] - logsumexp(theta) whatever the context. Losses are the registry's (backends/losses.py,
token sums, in float64), gradients exact (autograd through the loss to the logprobs, then the unigram's
Jacobian), and AdamW matches Tinker's parameters, so losses really move and a checkpoint round-trip is bit-exact.

Each training client runs its calls on one worker thread, in submission order (the protocol's
FIFO). `backend.calls` records, in order, "submit <op>#<n>" when a call is made and "await <op>#<n>"
when its result is first waited for, so tests can check the loop's pipelining; `delay` makes each
call take time, and `fail` names a call ("fb#3") that raises BackendError, to simulate a crash.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from backends.base import BackendError, CustomLossFn, Future, loss_of
from backends.tokenizer import Tokenizer, decode_text, eos_token_id
from backends.types import (
    TEMPERATURE_FLOOR,
    TOP_P_FLOOR,
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

OPS = {
    "forward": "fwd",
    "forward_backward": "fb",
    "forward_backward_custom": "fbc",
    "optim_step": "optim",
    "save_state": "save",
    "save_weights_for_sampler": "save_sampler",
    "save_weights_and_get_sampling_client": "sampler",
}

T = TypeVar("T")


class FakeBackend:
    def __init__(self, tokenizer: Tokenizer | None = None, *, vocab: int | None = None, delay: float = 0.0,
                 fail: str | None = None, storage_dir: Path | None = None):
        self.delay, self.fail = delay, fail
        self.tokenizer = tokenizer
        # One logit per token the tokenizer knows, so samples always decode.
        self.vocab = vocab or (len(tokenizer) if tokenizer is not None else 512)
        # Saved states live in memory, or as .npz files (so a second process can resume from them).
        self.storage_dir = storage_dir
        self.saved: dict[str, dict[str, np.ndarray]] = {}
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.clients: list[FakeTrainingClient] = []
        self.closed: str | None = None

    def record(self, event: str) -> None:
        with self._lock:
            self.calls.append(event)

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            from backends.tiny_tokenizer import build_tokenizer

            self.tokenizer = build_tokenizer()
        return self.tokenizer

    def create_training_client(self, spec: LoraSpec) -> Future[FakeTrainingClient]:
        theta = np.random.default_rng((spec.seed or 0) % 2**63).normal(0.0, 0.1, self.vocab)
        return Future.completed(self._client({"theta": theta}))

    def create_training_client_from_state(self, path: str, spec: LoraSpec,
                                          with_optimizer: bool = True) -> Future[FakeTrainingClient]:
        state = self._load(path)
        if not with_optimizer:
            state = {"theta": state["theta"]}
        return Future.completed(self._client(state))

    def create_sampling_client(self, model_path: str | None = None,
                               base_model: str | None = None) -> Future[FakeSamplingClient]:
        theta = self._load(model_path)["theta"] if model_path else np.random.default_rng(0).normal(0.0, 0.1, self.vocab)
        return Future.completed(FakeSamplingClient(self, theta))

    def checkpoint_ttl_seconds(self) -> int | None:
        return None

    def close(self, status: str = "success") -> None:
        for c in self.clients:
            c.worker.shutdown(wait=True)
        self.closed = status

    def _client(self, state: dict[str, np.ndarray]) -> FakeTrainingClient:
        c = FakeTrainingClient(self, next(self._ids), {k: v.copy() for k, v in state.items()})
        self.clients.append(c)
        return c

    def _store(self, path: str, state: dict[str, np.ndarray]) -> str:
        # Never overwrite a checkpoint (as the local backend and Tinker): the loop must pick fresh names.
        if self.storage_dir is not None:
            path = str(Path(self.storage_dir) / (path.replace("/", "_") + ".npz"))
            if Path(path).exists():
                raise BackendError(f"checkpoint {path} already exists", request="save", user_error=True)
            Path(self.storage_dir).mkdir(parents=True, exist_ok=True)
            np.savez(path, **state)  # pyright: ignore[reportArgumentType] - numpy's stub types **kwds as bool
        elif path in self.saved:
            raise BackendError(f"checkpoint {path} already exists", request="save", user_error=True)
        else:
            self.saved[path] = {k: v.copy() for k, v in state.items()}
        return path

    def _load(self, path: str) -> dict[str, np.ndarray]:
        if path in self.saved:
            return {k: v.copy() for k, v in self.saved[path].items()}
        if path.endswith(".npz") and Path(path).exists():
            with np.load(path) as z:
                return {k: z[k].copy() for k in z.files}
        raise BackendError(f"no saved state at {path!r}", request="load", user_error=True)


class _RecordedFuture(Future[T]):
    """A Future that logs "await <op>#<n>" the first time anyone waits on it."""

    def __init__(self, inner: concurrent.futures.Future[T], backend: FakeBackend, label: str):
        super().__init__(inner)
        self._backend, self._label, self._seen = backend, label, False

    def _note(self) -> None:
        if not self._seen:
            self._seen = True
            self._backend.record(f"await {self._label}")

    def result(self, timeout: float | None = None) -> T:
        self._note()
        return super().result(timeout)

    async def result_async(self) -> T:
        self._note()
        return await super().result_async()


class FakeTrainingClient:
    def __init__(self, backend: FakeBackend, cid: int, state: dict[str, np.ndarray]):
        self.backend, self.cid = backend, cid
        self.theta = state["theta"].astype(np.float64)
        zeros = np.zeros_like(self.theta)
        self.m, self.v = state.get("m", zeros).copy(), state.get("v", zeros).copy()
        self.t = int(state.get("t", np.array(0)))
        self.grad = np.zeros_like(self.theta)
        self.worker = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # the FIFO
        self.counts: dict[str, int] = {}

    def _submit(self, method: str, fn: Callable[[], T]) -> Future[T]:
        op = OPS[method]
        n = self.counts.get(op, 0)
        self.counts[op] = n + 1
        label = f"{op}#{n}"
        self.backend.record(f"submit {label}")

        def run() -> T:
            time.sleep(self.backend.delay)
            if label == self.backend.fail:
                raise BackendError(f"injected failure in {label}", request=label)
            return fn()

        return _RecordedFuture(self.worker.submit(run), self.backend, label)

    # --- model

    def _logprobs(self, d: Datum) -> np.ndarray:
        lse = np.log(np.exp(self.theta - self.theta.max()).sum()) + self.theta.max()
        return (self.theta[d.target_tokens % self.backend.vocab] - lse).astype(np.float32)

    def _accumulate(self, data: list[Datum], dloss_dlp: list[np.ndarray]) -> None:
        """grad += sum_i g_i * d lp_i / d theta, with d lp_t / d theta = onehot(t) - softmax(theta)."""
        p = np.exp(self.theta - self.theta.max())
        p /= p.sum()
        for d, g in zip(data, dloss_dlp, strict=True):
            np.add.at(self.grad, d.target_tokens.reshape(-1) % self.backend.vocab, g.reshape(-1).astype(np.float64))
            self.grad -= p * float(g.sum())

    def _loss(self, data: list[Datum], loss_fn: LossFn,
              config: dict[str, float]) -> tuple[ForwardBackwardOutput, list[np.ndarray]]:
        import torch

        loss_of_datum = loss_of(loss_fn, config)
        lps, grads, total = [], [], 0.0
        for d in data:
            lp_np = self._logprobs(d).astype(np.float64)
            lp = torch.tensor(lp_np, requires_grad=True)
            loss = loss_of_datum(d, lp)
            (g,) = torch.autograd.grad(loss, lp, allow_unused=True)
            lps.append(lp_np.astype(np.float32))
            grads.append(np.zeros_like(lp_np) if g is None else g.numpy())
            total += float(loss.detach())
        return ForwardBackwardOutput(logprobs=lps, metrics={"loss:sum": total}), grads

    # --- the protocol

    def forward(self, data: list[Datum], loss_fn: LossFn,
                loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        return self._submit("forward", lambda: self._loss(data, loss_fn, loss_config or {})[0])

    def forward_backward(self, data: list[Datum], loss_fn: LossFn,
                         loss_config: dict[str, float] | None = None) -> Future[ForwardBackwardOutput]:
        def run() -> ForwardBackwardOutput:
            out, grads = self._loss(data, loss_fn, loss_config or {})
            self._accumulate(data, grads)
            return out

        return self._submit("forward_backward", run)

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        def run() -> ForwardBackwardOutput:
            import torch

            lps = [torch.tensor(self._logprobs(d), dtype=torch.float64, requires_grad=True) for d in data]
            loss, metrics = loss_fn(data, lps)
            loss.backward()
            grads = [lp.grad.numpy() if lp.grad is not None else np.zeros(lp.shape) for lp in lps]
            self._accumulate(data, grads)
            surrogate = sum(float((g * lp.detach().numpy()).sum()) for g, lp in zip(grads, lps, strict=True))
            out_metrics = {**metrics, "loss:sum": float(loss.detach().sum()), "surrogate_loss:sum": surrogate}
            return ForwardBackwardOutput(logprobs=[lp.detach().numpy().astype(np.float32) for lp in lps],
                                         metrics=out_metrics)

        return self._submit("forward_backward_custom", run)

    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]:
        def run() -> OptimStepOutput:
            g = self.grad
            norm = float(np.sqrt((g * g).sum()))
            if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
                g = g * (params.grad_clip_norm / norm)
            self.t += 1
            self.m = params.beta1 * self.m + (1 - params.beta1) * g
            self.v = params.beta2 * self.v + (1 - params.beta2) * g * g
            m_hat = self.m / (1 - params.beta1**self.t)
            v_hat = self.v / (1 - params.beta2**self.t)
            self.theta = self.theta * (1 - params.learning_rate * params.weight_decay)  # decoupled decay
            self.theta = self.theta - params.learning_rate * m_hat / (np.sqrt(v_hat) + params.eps)
            self.grad = np.zeros_like(self.theta)
            return OptimStepOutput(metrics={"grad_norm:mean": norm})

        return self._submit("optim_step", run)

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        def run() -> str:
            state = {"theta": self.theta, "m": self.m, "v": self.v, "t": np.array(self.t)}
            return self.backend._store(f"fake://{self.cid}/weights/{name}", state)

        return self._submit("save_state", run)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        path = f"fake://{self.cid}/sampler_weights/{name}"
        return self._submit("save_weights_for_sampler", lambda: self.backend._store(path, {"theta": self.theta}))

    def save_weights_and_get_sampling_client(self) -> Future[FakeSamplingClient]:
        return self._submit("save_weights_and_get_sampling_client",
                            lambda: FakeSamplingClient(self.backend, self.theta.copy()))


class FakeSamplingClient:
    """Samples from the unigram it was made with; seeded by params.seed, else by a call counter."""

    def __init__(self, backend: FakeBackend, theta: np.ndarray):
        self.backend, self.theta = backend, theta
        self._calls = itertools.count()

    def _logp(self, temperature: float) -> np.ndarray:
        z = self.theta / max(temperature, 1e-6)
        return z - (np.log(np.exp(z - z.max()).sum()) + z.max())

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        seed = params.seed if params.seed is not None else next(self._calls)
        # Seeded: sample k draws from seed + k, as the local sampler's (one request of n samples seeded s is n
        # requests seeded s, s + 1, ...); unseeded: one stream for the call.
        rng = np.random.default_rng([seed % 2**63, len(prompt)])  # numpy takes no negative seed; the SDK's may be
        logp = self._logp(params.temperature)
        # The floors of backends/types.py, as the local sampler: greedy below TEMPERATURE_FLOOR, and top_p below
        # TOP_P_FLOOR keeps only the most likely token (top_k and top_p above it are not modelled here).
        greedy = params.temperature < TEMPERATURE_FLOOR or params.top_p < TOP_P_FLOOR
        tok = self.backend.tokenizer
        eos = None if tok is None else eos_token_id(tok)
        seqs = []
        for k in range(num_samples):
            if params.seed is not None:
                rng = np.random.default_rng([(params.seed + k) % 2**63, len(prompt)])
            tokens: list[int] = []
            logprobs: list[float] = []
            reason = "length"
            for _ in range(params.max_tokens):
                t = int(np.argmax(logp)) if greedy else int(rng.choice(len(logp), p=np.exp(logp)))
                tokens.append(t)
                logprobs.append(float(logp[t]))
                if _stops(tokens, params.stop, eos, tok):
                    reason = "stop"
                    break
            seqs.append(SampledSequence(tokens=tokens, logprobs=logprobs, stop_reason=reason))
        return Future.completed(SampleOutput(sequences=seqs))

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        logp = self._logp(1.0)
        return Future.completed([None] + [float(logp[t % len(logp)]) for t in tokens[1:]])


def _stops(tokens: list[int], stop: list[str] | list[int] | None, eos: int | None, tok: Tokenizer | None) -> bool:
    if stop is None:
        return eos is not None and tokens[-1] == eos
    if not stop:
        return False
    if isinstance(stop[0], int):
        return tokens[-1] in stop
    if tok is None:
        return False
    text = decode_text(tok, tokens)
    return any(text.endswith(s) for s in stop if isinstance(s, str))
