"""Batched generation with a KV cache for a plain HF causal LM: the local backend's sampling engine.

One `sample_batch` call decodes every row of every request together. Prompts are left-padded (attention
mask plus per-row position ids, so padding changes nothing), the prompt runs once to fill the KV cache,
then each step feeds one token per row. Every row keeps its own temperature, top-k, top-p, stop rule and
token budget. Rows that finish are dropped from the batch, cache included, once enough have piled up.

Speed comes from doing less per step than `model.generate`: the cache is preallocated and written in
place (no torch.cat per layer per step), the decode-step attention mask is a slice of a prebuilt
buffer (HF passes 4-D masks through untouched), top-k/top-p touch only the rows that ask for them,
and a sampling step is one cumsum + searchsorted over the batch.

Llama, Mistral, Qwen2 and Qwen3 decoders take a faster path (llama.LlamaDecoder): the same layers on plain
tensors instead of HF's modules, with (on the CPU) their matmul weights in the layouts MKL and oneDNN run
fastest, prompt tokens packed without padding for the prefill, and no per-step module or cache machinery. On
CUDA its decode steps run at static shapes and replay as CUDA graphs (static_decode.py). Every other model (or
attention variant) decodes through HF's modules, as the rest of this file does. bench/bench_sampling.py
measures them against `model.generate`; the ratios are in bench/README.md.

A request with num_samples = n prefills its prompt once (each distinct prompt of a batch once) and copies its
KV to its n rows. `sample_stream` (what the local sampling client calls) adds continuous batching: requests
that arrive while a batch decodes join it at a step boundary, and each is delivered as soon as it finishes.
docs/local-backend.md has the whole picture.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from backends.local.device import LOGITS_DTYPE
from backends.local.llama import DecodeCache, LlamaDecoder, Slots
from backends.local.static_decode import StaticBatch, StaticDecoder, capacity_bucket, row_bucket
from backends.types import SampledSequence, SampleOutput, SamplingParams, StopReason

# Logit entries (rows x length x vocab) one compute_logprobs_batch forward may produce.
_LOGPROB_BUDGET = 1 << 26


# Batch invariance: a request's samples and logprobs are bit-identical whatever else shares its batch, so a
# seeded run repeats exactly however the worker happened to coalesce requests (an RL run resumed after a
# kill gives the uninterrupted run's metrics). Measured on CPU (MKL, torch 2.13, one thread, which is how
# the local backend runs its samplers): every row of a matmul is the same whenever the row count is a
# multiple of 4 (fewer rows, or the 1-3 rows past the last multiple of 4, take other kernels); and sdpa's
# output for a query is the same for any key length that is a multiple of 16, with the real keys at the
# same slots and the rest masked. So every forward here has a multiple of _ROW_QUANTUM rows (finished or
# filler rows make up the count), and each row keeps its tokens at cache slots 0..n-1 (prompts
# right-padded, each row writing at its own next slot) under a key view rounded up to _KV_QUANTUM.
# tests/test_local_sampler.py checks it. Not promised on CUDA, where kernels are chosen per shape.
_ROW_QUANTUM = 4
_KV_QUANTUM = 16


def _round_up(n: int, q: int = _KV_QUANTUM) -> int:
    return -(-n // q) * q


class _GrowingLayer(DynamicLayer):
    """A full-attention KV cache layer over a preallocated buffer: `update` writes in place and returns a
    view. HF's DynamicLayer instead concatenates, copying the whole cache every step, and cannot give each
    row its own write position."""

    def __init__(self, capacity: int, slots: Slots):
        super().__init__()
        self.is_initialized = False  # set by DynamicLayer itself only in newer transformers
        self.capacity = capacity
        self.slots = slots
        self.filled = 0  # slots [0, filled) may hold data in some row

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        # Zeroed: masked slots are read (and multiplied by zero), so they must hold finite numbers.
        self.kbuf = key_states.new_zeros((b, h, self.capacity, dk))
        self.vbuf = value_states.new_zeros((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        s = self.slots
        if s.write is None:
            n = key_states.shape[-2]
            if n > self.capacity:
                raise RuntimeError(f"KV cache overflow: {n} > {self.capacity}")
            self.kbuf[:, :, :n] = key_states
            self.vbuf[:, :, :n] = value_states
            self.filled = max(self.filled, n)
        else:
            self.kbuf[s.rows, :, s.write] = key_states[:, :, 0]
            self.vbuf[s.rows, :, s.write] = value_states[:, :, 0]
            self.filled = max(self.filled, s.view)
        self.keys, self.values = self.kbuf[:, :, : s.view], self.vbuf[:, :, : s.view]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        # HF derives the prefill's causal mask from this (0 then); decode steps pass their own 4-D mask.
        return self.filled

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        # Copy only the filled prefix: capacity is sized for max_tokens, which rows often never reach.
        end = self.filled
        for name in ("kbuf", "vbuf"):
            old = getattr(self, name)
            new = old.new_zeros((len(indices), *old.shape[1:]))
            new[:, :, :end] = old[:, :, :end].index_select(0, indices)
            setattr(self, name, new)
        self.keys, self.values = self.kbuf[:, :, : self.slots.view], self.vbuf[:, :, : self.slots.view]


@dataclass
class _Row:
    """One sample being generated: request `req`, sample `index` of it."""

    req: int
    index: int
    prompt: list[int]
    params: SamplingParams
    limit: int  # new tokens allowed: max_tokens, capped by the model's context
    stop_ids: frozenset[int]
    stop_strs: tuple[str, ...]
    window: int  # trailing tokens to decode when looking for a stop string
    gen: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reason: StopReason | None = None  # set once the row finishes
    start: int = 0  # the decode step of its first token (a row that joined a running batch: later than 0)


class Sampler:
    """Generates for a batch of requests with one model; not thread-safe (the backend calls it from one worker)."""

    def __init__(self, model, tokenizer, device: torch.device, seed: int = 0):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.gen = torch.Generator(device=self.device)
        self.gen.manual_seed(seed)
        cfg = model.config.get_text_config(decoder=True)
        self.config = cfg
        self.vocab = model.get_input_embeddings().num_embeddings
        self.max_context: int | None = getattr(cfg, "max_position_embeddings", None)
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) and 0 <= pad < self.vocab else 0
        self.attn_impl = getattr(cfg, "_attn_implementation", None)
        self.keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns on every call until 5.40).
        self.cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # The weights' dtype (backends/local/device.py Placement.dtype): the KV cache's too; logits go to LOGITS_DTYPE.
        self.dtype = next(model.parameters()).dtype
        # KV cache bytes one decode batch may hold; rows beyond it run in further batches. None: 2 GiB on
        # CPU, half the free memory on CUDA (measured per call).
        self.cache_budget: int | None = None
        # The plain-tensor decode path for Llama-family models (None: HF's modules decode). On the CPU its
        # transposed weights pay off (MKL); on CUDA it decodes through static_decode.py's CUDA graphs.
        self.fast: LlamaDecoder | None = LlamaDecoder.of(model) if self.device.type in ("cpu", "cuda") else None
        # Decode the fast path's steps at static shapes (static_decode.py): None = where they replay as CUDA
        # graphs (CUDA); True forces it (on the CPU it runs eagerly: what the tests compare), False never.
        self.static_decode: bool | None = None
        self.cuda_graphs = True  # capture the static steps on CUDA (False: the same shapes, eagerly)
        self._static: StaticDecoder | None = None
        # Prefill each distinct prompt once and copy its KV to every row sampling it (False: one prefill per
        # row, the reference the shared prefill is tested and benched against; same bits on the CPU).
        self.share_prefill = True

    # ------------------------------------------------------------------ public

    def sample_batch(self, requests: list[tuple[list[int], int, SamplingParams]]) -> list[SampleOutput]:
        rows = [row for i, req in enumerate(requests) for row in self._rows(i, *req)]
        with torch.inference_mode():
            for chunk in self._chunks(rows):
                self._generate(chunk)
        out: list[list[SampledSequence]] = [[] for _ in requests]
        for r in rows:
            out[r.req].append(SampledSequence(r.tokens, r.logprobs, r.reason or "length"))
        return [SampleOutput(sequences=s) for s in out]

    def sample_stream(
        self,
        requests: list[tuple[list[int], int, SamplingParams]],
        more: Callable[[], list[tuple[list[int], int, SamplingParams]]],
        done: Callable[[int, SampleOutput | ValueError], None],
    ) -> None:
        """sample_batch with continuous batching, for a worker whose requests keep arriving. Requests are numbered
        in arrival order: `requests`, then each list `more()` returns (it is called at every decode step and
        must not block). On the fast path a request that arrives while a batch decodes joins it at the next step
        boundary when its rows fit the batch's KV capacity and cache budget (it takes finished rows' slots
        first); otherwise it runs in the next batch. `done(i, result)` is called once per request as soon as all
        its samples are finished: its SampleOutput, or the ValueError that makes it invalid. A request's tokens
        and logprobs are those sample_batch gives it (bit for bit on the CPU, seeded: batch invariance)."""
        pending: list[_Row] = []
        left: dict[int, list[_Row]] = {}  # request -> its rows, until all have finished
        count = 0

        def admit(reqs: list[tuple[list[int], int, SamplingParams]]) -> None:
            nonlocal count
            for req in reqs:
                i, count = count, count + 1
                try:
                    rows = self._rows(i, *req)
                except ValueError as exc:
                    done(i, exc)
                    continue
                left[i] = rows
                pending.extend(rows)

        def take(capacity: int, room: int) -> list[_Row]:
            """Whole pending requests, in arrival order, whose rows fit `capacity` slots and `room` rows."""
            admit(more())
            if room <= 0 or not pending:
                return []
            groups: dict[int, list[_Row]] = {}
            for r in pending:
                groups.setdefault(r.req, []).append(r)
            out: list[_Row] = []
            for rows in groups.values():
                if len(out) + len(rows) <= room and all(len(r.prompt) + r.limit <= capacity for r in rows):
                    out += rows
            if out:
                taken = {id(r) for r in out}
                pending[:] = [r for r in pending if id(r) not in taken]
            return out

        def finished(r: _Row) -> None:
            rows = left.get(r.req)
            if rows is None or any(x.reason is None for x in rows):
                return
            del left[r.req]
            done(r.req, SampleOutput(sequences=[SampledSequence(x.tokens, x.logprobs, x.reason or "length")
                                                for x in rows]))

        admit(requests)
        join = _Join(take, finished)
        with torch.inference_mode():
            while True:
                if not pending:
                    admit(more())
                    if not pending:
                        return
                chunk = self._chunks(pending)[0]
                del pending[: len(chunk)]
                self._generate(chunk, join)

    def compute_logprobs_batch(self, seqs: list[list[int]]) -> list[list[float | None]]:
        for s in seqs:
            self._check_tokens(s, "sequence")
            if self.max_context is not None and len(s) > self.max_context:
                raise ValueError(f"sequence of {len(s)} tokens exceeds the model's context of {self.max_context}")
        out: list[list[float | None]] = [[None] for _ in seqs]
        # Longest first, so each chunk pads little; right padding needs no mask: causal attention never
        # lets a real token see the pads after it.
        order = sorted((i for i in range(len(seqs)) if len(seqs[i]) > 1), key=lambda i: -len(seqs[i]))
        with torch.inference_mode():
            while order:
                n = max(1, _LOGPROB_BUDGET // (len(seqs[order[0]]) * self.vocab))
                chunk, order = order[:n], order[n:]
                width = _round_up(len(seqs[chunk[0]]))  # batch-invariant, see _ROW_QUANTUM
                ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
                for j, i in enumerate(chunk):
                    ids[j, : len(seqs[i])] = torch.tensor(seqs[i])
                ids = ids.to(self.device)
                logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1].to(LOGITS_DTYPE)
                lp = logits.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)
                for j, values in enumerate(lp.tolist()):
                    i = chunk[j]
                    out[i] += values[: len(seqs[i]) - 1]
        return out

    # ------------------------------------------------------------------ requests -> rows

    def _check_tokens(self, tokens: list[int], what: str) -> None:
        if len(tokens) == 0:
            raise ValueError(f"empty {what}")
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.vocab:
            raise ValueError(f"{what} token id {lo if lo < 0 else hi} outside the vocabulary [0, {self.vocab})")

    def _rows(self, req: int, prompt: list[int], num_samples: int, p: SamplingParams) -> list[_Row]:
        self._check_tokens(prompt, "prompt")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if p.max_tokens is None or p.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if not p.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {p.top_k}")
        limit = p.max_tokens
        if self.max_context is not None:
            if len(prompt) >= self.max_context:
                raise ValueError(f"prompt of {len(prompt)} tokens fills the model's context of {self.max_context}")
            limit = min(limit, self.max_context - len(prompt))
        stop_ids, stop_strs = self._stops(p.stop)
        window = max((len(s.encode()) for s in stop_strs), default=0) + 8
        rows = []
        for k in range(num_samples):
            gen = None
            if p.seed is not None:
                # Seeded from seed + sample index alone, so the sample is the same whatever shares the batch,
                # and sample k of a request seeded s is the one sample of a request seeded s + k (the RL
                # rollouts send a group's members as one request or one each: the same tokens either way).
                gen = torch.Generator(device=self.device)
                state = np.random.SeedSequence([(p.seed + k) % 2**63, 0]).generate_state(1, np.uint64)[0]
                gen.manual_seed(int(state) >> 1)
            rows.append(_Row(req, k, list(prompt), p, limit, stop_ids, stop_strs, window, gen))
        return rows

    def _stops(self, stop: str | list[str] | list[int] | None) -> tuple[frozenset[int], tuple[str, ...]]:
        if stop is None:
            return self.eos_ids, ()
        if isinstance(stop, str):
            stop = [stop]
        if all(isinstance(s, str) for s in stop):
            if any(s == "" for s in stop):
                raise ValueError("empty stop string")
            return frozenset(), tuple(str(s) for s in stop)
        ids = [s for s in stop if isinstance(s, int) and not isinstance(s, bool)]
        if len(ids) == len(stop):
            bad = [s for s in ids if not 0 <= s < self.vocab]
            if bad:
                raise ValueError(f"stop token id {bad[0]} outside the vocabulary [0, {self.vocab})")
            return frozenset(ids), ()
        raise ValueError("stop must be a list of strings or a list of token ids, not a mix")

    # ------------------------------------------------------------------ the decode loop

    def _budget_slots(self) -> int:
        """KV cache slots (rows x positions) one decode batch may hold: cache_budget's bytes."""
        budget = self.cache_budget
        if budget is None:
            budget = torch.cuda.mem_get_info(self.device)[0] // 2 if self.device.type == "cuda" else 2 << 30
        cfg = self.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return max(1, budget // (cfg.num_hidden_layers * 2 * heads * head_dim * self.dtype.itemsize))

    def _chunks(self, rows: list[_Row]) -> list[list[_Row]]:
        """Consecutive runs of rows whose KV cache (rows x (longest prompt + most steps)) fits the budget."""
        slots = self._budget_slots()
        static = self.fast is not None and self.attn_impl in ("sdpa", "eager") and self._static_decoder() is not None

        def size(k: int, length: int) -> int:
            if not static:
                return k * length
            # A static batch's rows and capacity are rounded up to buckets, and the smaller buckets' batches
            # it moves to as rows finish are kept too (at most as much again).
            return 2 * row_bucket(k) * capacity_bucket(length)

        chunks: list[list[_Row]] = []
        width = steps = 0
        for r in rows:
            width, steps = max(width, len(r.prompt)), max(steps, r.limit)
            if chunks and chunks[-1] and size(len(chunks[-1]) + 1, width + steps) <= slots:
                chunks[-1].append(r)
            else:  # a single row always runs, whatever its size
                chunks.append([r])
                width, steps = len(r.prompt), r.limit
        return chunks

    def _new_cache(self, capacity: int) -> tuple[DynamicCache, Slots | None]:
        """HF's cache for this model. When every layer is plain full attention under sdpa or eager attention,
        its layers become preallocated per-row-slot ones (the batch-invariant layout; returns their shared
        Slots); otherwise HF's own layers stay, prompts are left-padded, and the slots are None."""
        cache = DynamicCache(config=self.model.config)
        plain = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
        if not (plain and self.attn_impl in ("sdpa", "eager")):
            return cache, None
        slots = Slots()
        cache.layers = cast(Any, [_GrowingLayer(capacity, slots) for _ in cache.layers])
        return cache, slots

    def _prefill(self, prompts: list[list[int]], slots: Slots | None, cache: DynamicCache) -> torch.Tensor:
        """Runs the distinct prompts through the model into the cache; the next-token logits of each."""
        dev, lens = self.device, [len(p) for p in prompts]
        if slots is None:  # left padding: every prompt ends at the last column
            width = max(lens)
            ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for j, prompt in enumerate(prompts):
                ids[j, width - len(prompt) :] = torch.tensor(prompt)
                mask[j, width - len(prompt) :] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            pos = (mask.cumsum(1) - 1).clamp_(min=0)
            extra = {"logits_to_keep": 1} if self.keep_arg else {}
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{self.cache_kw: cache}, **extra
            )
            return out.logits[:, -1]
        # Right padding: prompt token i sits at slot i in every batch. Causal attention never lets a real
        # token see the pads after it, so no mask is needed.
        width = _round_up(max(lens))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        for j, prompt in enumerate(prompts):
            ids[j, : len(prompt)] = torch.tensor(prompt)
        ids = ids.to(dev)
        pos = torch.arange(width, device=dev).expand(len(prompts), width)
        slots.write, slots.view = None, width
        last = sorted({n - 1 for n in lens})
        extra = {"logits_to_keep": torch.tensor(last, device=dev)} if self.keep_arg else {}
        logits = self.model(input_ids=ids, position_ids=pos, use_cache=True, **{self.cache_kw: cache}, **extra).logits
        col = {p: (i if self.keep_arg else p) for i, p in enumerate(last)}
        return logits[torch.arange(len(prompts), device=dev), torch.tensor([col[n - 1] for n in lens], device=dev)]

    def _fast_prefill(self, fast: LlamaDecoder, prompts: list[list[int]], cache: DecodeCache) -> torch.Tensor:
        """_prefill's right-padded layout on the fast path: the next-token logits of each prompt."""
        width = _round_up(max(len(p) for p in prompts))
        cache.slots.view = width
        return fast.prefill(prompts, width, self.pad_id, cache, _ROW_QUANTUM)

    def _generate(self, rows: list[_Row], join: _Join | None = None) -> None:
        """Decodes `rows` to their ends. With `join` (sample_stream), each row is reported as it finishes, and
        on the fast path requests that arrive meanwhile join the batch at a step boundary (continuous batching)."""
        dev = self.device
        steps = max(r.limit for r in rows)
        # Already-finished filler rows make every forward's row count a multiple of _ROW_QUANTUM.
        rows = rows + [_filler(rows[0].prompt) for _ in range(_round_up(len(rows), _ROW_QUANTUM) - len(rows))]
        n = len(rows)
        fast = self.fast if self.attn_impl in ("sdpa", "eager") else None
        static = self._static_decoder() if fast is not None else None
        if static is not None:  # rows padded to a bucket instead: one captured graph per bucket
            rows = rows + [_filler(rows[0].prompt) for _ in range(row_bucket(len(rows)) - len(rows))]
            n = len(rows)
        # Each distinct prompt is prefilled once (RL asks for many samples of one prompt); its cache rows
        # are then copied to every sample of it. A row's KV is the same bits either way (see _ROW_QUANTUM).
        if self.share_prefill:
            distinct: dict[tuple[int, ...], int] = {}
            source = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows]
            prompts = [list(p) for p in distinct]
        else:
            source, prompts = list(range(n)), [r.prompt for r in rows]
        if fast is None:
            # HF's modules run one padded row per prompt: a multiple of _ROW_QUANTUM rows. The fast path
            # packs the prompts' tokens and rounds that count itself, so a lone prompt is prefilled once.
            prompts += [prompts[0]] * (_round_up(len(prompts), _ROW_QUANTUM) - len(prompts))
        longest = max(len(p) for p in prompts)
        capacity = _round_up(longest + steps) if static is None else capacity_bucket(longest + steps)
        # slots: the batch-invariant layout (see _ROW_QUANTUM), or None for HF's own cache, left-padded.
        cache: DynamicCache | DecodeCache
        batch: StaticBatch | None = None
        if fast is not None:
            slots = Slots()
            # A static batch's prefill needs only the prompts' slots; they are then copied into its cache.
            cache = fast.new_cache(len(prompts), capacity if static is None else _round_up(longest), slots)
            logits = self._fast_prefill(fast, prompts, cache)
        else:
            cache, slots = self._new_cache(capacity)
            logits = self._prefill(prompts, slots, cache)
        if static is not None:
            index = torch.tensor(source, device=dev)
            batch = static.batch(n, capacity)
            batch.load(cast(DecodeCache, cache), index)
            cache, logits = batch.cache, logits[index]
            slots = cache.slots
        elif source != list(range(len(prompts))):
            index = torch.tensor(source, device=dev)
            cache.batch_select_indices(index)
            logits = logits[index]
        # Which cache slots hold real tokens, per row.
        keys_ok = torch.zeros((n, capacity), dtype=torch.bool)
        for i, r in enumerate(rows):
            if slots is not None:
                keys_ok[i, : len(r.prompt)] = True
            else:
                keys_ok[i, longest - len(r.prompt) : longest] = True
        keys_ok = keys_ok.to(dev)
        next_pos = torch.tensor([[len(r.prompt)] for r in rows], device=dev)
        dtype = self.dtype
        valid: bool | float = True
        if slots is not None and fast is None and self.attn_impl == "eager":
            # eager attention adds its mask to the scores; sdpa takes the boolean one as is.
            additive = torch.zeros(keys_ok.shape, dtype=dtype, device=dev)
            keys_ok = additive.masked_fill_(~keys_ok, torch.finfo(dtype).min)
            valid = 0.0
        lp_buf = torch.zeros((n, steps), dtype=torch.float32, device=dev)
        live = list(range(n))  # batch slot -> row
        plan = _Plan(rows, live, logits.shape[-1], dev)
        if slots is not None:
            slots.rows = torch.arange(n, device=dev)
        # Requests may join only where each row's cache row is its own (the fast path), within the cache budget.
        joins = join is not None and fast is not None
        # (A static batch counts twice: the smaller buckets' batches are kept too; see _chunks.)
        max_rows = max(n, self._budget_slots() // (capacity * (1 if batch is None else 2))) if joins else n
        t = -1
        while t + 1 < steps:  # `steps` grows when a request joins
            t += 1
            tok, lp = plan.choose(logits.to(LOGITS_DTYPE), self.gen)
            lp_buf[plan.row_ids, t] = lp
            dead = 0
            ended: list[int] = []
            for i, tk in zip(live, tok.tolist()):
                r = rows[i]
                if r.reason is not None:
                    dead += 1
                    continue
                r.tokens.append(tk)
                if tk in r.stop_ids or (r.stop_strs and self._hit_stop_string(r)):
                    r.reason, dead = "stop", dead + 1
                elif len(r.tokens) >= r.limit:
                    r.reason, dead = "length", dead + 1
                if r.reason is not None:
                    ended.append(i)
            if join is not None and ended:  # reported now: their callers need not wait for the whole batch
                for i, lps_i in zip(ended, lp_buf[torch.tensor(ended, device=dev)].tolist()):
                    rows[i].logprobs = lps_i[rows[i].start : rows[i].start + len(rows[i].tokens)]
                for i in ended:  # after all their logprobs: siblings may end at the same step
                    join.finished(rows[i])
            if dead == len(live):
                break
            # Dropping finished rows copies the cache once; worth it once a quarter of the batch is idle (a
            # static batch: once the live rows fit a smaller bucket, whose batch they move to).
            target = _round_up(len(live) - dead, _ROW_QUANTUM) if batch is None else row_bucket(len(live) - dead)
            if (4 * dead >= len(live) or batch is not None) and target < len(live):
                keep = [s for s, i in enumerate(live) if rows[i].reason is None]
                keep += [s for s, i in enumerate(live) if rows[i].reason is not None][: target - len(keep)]
                keep.sort()
                index = torch.tensor(keep, device=dev)
                if batch is not None and static is not None:
                    smaller = static.batch(target, capacity)
                    smaller.load(batch.cache, index)
                    batch, cache = smaller, smaller.cache
                else:
                    cache.batch_select_indices(index)
                keys_ok, tok, next_pos = keys_ok[index], tok[index], next_pos[index]
                live = [live[s] for s in keep]
                plan = _Plan(rows, live, logits.shape[-1], dev)
                if slots is not None:
                    slots.rows = torch.arange(len(live), device=dev)
            attn: torch.Tensor | None = None  # the decode step's mask (a static batch reads keys_ok whole)
            if slots is not None:
                write = next_pos[:, 0]
                slots.write = write
                keys_ok[slots.rows, write] = valid
                if batch is None:  # a static batch attends over its whole capacity (no host sync for the view)
                    slots.view = min(capacity, _round_up(int(write.max()) + 1))
                    attn = keys_ok[:, None, None, : slots.view]
            else:
                keys_ok[:, longest + t] = True
                attn = keys_ok[:, : longest + t + 1].long()
            if batch is not None:
                logits = batch.step(tok, next_pos[:, 0], keys_ok[:, None, None])
            elif fast is not None:
                assert attn is not None
                logits = fast.step(tok, next_pos[:, 0], attn, cast(DecodeCache, cache))
            else:
                logits = self.model(
                    input_ids=tok[:, None],
                    attention_mask=attn,
                    position_ids=next_pos,
                    use_cache=True,
                    **{self.cache_kw: cache},
                ).logits[:, -1]
            next_pos += 1
            if not joins:
                continue
            # A finished row kept in the batch still writes each step; past the capacity it writes its last
            # slot again (its own row, never read for a live row). Live rows never get there.
            next_pos.clamp_(max=capacity - 1)
            assert join is not None and fast is not None
            free = [s for s, i in enumerate(live) if rows[i].reason is not None]
            new = join.take(capacity, max_rows - len(live) + len(free))
            if not new:
                continue
            # The joining rows' prefill (each distinct prompt once), then their slots: finished rows' first, then
            # new ones (a multiple of _ROW_QUANTUM, or the next bucket, topped up with finished fillers).
            distinct_new: dict[tuple[int, ...], int] = {}
            src = [distinct_new.setdefault(tuple(r.prompt), len(distinct_new)) for r in new]
            pre = fast.new_cache(len(distinct_new), _round_up(max(len(r.prompt) for r in new)), Slots())
            pre_logits = self._fast_prefill(fast, [list(p) for p in distinct_new], pre)
            targets = free[: len(new)]
            if len(new) > len(free):
                size = len(live) + len(new) - len(free)
                size = _round_up(size, _ROW_QUANTUM) if batch is None else row_bucket(size)
                add = size - len(live)
                new += [_filler(new[0].prompt) for _ in range(add - (len(new) - len(free)))]
                src += [src[0]] * (len(new) - len(src))
                if batch is not None and static is not None:
                    bigger = static.batch(size, capacity)
                    bigger.load(batch.cache, torch.arange(len(live), device=dev))
                    batch, cache = bigger, bigger.cache
                else:
                    cast(DecodeCache, cache).grow(add)
                keys_ok = torch.cat((keys_ok, keys_ok.new_zeros((add, capacity))))
                next_pos = torch.cat((next_pos, next_pos.new_zeros((add, 1))))
                logits = torch.cat((logits, logits.new_zeros((add, logits.shape[-1]))))
                targets += list(range(len(live), size))
                live = live + [-1] * add
            else:
                logits = logits.clone()  # a graph's output buffer is rewritten by its next replay anyway
            where = torch.tensor(targets, device=dev)
            cast(DecodeCache, cache).put(where, pre, torch.tensor(src, device=dev))
            ok = torch.zeros((len(new), capacity), dtype=torch.bool)
            for j, r in enumerate(new):
                ok[j, : len(r.prompt)] = True
                r.start = t + 1
                live[targets[j]] = len(rows)
                rows.append(r)
            keys_ok[where] = ok.to(dev)
            next_pos[where] = torch.tensor([[len(r.prompt)] for r in new], device=dev)
            logits[where] = pre_logits[torch.tensor(src, device=dev)]
            steps = max(steps, t + 1 + max(r.limit for r in new))
            grown = torch.zeros((len(rows), steps), dtype=torch.float32, device=dev)
            grown[: lp_buf.shape[0], : lp_buf.shape[1]] = lp_buf
            lp_buf = grown
            plan = _Plan(rows, live, logits.shape[-1], dev)
            assert slots is not None  # the fast path's
            slots.rows = torch.arange(len(live), device=dev)
        lps = lp_buf.tolist()
        for i, r in enumerate(rows):
            r.logprobs = lps[i][r.start : r.start + len(r.tokens)]
            r.reason = r.reason or "length"
        if join is not None:  # every row ends inside the loop; this only makes sure none goes unreported
            for r in rows:
                join.finished(r)

    def _static_decoder(self) -> StaticDecoder | None:
        on = self.static_decode if self.static_decode is not None else self.device.type == "cuda"
        if not on or self.fast is None:
            return None
        if self._static is None or self._static.fast is not self.fast:
            self._static = StaticDecoder(self.fast, graphs=self.cuda_graphs)
        self._static.graphs = self._static.graphs and self.cuda_graphs
        return self._static

    def _hit_stop_string(self, r: _Row) -> bool:
        # Decoding only a trailing window keeps this O(1) per step; the window covers the longest stop string
        # (one token holds at least one byte) plus slack for a partial UTF-8 character at its start. A stop
        # string completed by an earlier token would have been caught at that step, so any hit is new.
        text = self.tokenizer.decode(r.tokens[-r.window :], skip_special_tokens=False)
        return any(s in text for s in r.stop_strs)


@dataclass
class _Join:
    """sample_stream's side of a decode batch: `take(capacity, rows)` hands over arrived requests' rows that fit;
    `finished(row)` is told of each row as it finishes (its logprobs set)."""

    take: Callable[[int, int], list[_Row]]
    finished: Callable[[_Row], None]


class _Plan:
    """Per-step sampling work for the current batch, grouped once per batch so a step does only what its
    rows need: scale by temperature if any row has T != 1, truncate only rows with top-k / top-p, one
    uniform draw for all unseeded rows, one per seeded row, argmax for greedy rows."""

    def __init__(self, rows: list[_Row], live: list[int], vocab: int, dev: torch.device):
        ps = [rows[i].params for i in live]
        self.row_ids = torch.tensor(live, device=dev)
        temps = [p.temperature if p.temperature > 0 else 1.0 for p in ps]
        self.temp = None if all(t == 1.0 for t in temps) else torch.tensor(temps, device=dev)[:, None]
        greedy = [s for s, p in enumerate(ps) if p.temperature == 0]
        self.all_greedy = len(greedy) == len(ps)
        self.greedy = torch.tensor(greedy, device=dev) if greedy and not self.all_greedy else None
        seeded = [s for s, p in enumerate(ps) if p.temperature > 0 and p.seed is not None]
        self.seeded = [(s, rows[live[s]].gen) for s in seeded]
        free = [s for s, p in enumerate(ps) if p.temperature > 0 and p.seed is None]
        self.free_all = len(free) == len(ps)
        self.free = torch.tensor(free, device=dev) if free and not self.free_all else None
        topk = [s for s, p in enumerate(ps) if p.temperature > 0 and p.top_k > 0]
        ks = [min(ps[s].top_k, vocab) for s in topk]
        self.topk = (torch.tensor(topk, device=dev), torch.tensor(ks, device=dev)[:, None], max(ks)) if topk else None
        topp = [s for s, p in enumerate(ps) if p.temperature > 0 and p.top_p < 1]
        self.topp = (
            (torch.tensor(topp, device=dev), torch.tensor([ps[s].top_p for s in topp], device=dev)) if topp else None
        )

    def choose(self, logits: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(next token, its logprob) per row. The logprob is under softmax(logits / T) before top-k/top-p
        truncation (T=0 reports T=1 logprobs): what the hosted Tinker service returns (its maintainers, see
        docs/logprobs.md) and what ratio losses expect of the behaviour policy."""
        scaled = logits if self.temp is None else logits / self.temp
        logp = torch.log_softmax(scaled, -1)
        if self.all_greedy:
            tok = logits.argmax(-1)
        else:
            # Inverse-CDF sampling: one uniform per row, then one searchsorted for the whole batch. Cheaper
            # than torch.multinomial on CPU (which draws an exponential per vocabulary entry), and a seeded
            # row consumes exactly one number of its own generator per step.
            cdf = self._truncate(logp.exp(), scaled).cumsum(-1)
            n = logits.shape[0]
            if self.free_all:
                u = torch.rand((n, 1), generator=gen, device=logits.device)
            else:
                u = torch.zeros((n, 1), device=logits.device)
                if self.free is not None:
                    u[self.free] = torch.rand((len(self.free), 1), generator=gen, device=logits.device)
                for s, g in self.seeded:
                    u[s] = torch.rand(1, generator=g, device=logits.device)
            total = cdf[:, -1:]
            # u < total even after rounding, so the first cdf entry above it always ends a nonzero-probability step.
            u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
            tok = torch.searchsorted(cdf, u, right=True)[:, 0]
            if self.greedy is not None:
                tok[self.greedy] = logits[self.greedy].argmax(-1)
        return tok, logp.gather(1, tok[:, None])[:, 0]

    def _truncate(self, probs: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
        if self.topk is not None:
            rows, k, kmax = self.topk
            sub = scaled[rows]
            kth = sub.topk(kmax, -1).values.gather(1, k - 1)
            probs[rows] = probs[rows].masked_fill(sub < kth, 0.0)
        if self.topp is not None:
            rows, top_p = self.topp
            sub = probs[rows]
            sorted_p, order = sub.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
            # Keep the smallest prefix reaching top_p of the (top-k-truncated) mass; the first token always stays.
            drop = before >= top_p[:, None] * sorted_p.sum(-1, keepdim=True)
            probs[rows] = sub.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), 0.0)
        return probs


def _filler(prompt: list[int]) -> _Row:
    """A row that is finished from the start: it only pads a batch to a multiple of _ROW_QUANTUM rows, and is
    never returned."""
    return _Row(
        -1, 0, prompt, SamplingParams(max_tokens=1, temperature=0.0), 1, frozenset(), (), 0, None, reason="length"
    )


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """The model's EOS id(s): generation_config, then config, then the tokenizer; each may be a list."""
    found: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            found.update([eos] if isinstance(eos, int) else eos)
    if not found and getattr(tokenizer, "eos_token_id", None) is not None:
        found.add(tokenizer.eos_token_id)
    return frozenset(found)
