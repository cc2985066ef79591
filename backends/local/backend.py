"""The local backend: Tinker's primitives (backends/base.py) over an in-process torch + peft LoRA model.

Each training client owns a private copy of the base model (LoRA-wrapped, or fully trainable) and one
worker thread that runs its calls strictly in submission order (backends/local/worker.py). Each
sampling client owns an immutable merged snapshot and its own worker thread, which drains every
queued request into one batch for backends/local/sampler.py, so sampling overlaps training.

CPU threads: torch's intra-op pool is OpenMP (libgomp), whose idle threads busy-wait. A thread team that
fits the cores spins at every barrier, and when other processes hold the cores (a shared machine) each
tiny op waits out a preempted partner: on the tiny model with 2 threads on 2 loaded cores, 0.3-1.9 s for a
16-token sample instead of 0.02-0.07 s single-threaded. A sampler that ran while another worker's team
existed looked fast, because libgomp stops spinning once its threads outnumber the cores: hence "the
base-model client is slow, snapshots are fast" (the base client ran alone). Sampling threads on the CPU
therefore run single-threaded (SAMPLER_CPU_THREADS), and every worker thread sets its own count at start,
because torch.set_num_threads also changes the count that threads starting later inherit.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from backends.base import BackendError, CustomLossFn, Future, SamplingClient, TrainingClient
from backends.errors import UserError
from backends.local import batching
from backends.local import model as M
from backends.local.alloc import keep_freed_memory
from backends.local.attention import available as flex_available
from backends.local.device import place
from backends.local.loss_math import batch_loss, resolve_config, trained_positions
from backends.local.options import LocalOptions
from backends.local.packed import PackedLM
from backends.local.sampler import Sampler, SampleRequest
from backends.local.transfer import to_device
from backends.local.worker import Call, Job, Worker, fail
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

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")
A = TypeVar("A")

# At import, before this process starts the threads that torch, tokenizers and the workers bring: glibc fixes
# the malloc arena count when a second thread first allocates, so a limit set later has no effect.
keep_freed_memory()

# Intra-op threads of a sampling worker on the CPU. Tiny model, 2 cores loaded by other processes, 1-128 rows
# x 32 tokens: 1 thread 36-255 ms; 2 threads 1.0-2.8 s (libgomp spinning), or 39-373 ms with spinning off
# (OMP_WAIT_POLICY=PASSIVE). Decode steps are too small to split; a large model on many idle cores may
# want more.
SAMPLER_CPU_THREADS = 1
_default_threads: list[int] = []  # torch's intra-op thread count when the first backend was made


def _user_error(message: str) -> BackendError:
    return BackendError(message, user_error=True)


def _pin_threads(n: int) -> Callable[[], None]:
    """A worker's on_start: this thread uses n intra-op threads, whatever other workers set."""

    def pin() -> None:
        torch.get_num_threads()  # torch's lazy per-thread init runs now, so it cannot undo the next line later
        # Always, even when the count is already n: torch.set_num_threads also switches MKL's dynamic thread
        # choice off for the whole process, and MKL then splits some matmuls (sums over a batch's tokens, as in
        # a LoRA weight gradient) differently. Called only by the samplers, that switch happened whenever the
        # first sampler thread started, and training results depended on it (tests/test_local_backend.py).
        torch.set_num_threads(n)

    return pin


