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
attention variant) decodes through HF's modules. bench/bench_sampling.py measures them against
`model.generate`; the ratios are in bench/README.md.

A request with num_samples = n prefills its prompt once (each distinct prompt of a batch once) and copies its
KV to its n rows. `sample_stream` (what the local sampling client calls) adds continuous batching: requests
that arrive while a batch decodes join it at a step boundary, and each is delivered as soon as it finishes.

This file turns requests into rows (one per sample, validated) and rows into batches that fit the cache budget;
decoding.py decodes one batch (prefill, the decode steps, sampling, stop rules, batch invariance).
docs/local-backend.md has the whole picture.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from backends.local.decoding import DecodeBatch, Join, Row, round_up
from backends.local.device import LOGITS_DTYPE
from backends.local.llama import LlamaDecoder
from backends.local.static_decode import StaticDecoder, capacity_bucket, row_bucket
from backends.tokenizer import Tokenizer, eos_token_id
from backends.types import SampledSequence, SampleOutput, SamplingParams

# Logit entries (rows x length x vocab) one compute_logprobs_batch forward may produce.
_LOGPROB_BUDGET = 1 << 26


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One sampling request: `num_samples` continuations of `prompt` under `params` (a sampling client's
    `sample` call; one job of its worker)."""

    prompt: list[int]
    num_samples: int
    params: SamplingParams


class Sampler:
    """Generates for a batch of requests with one model; not thread-safe (the backend calls it from one worker)."""

    def __init__(self, model, tokenizer: Tokenizer, device: torch.device, seed: int = 0):
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

    def sample_batch(self, requests: list[SampleRequest]) -> list[SampleOutput]:
        rows = [row for i, req in enumerate(requests) for row in self._rows(i, req)]
        with torch.inference_mode():
            for chunk in self._chunks(rows):
                self._generate(chunk)
        out: list[list[SampledSequence]] = [[] for _ in requests]
        for r in rows:
            out[r.req].append(SampledSequence(r.tokens, r.logprobs, r.reason or "length"))
        return [SampleOutput(sequences=s) for s in out]

    def sample_stream(
        self,
        requests: list[SampleRequest],
        more: Callable[[], list[SampleRequest]],
        done: Callable[[int, SampleOutput | ValueError], None],
    ) -> None:
        """sample_batch with continuous batching, for a worker whose requests keep arriving. Requests are numbered
        in arrival order: `requests`, then each list `more()` returns (it is called at every decode step and
        must not block). On the fast path a request that arrives while a batch decodes joins it at the next step
        boundary when its rows fit the batch's KV capacity and cache budget (it takes finished rows' slots
        first); otherwise it runs in the next batch. `done(i, result)` is called once per request as soon as all
        its samples are finished: its SampleOutput, or the ValueError that makes it invalid. A request's tokens
        and logprobs are those sample_batch gives it (bit for bit on the CPU, seeded: batch invariance)."""
        pending: list[Row] = []
        left: dict[int, list[Row]] = {}  # request -> its rows, until all have finished
        count = 0

        def admit(reqs: list[SampleRequest]) -> None:
            nonlocal count
            for req in reqs:
                i, count = count, count + 1
                try:
                    rows = self._rows(i, req)
                except ValueError as exc:
                    done(i, exc)
                    continue
                left[i] = rows
                pending.extend(rows)

        def take(capacity: int, room: int) -> list[Row]:
            """Whole pending requests, in arrival order, whose rows fit `capacity` slots and `room` rows."""
            admit(more())
            if room <= 0 or not pending:
                return []
            groups: dict[int, list[Row]] = {}
            for r in pending:
                groups.setdefault(r.req, []).append(r)
            out: list[Row] = []
            for rows in groups.values():
                if len(out) + len(rows) <= room and all(len(r.prompt) + r.limit <= capacity for r in rows):
                    out += rows
            if out:
                taken = {id(r) for r in out}
                pending[:] = [r for r in pending if id(r) not in taken]
            return out

        def finished(r: Row) -> None:
            rows = left.get(r.req)
            if rows is None or any(x.reason is None for x in rows):
                return
            del left[r.req]
            done(r.req, SampleOutput(sequences=[SampledSequence(x.tokens, x.logprobs, x.reason or "length")
                                                for x in rows]))

        admit(requests)
        join = Join(take, finished)
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
                width = round_up(len(seqs[chunk[0]]))  # batch-invariant, see decoding.ROW_QUANTUM
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

    def _rows(self, req: int, request: SampleRequest) -> list[Row]:
        prompt, num_samples, p = request.prompt, request.num_samples, request.params
        self._check_tokens(prompt, "prompt")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if p.max_tokens is None or p.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
        if not 0 <= p.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
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
            rows.append(Row(req, k, list(prompt), p, limit, stop_ids, stop_strs, window, gen))
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

    # ------------------------------------------------------------------ rows -> decode batches

    def budget_slots(self) -> int:
        """KV cache slots (rows x positions) one decode batch may hold: cache_budget's bytes."""
        budget = self.cache_budget
        if budget is None:
            budget = torch.cuda.mem_get_info(self.device)[0] // 2 if self.device.type == "cuda" else 2 << 30
        cfg = self.config
        heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return max(1, budget // (cfg.num_hidden_layers * 2 * heads * head_dim * self.dtype.itemsize))

    def _chunks(self, rows: list[Row]) -> list[list[Row]]:
        """Consecutive runs of rows whose KV cache (rows x (longest prompt + most steps)) fits the budget."""
        slots = self.budget_slots()
        static = self._paths()[1] is not None

        def size(k: int, length: int) -> int:
            if not static:
                return k * length
            # A static batch's rows and capacity are rounded up to buckets, and the smaller buckets' batches
            # it moves to as rows finish are kept too (at most as much again).
            return 2 * row_bucket(k) * capacity_bucket(length)

        chunks: list[list[Row]] = []
        width = steps = 0
        for r in rows:
            width, steps = max(width, len(r.prompt)), max(steps, r.limit)
            if chunks and chunks[-1] and size(len(chunks[-1]) + 1, width + steps) <= slots:
                chunks[-1].append(r)
            else:  # a single row always runs, whatever its size
                chunks.append([r])
                width, steps = len(r.prompt), r.limit
        return chunks

    def _generate(self, rows: list[Row], join: Join | None = None) -> None:
        """Decodes `rows` to their ends (decoding.py). With `join` (sample_stream), each row is reported as it
        finishes, and on the fast path requests that arrive meanwhile join the batch at a step boundary."""
        DecodeBatch(self, rows, join, *self._paths()).run()

    def _paths(self) -> tuple[LlamaDecoder | None, StaticDecoder | None]:
        """The decode path this call takes: the plain-tensor decoder (None: HF's modules) and, on it, the
        static-shape decoder (None: eager shapes)."""
        fast = self.fast if self.attn_impl in ("sdpa", "eager") else None
        return fast, self._static_decoder() if fast is not None else None

    def _static_decoder(self) -> StaticDecoder | None:
        on = self.static_decode if self.static_decode is not None else self.device.type == "cuda"
        if not on or self.fast is None:
            return None
        if self._static is None or self._static.fast is not self.fast:
            self._static = StaticDecoder(self.fast, graphs=self.cuda_graphs)
        self._static.graphs = self._static.graphs and self.cuda_graphs
        return self._static


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """The model's EOS id(s): generation_config, then config, then the tokenizer; each may be a list."""
    found: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if eos is not None:
            found.update([eos] if isinstance(eos, int) else eos)
    if not found and (eos := eos_token_id(tokenizer)) is not None:
        found.add(eos)
    return frozenset(found)