class LocalBackend:
    """model: "tiny", a Hugging Face model folder, or a hub id in the local cache. Checkpoints go under
    storage_dir/weights/<name> (save_state) and storage_dir/sampler_weights/<name>."""

    def __init__(self, cfg: LocalOptions, model: str, tokenizer: str | None, storage_dir: Path, seed: int = 0):
        self.cfg = cfg
        self.model_name = model
        # UserError now, not at the first request; a hub id downloads here on first use (backends/hub.py).
        self.model_dir = M.resolve_model_dir(model, cfg.local_files_only)
        self.tokenizer_dir = M.resolve_tokenizer_dir(tokenizer, cfg.local_files_only) if tokenizer else self.model_dir
        self.storage_dir = Path(storage_dir).resolve()
        self.seed = seed
        # Device and dtypes of every tensor the clients create: decided once, in backends/local/device.py.
        self.placement = place(cfg, self.model_dir)
        self.device, self.dtype = self.placement.device, self.placement.dtype
        if cfg.attention == "flex" and (self.device.type != "cuda" or not flex_available()):
            raise UserError(f'backend.attention = "flex" needs CUDA and a torch with FlexAttention (device here: '
                            f'{self.device.type}; FlexAttention has no CPU backward): use "auto" or "sdpa"')
        keep_freed_memory()  # no page faults re-fetching each step's activations (backends/local/alloc.py)
        if not _default_threads:  # before any sampling worker has changed the inherited count
            _default_threads.append(torch.get_num_threads())
        self.train_threads = _pin_threads(_default_threads[0])
        self.sample_threads = _pin_threads(SAMPLER_CPU_THREADS) if self.device.type == "cpu" else self.train_threads
        # Training keeps its thread count whatever the samplers do: on this project's Xeon (MKL), a LoRA
        # weight gradient (a matmul that sums over the batch's tokens) gives other bits on 1 thread than on 2,
        # so the CoreShare of before (training took a thread fewer while a sampler decoded) made RL runs of one
        # seed differ from each other once sampling and training overlapped by chance (rl_basic: three runs,
        # three final test rewards). With a fixed count they repeat exactly (tests/test_local_backend.py).
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._base: torch.nn.Module | None = None
        self._lock = threading.Lock()
        self._client_ids = itertools.count()
        self._sampler_ids = itertools.count()
        # Model loading and client creation run here, so create_* return at once like every other call.
        self._worker: Worker[Call] = Worker("local-backend", on_start=self.train_threads)
        self._workers: weakref.WeakSet[Worker[Call] | Worker[Request]] = weakref.WeakSet()

    # ---------------------------------------------------------------- service API

    def get_tokenizer(self) -> Tokenizer:
        with self._lock:
            tok = self._tokenizer
            if tok is None:
                import transformers

                try:
                    tok = transformers.AutoTokenizer.from_pretrained(self.tokenizer_dir)
                except Exception as exc:  # a folder without a usable tokenizer is the user's
                    raise UserError(f"cannot load a tokenizer from {self.tokenizer_dir}: {exc}") from exc
                self._tokenizer = tok
            return tok

    def checkpoint_ttl_seconds(self) -> int | None:
        return None  # checkpoints are files in the run dir: they live as long as it does

    def create_training_client(self, spec: LoraSpec) -> Future[TrainingClient]:
        return self._worker.submit("create_training_client", lambda: self._new_training_client(spec, None, False))

    def create_training_client_from_state(
        self, path: str, spec: LoraSpec, with_optimizer: bool = True
    ) -> Future[TrainingClient]:
        return self._worker.submit(
            "create_training_client_from_state", lambda: self._new_training_client(spec, Path(path), with_optimizer)
        )

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> Future[SamplingClient]:
        return self._worker.submit("create_sampling_client", lambda: self._new_sampling_client(model_path, base_model))

    def close(self, status: str = "success") -> None:
        self._worker.close()
        for worker in list(self._workers):
            worker.close()

    # ---------------------------------------------------------------- internals (backend worker thread)

    def base(self) -> M.HFModel:
        """The frozen base model, loaded once and never modified (every client copies it)."""
        if self._base is None:
            self._base = M.load_base(self.model_dir, self.device, self.dtype)
        return self._base

    def vocab_size(self) -> int:
        return M.vocab_size(self.base())

    def _check_base_model(self, name: str) -> None:
        if name not in (self.model_name, str(self.model_dir)):
            raise _user_error(f"this local backend serves model {self.model_name!r}, not {name!r}")

    def _setup(self, spec: LoraSpec) -> M.TrainSetup:
        if self.cfg.full_finetune or spec.rank == 0:
            return M.TrainSetup(0, self.cfg.lora_alpha, ())
        targets = M.lora_targets(self.base(), spec.train_attn, spec.train_mlp, spec.train_unembed)
        return M.TrainSetup(spec.rank, self.cfg.lora_alpha, targets)

    def _new_training_client(self, spec: LoraSpec, state: Path | None, with_optimizer: bool) -> LocalTrainingClient:
        self._check_base_model(spec.base_model)
        index = next(self._client_ids)
        setup = self._setup(spec)
        meta = None
        if state is not None:
            try:
                meta = M.read_state_meta(state)
            except ValueError as exc:
                raise _user_error(str(exc)) from None
            if meta["base_model"] != self.model_name:
                raise _user_error(f"checkpoint {state} is for model {meta['base_model']!r}, not {self.model_name!r}")
            saved = M.setup_from_meta(meta)
            if saved != setup:
                raise _user_error(
                    f"checkpoint {state} was trained with rank={saved.rank}, lora_alpha={saved.lora_alpha} and "
                    f"{len(saved.targets)} adapted layers; this recipe asks for rank={setup.rank}, "
                    f"lora_alpha={setup.lora_alpha}, {len(setup.targets)} layers"
                )
        # seed=None is a random init on Tinker; here it derives from the backend seed so runs repeat.
        seed = spec.seed if spec.seed is not None else self._client_seed(index)
        client = LocalTrainingClient(self, M.make_trainable(self.base(), setup, seed), setup, f"train-{index}")
        if state is not None:
            M.load_weights(state, client.model)
            if with_optimizer:
                assert meta is not None  # read above whenever state is given
                M.load_optimizer(state, client.optimizer)
                client.step = int(meta["step"])
        return client

    def _new_sampling_client(self, model_path: str | None, base_model: str | None) -> LocalSamplingClient:
        if model_path is None and base_model is None:
            raise _user_error("create_sampling_client needs model_path or base_model")
        if model_path is None:
            assert base_model is not None  # one of the two, checked above
            self._check_base_model(base_model)
            return self.sampling_client(self.base(), "base")  # the base is never modified: no copy needed
        path = Path(model_path)
        if (path / M.STATE_FILE).is_file():  # a save_state folder works too
            meta = M.read_state_meta(path)
            setup = M.setup_from_meta(meta)
            trained = M.make_trainable(self.base(), setup, 0)
            M.load_weights(path, trained)
            return self.sampling_client(M.sampling_snapshot(trained, self.base(), self.merge_samplers()), path.name)
        if (path / "adapter_config.json").is_file():
            trained = M.load_adapter(self.base(), path)
            # The same sampler a training client's snapshot gets (merged or not, dtypes by device.py); a folder
            # it does not recognise (modules_to_save, DoRA, ...) is merged by peft into a private copy.
            return self.sampling_client(
                M.sampling_snapshot(trained, self.base(), self.merge_samplers(), private=True), path.name)
        if (path / "config.json").is_file():  # a full fine-tune's sampler weights
            return self.sampling_client(M.load_base(path, self.device, self.dtype), path.name)
        raise _user_error(f"{model_path} is not a sampler-weights or checkpoint folder")

    def merge_samplers(self) -> bool:
        """Whether a LoRA sampling client gets merged weights (Local.sampler_weights): "auto" merges on the CPU
        in float32 for a base under 1 GiB, where a copy of the adapted weights is cheap and the decode fast path
        is fastest on merged ones; on a GPU, for a larger base, or in bfloat16 (where W + s B A rounded to 8 bits
        of mantissa loses most of a small update, and the sampler would disagree with the trainer), clients share
        the base and apply their float32 adapters unmerged."""
        mode = self.cfg.sampler_weights
        if mode != "auto":
            return mode == "merged"
        size = sum(p.numel() * p.element_size() for p in self.base().parameters())
        return self.device.type == "cpu" and self.dtype == torch.float32 and size < (1 << 30)

    def _client_seed(self, index: int) -> int:
        """The seed of the backend's index-th training (or sampling) client: derived from the backend's seed so runs
        repeat; modulo 2**63, as torch takes a signed 64-bit seed and any recipe seed up to 2**63 - 1 is valid."""
        return (self.seed * 1000 + index) % 2**63

    def sampling_client(self, model: torch.nn.Module, name: str) -> LocalSamplingClient:
        # Unseeded samples draw from a generator seeded per client, so a rerun repeats them too.
        seed = self._client_seed(next(self._sampler_ids))
        client = LocalSamplingClient(
            model, self.get_tokenizer(), self.device, name, seed, self.sample_threads
        )
        self._workers.add(client._worker)
        return client

    def new_checkpoint_dir(self, kind: str, name: str) -> Path:
        if not name or name in (".", "..") or "/" in name or os.sep in name:
            raise _user_error(f"checkpoint name {name!r} must be a plain, non-empty file name")
        path = self.storage_dir / kind / name
        if path.exists():
            raise _user_error(f"checkpoint {path} already exists; checkpoints are never overwritten")
        return path


def _write_atomically(final: Path, write: Callable[[Path], None]) -> str:
    """Write into a temporary sibling folder, then rename: a crash never leaves a half checkpoint."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    write(tmp)
    tmp.rename(final)
    return str(final)


class LocalTrainingClient:
    """Every method returns a Future at once; one worker thread runs the calls in order."""

    def __init__(self, backend: LocalBackend, model: torch.nn.Module, setup: M.TrainSetup, name: str):
        self._backend = backend
        self.model = model
        self.setup = setup
        self.step = 0
        self._params = M.trainable_params(model)
        # The padding-free path where the model allows it (backends/local/packed.py), else padded chunks.
        self.packed, why = PackedLM.build(model) if backend.cfg.packed else (None, "")
        if self.packed is not None:
            self.packed.attention = backend.cfg.attention
        elif backend.cfg.attention == "flex":
            # FlexAttention is the packed path's only: the padded chunks would silently run SDPA instead.
            raise _user_error(f'backend.attention = "flex" runs on the packed path, which this model does not take '
                              f'({why}): use attention = "auto" or "sdpa"')
        # Hyper-parameters are set from AdamParams at every step; these are placeholders.
        self.optimizer = torch.optim.AdamW([p for _, p in self._params], lr=0.0)
        self.name = name
        self._counter = itertools.count(1)
        self._worker: Worker[Call] = Worker(name, on_start=backend.train_threads, persistent=True)
        backend._workers.add(self._worker)

    def _submit(self, what: str, fn: Callable[[], T]) -> Future[T]:
        return self._worker.submit(f"{what} #{next(self._counter)}", fn)

    # ---------------------------------------------------------------- protocol

    def forward(
        self, data: list[Datum], loss_fn: LossFn, loss_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]:
        data = list(data)
        return self._submit("forward", lambda: self._run_loss(data, loss_fn, loss_config, backward=False))

    def forward_backward(
        self, data: list[Datum], loss_fn: LossFn, loss_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]:
        data = list(data)
        return self._submit(
            "forward_backward", lambda: self._run_loss(data, loss_fn, loss_config, backward=True)
        )

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        data = list(data)
        return self._submit("forward_backward_custom", lambda: self._run_custom(data, loss_fn))

    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]:
        return self._submit("optim_step", lambda: self._optim_step(params))

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return self._submit("save_state", lambda: self._save_state(name))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return self._submit("save_weights_for_sampler", lambda: self._save_sampler(name))

    def save_weights_and_get_sampling_client(self) -> Future[SamplingClient]:
        # The snapshot is taken when this job runs, i.e. at this point of the FIFO.
        return self._submit("save_weights_and_get_sampling_client", self._snapshot)

    def trained_weights(self) -> Future[dict[str, torch.Tensor]]:
        """CPU copies of the trainable weights at this point of the FIFO (`runner serve` keeps them to rebuild a
        sampler it has freed: M.write_weights_only + LocalBackend.create_sampling_client)."""
        return self._submit("trained_weights", lambda: {n: p.detach().to("cpu", copy=True) for n, p in self._params})

    # ---------------------------------------------------------------- jobs (worker thread)

    def _validate(self, data: list[Datum], loss_fn: LossFn | None) -> None:
        if not data:
            raise _user_error("no data")
        # The model's positions, as the sampler refuses a longer sequence (a datum past them trained a RoPE model
        # at positions it never saw and crashed one with learned positions).
        context = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        for i, d in enumerate(data):
            try:
                if loss_fn is not None:
                    d.check_for(loss_fn)
            except ValueError as exc:
                raise _user_error(f"datum {i}: {exc}") from None
            if isinstance(context, int) and d.length > context:
                raise _user_error(f"datum {i}: {d.length} tokens exceed the model's context of {context}")
        try:
            batching.check_tokens(data, self._backend.vocab_size())
        except ValueError as exc:
            raise _user_error(str(exc)) from None

    def _logprobs(self, data: list[Datum], trained: list[np.ndarray | None] | None = None):
        budget = batching.chunk_tokens(self._backend.vocab_size())
        if self.packed is not None:
            budget = self.packed.token_budget(self._backend.vocab_size())
            return self.packed.chunk_logprobs(data, budget, self._backend.device, trained)
        return batching.chunk_logprobs(self.model, data, self._backend.device, budget)

    @contextlib.contextmanager
    def _grads_kept_on_failure(self) -> Iterator[None]:
        """A forward_backward that fails part-way (out of memory at its third chunk, a custom loss raising after
        its backward began) leaves the gradients as they were before it: its chunks' backward passes have already
        added to .grad, and the next optim_step would apply that part of a batch (a failed request must not
        change the client: backends/local/worker.py). Free when no gradient is pending (the usual fb, optim_step
        order: they go back to None); else the pending ones are copied first (the adapters' size for LoRA, the
        whole gradient for a full fine-tune)."""
        saved = {id(q): q.grad.clone() for _, q in self._params if q.grad is not None}
        try:
            yield
        except BaseException:
            for _, q in self._params:
                q.grad = saved.get(id(q))
            raise

    def _run_loss(
        self, data: list[Datum], loss_fn: LossFn, loss_config: Mapping[str, float] | None, backward: bool
    ) -> ForwardBackwardOutput:
        try:
            config = resolve_config(loss_fn, loss_config)
        except ValueError as exc:
            raise _user_error(str(exc)) from None
        self._validate(data, loss_fn)
        device = self._backend.device
        order: list[int] = []  # datum indices in the order their logprobs were computed
        parts: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        with torch.set_grad_enabled(backward), (self._grads_kept_on_failure() if backward else contextlib.nullcontext()):
            trained = [trained_positions(loss_fn, d, config) for d in data] if backward else None
            for idx, lps in self._logprobs(data, trained):
                loss = batch_loss(loss_fn, lps, [data[i] for i in idx], device, config)
                if backward:
                    loss.backward()  # per chunk: grads accumulate in .grad, activations are freed
                losses.append(loss.detach().reshape(1))
                order += idx
                parts += [lp.detach().reshape(-1) for lp in lps]
        # One copy to the host for the whole batch, after the last chunk: a copy per datum (or a float() per
        # chunk) waits for the device each time. The chunks' losses are summed on the host in chunk order, as
        # before (the same float64 sum).
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
        total = 0.0
        for x in (torch.cat(losses) if len(losses) > 1 else losses[0]).cpu().tolist():
            total += x
        logprobs: list[np.ndarray] = [np.empty(0)] * len(data)
        start = 0
        for i in order:
            shape = data[i].target_tokens.shape
            logprobs[i] = flat[start:start + data[i].target_tokens.size].reshape(shape)
            start += data[i].target_tokens.size
        return ForwardBackwardOutput(logprobs, {"loss:sum": total})

    def _run_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> ForwardBackwardOutput:
        """ONE autograd pass: logprobs with grad -> user loss -> backward through the model.

        The SDK (docs/losses.md, custom losses) runs a forward pass, differentiates the loss w.r.t. the logprobs on
        the client (g = dloss/dlogprobs), then a second forward+backward of the linear surrogate
        sum(g * logprobs) (cross_entropy with weights -g): the same weight gradient, ~1.5x the FLOPs,
        and its logprobs are recomputed. Here the graph of the first pass is kept instead; the price
        is activation memory for the whole batch at once. Metrics are reported as the SDK does.
        """
        self._validate(data, None)
        device = self._backend.device
        model_lps: list[torch.Tensor] = [torch.empty(0)] * len(data)
        with torch.enable_grad(), self._grads_kept_on_failure():
            for idx, lps in self._logprobs(data):
                for i, lp in zip(idx, lps):
                    model_lps[i] = lp
            # The user's function sees float32 CPU leaves, as with the SDK (so SDK-written losses run as is). One
            # copy to the host for the batch, not one (and a wait for the device) per datum.
            flat = torch.cat([lp.detach().reshape(-1) for lp in model_lps]).cpu()
            leaves = [x.view(lp.shape).clone().requires_grad_(True)
                      for x, lp in zip(flat.split([lp.numel() for lp in model_lps]), model_lps)]
            loss, metrics = loss_fn(data, leaves)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise _user_error("the custom loss must return (scalar torch tensor, metrics dict)")
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            for i, g in enumerate(grads):
                if g is None:  # the SDK fails the same way ("No gradient computed for logprob tensor")
                    raise _user_error(f"the custom loss does not depend on the logprobs of datum {i}")
            torch.autograd.backward(model_lps, grad_tensors=to_device([g.numpy() for g in grads], device))
        surrogate = sum(float((g.double() * lp.detach().double()).sum()) for g, lp in zip(grads, leaves))
        out_metrics = {**{k: float(v) for k, v in metrics.items()}, "loss:sum": float(loss.detach().sum())}
        out_metrics["surrogate_loss:sum"] = surrogate
        return ForwardBackwardOutput([lp.detach().numpy() for lp in leaves], out_metrics)

    def _optim_step(self, p: AdamParams) -> OptimStepOutput:
        if p.learning_rate < 0 or not (0 <= p.beta1 < 1 and 0 <= p.beta2 < 1) or p.eps < 0 or p.weight_decay < 0:
            raise _user_error(f"invalid AdamParams {p}")
        for group in self.optimizer.param_groups:
            group.update(lr=p.learning_rate, betas=(p.beta1, p.beta2), eps=p.eps, weight_decay=p.weight_decay)
        with_grad = [q for _, q in self._params if q.grad is not None]
        norm = 0.0
        if with_grad:
            total = torch.nn.utils.get_total_norm([q.grad for q in with_grad if q.grad is not None])  # pre-clip
            norm = float(total)
            if p.grad_clip_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(with_grad, p.grad_clip_norm, total)
        # A parameter without a gradient (no forward_backward since the last step) is left alone, as
        # torch AdamW does: its moments do not decay.
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return OptimStepOutput({"grad_norm:mean": norm, "lr:mean": p.learning_rate})

    def _snapshot(self) -> LocalSamplingClient:
        snap = M.sampling_snapshot(self.model, self._backend.base(), self._backend.merge_samplers())
        return self._backend.sampling_client(snap, f"{self.name}-step{self.step}")

    def _save_state(self, name: str) -> str:
        path = self._backend.new_checkpoint_dir("weights", name)
        return _write_atomically(
            path, lambda tmp: M.write_state(tmp, self.model, self.optimizer, self.setup, self._backend.model_name, self.step)
        )

    def _save_sampler(self, name: str) -> str:
        path = self._backend.new_checkpoint_dir("sampler_weights", name)
        return _write_atomically(path, lambda tmp: M.write_sampler_weights(tmp, self.model))


@dataclass(frozen=True, slots=True)
class LogprobsRequest:
    """A sampling client's `compute_logprobs` call: one job of its worker, as a SampleRequest is a `sample` call."""

    tokens: list[int]


Request = SampleRequest | LogprobsRequest  # a sampling worker's job


def _sample_request(job: Job[Request]) -> SampleRequest:
    assert isinstance(job.payload, SampleRequest), job.request  # _admit sorts the jobs by kind
    return job.payload


def _logprobs_request(job: Job[Request]) -> list[int]:
    assert isinstance(job.payload, LogprobsRequest), job.request
    return job.payload.tokens


class LocalSamplingClient:
    """An immutable model snapshot behind one worker thread that batches all queued requests, waiting a few
    ms for requests that are likely on their way (backends/local/worker.py, Worker._gather).

    Determinism: a request with a seed gets the same tokens and logprobs, bit for bit, whatever it is batched
    with (the engine seeds sample k of a request from seed + k, and on the CPU its forwards are batch-invariant:
    see decoding.ROW_QUANTUM; on CUDA only float noise from the batch's shapes can differ). Unseeded
    requests draw from this client's one generator in batch order, so which numbers they get depends on how
    requests happened to be coalesced, i.e. on timing: seed every request that must repeat.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        device: torch.device,
        name: str,
        seed: int,
        on_start: Callable[[], None] | None = None,
    ):
        self.model = model
        self._vocab = M.vocab_size(model)
        self._sampler = Sampler(model, tokenizer, device, seed=seed)
        self._counter = itertools.count(1)
        self._worker: Worker[Request] = Worker(f"sample-{name}", self._handle, drain=True, coalesce=True, on_start=on_start)

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        job = SampleRequest(list(prompt), num_samples, params)
        return self._worker.submit(f"sample #{next(self._counter)}", job)

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        return self._worker.submit(f"compute_logprobs #{next(self._counter)}", LogprobsRequest(list(tokens)))

    def _handle(self, jobs: list[Job[Request]]) -> None:
        self._stream(self._admit(jobs), jobs)

    def _admit(self, jobs: list[Job[Request]]) -> list[Job[Request]]:
        """The valid ones of `jobs`: their logprob requests run now (one forward pass, so their callers go on while
        the samples decode); their sample requests are returned, to decode."""
        valid = [job for job in jobs if self._check(job)]
        self._run([j for j in valid if isinstance(j.payload, LogprobsRequest)], self._sampler.compute_logprobs_batch,
                  _logprobs_request)
        return [j for j in valid if isinstance(j.payload, SampleRequest)]

    def _stream(self, samples: list[Job[Request]], jobs: list[Job[Request]]) -> None:
        """The sample jobs through Sampler.sample_stream: jobs submitted while they decode join the running
        batch (continuous batching; logprob jobs among them run at once), and each job's future is set as soon
        as its samples finish. On a failure that is no one request's (ValueError: that request's alone), the
        unfinished jobs are retried one by one, as a failed batch is."""
        if not samples:
            return
        order = list(samples)  # sample_stream's request numbers -> jobs

        def more() -> list[SampleRequest]:
            got = self._admit(self._worker.poll(jobs))
            order.extend(got)
            return [_sample_request(j) for j in got]

        def done(i: int, out: SampleOutput | ValueError) -> None:
            if isinstance(out, ValueError):
                fail(order[i], _user_error(str(out)))
            else:
                order[i].future.set_result(out)

        try:
            self._sampler.sample_stream([_sample_request(j) for j in samples], more, done)
        except Exception:  # noqa: BLE001 - retried below, one request at a time
            for j in order:
                if not j.future.done():
                    self._run([j], self._sampler.sample_batch, _sample_request)

    def _check(self, job: Job[Request]) -> bool:
        request = job.payload
        tokens = request.prompt if isinstance(request, SampleRequest) else request.tokens
        bad = [t for t in tokens if not 0 <= t < self._vocab]  # ~30 us for 2k tokens
        problem = (
            "empty prompt" if not tokens
            else f"token id {bad[0]} outside the model's vocab [0, {self._vocab})" if bad
            else "num_samples must be >= 1" if isinstance(request, SampleRequest) and request.num_samples < 1
            else None
        )
        if problem is not None:
            fail(job, _user_error(problem))
        return problem is None

    @staticmethod
    def _run(jobs: list[Job[Request]], batch_fn: Callable[[list[A]], Sequence[object]], arg: Callable[[Job[Request]], A]) -> None:
        if not jobs:
            return
        try:
            results = batch_fn([arg(j) for j in jobs])
        except Exception as exc:  # noqa: BLE001 - retry one by one so a bad request fails only itself
            if len(jobs) == 1:  # the sampler raises ValueError on bad input
                fail(jobs[0], _user_error(str(exc)) if isinstance(exc, ValueError) else exc)
                return
            for j in jobs:
                LocalSamplingClient._run([j], batch_fn, arg)
            return
        for j, r in zip(jobs, results, strict=True):
            j.future.set_result(r)
