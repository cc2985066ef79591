"""The decode loop of the local Sampler (backends/local/sampler.py): one batch of rows, decoded to its end.

The Sampler turns requests into rows (one per sample) and cuts them into batches whose KV cache fits its budget;
a `DecodeBatch` then runs one batch:

1. setup: the rows are padded with finished filler rows (batch invariance, below), each distinct prompt is
   prefilled once and its KV copied to every row sampling it, and a mask says which cache slots each row attends to;
2. steps, until every row has finished (`run`): choose each row's next token (`_Plan`), record it under the row's
   stop rules, report the rows that just finished (sample_stream's callers need not wait for the batch), retire
   finished rows once enough have piled up (the cache shrinks), run one decode step of the model, and admit the
   requests that arrived meanwhile (continuous batching; they take finished rows' slots or grow the batch);
3. each row's logprobs, cut from one (rows x steps) buffer filled as the steps go.

The model runs one of three ways: the plain-tensor fast path (llama.LlamaDecoder) at the live rows' shapes, the
same at static shapes (static_decode.py, replayed as CUDA graphs on CUDA), or HF's modules for every other model,
over an HF cache whose layers are `_GrowingLayer`s (sdpa or eager attention) or HF's own, left-padded.
docs/local-backend.md has the whole picture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from backends.local.device import LOGITS_DTYPE
from backends.local.llama import DecodeCache, LlamaDecoder, Slots
from backends.local.static_decode import StaticBatch, StaticDecoder, capacity_bucket, row_bucket
from backends.tokenizer import Tokenizer, decode_text
from backends.types import TEMPERATURE_FLOOR, TOP_P_FLOOR, SamplingParams, StopReason


class Sampler(Protocol):
    """What a batch reads of the Sampler that runs it (backends/local/sampler.py; a protocol, so that module imports
    this one and not the other way round)."""

    model: Any
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    gen: torch.Generator
    pad_id: int
    attn_impl: str | None
    share_prefill: bool
    keep_arg: bool
    cache_kw: str

    def budget_slots(self) -> int: ...

# Batch invariance: a request's samples and logprobs are bit-identical whatever else shares its batch, so a
# seeded run repeats exactly however the worker happened to coalesce requests (an RL run resumed after a
# kill gives the uninterrupted run's metrics). Measured on CPU (MKL, torch 2.13, one thread, which is how
# the local backend runs its samplers): every row of a matmul is the same whenever the row count is a
# multiple of 4 (fewer rows, or the 1-3 rows past the last multiple of 4, take other kernels); and sdpa's
# output for a query is the same for any key length that is a multiple of 16, with the real keys at the
# same slots and the rest masked. So every forward here has a multiple of ROW_QUANTUM rows (finished or
# filler rows make up the count), and each row keeps its tokens at cache slots 0..n-1 (prompts
# right-padded, each row writing at its own next slot) under a key view rounded up to KV_QUANTUM.
# tests/test_local_sampler.py checks it. Not promised on CUDA, where kernels are chosen per shape.
ROW_QUANTUM = 4
KV_QUANTUM = 16


def round_up(n: int, q: int = KV_QUANTUM) -> int:
    return -(-n // q) * q


@dataclass
class Row:
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

    def add(self, tok: int, tokenizer: Tokenizer) -> bool:
        """Appends a sampled token; True when the row's stop rules or token budget end it there."""
        self.tokens.append(tok)
        if tok in self.stop_ids or (self.stop_strs and self._hit_stop_string(tokenizer)):
            self.reason = "stop"
        elif len(self.tokens) >= self.limit:
            self.reason = "length"
        # A caller's per-token hook (backends/serve/openai_api.py Watched: streaming, and ending the rows of a
        # request whose client hung up: False ends the row here).
        watch = getattr(self.params, "watch", None)
        if watch is not None and watch(self.index, tok, self.reason) is False and self.reason is None:
            self.reason = "length"
        return self.reason is not None

    def take_logprobs(self, by_step: list[float]) -> None:
        """Its logprobs out of its row of the batch's (rows x steps) buffer."""
        self.logprobs = by_step[self.start : self.start + len(self.tokens)]

    def _hit_stop_string(self, tokenizer: Tokenizer) -> bool:
        # Decoding only a trailing window keeps this O(1) per step; the window covers the longest stop string
        # (one token holds at least one byte) plus slack for a partial UTF-8 character at its start. A stop
        # string completed by an earlier token would have been caught at that step, so any hit is new.
        text = decode_text(tokenizer, self.tokens[-self.window :])
        return any(s in text for s in self.stop_strs)


@dataclass
class Join:
    """sample_stream's side of a decode batch: `take(capacity, rows)` hands over arrived requests' rows that fit;
    `finished(row)` is told of each row as it finishes (its logprobs set)."""

    take: Callable[[int, int], list[Row]]
    finished: Callable[[Row], None]


class DecodeBatch:
    """Decodes `rows` to their ends with the sampler's model (`run`). `fast` is the plain-tensor path (None: HF's
    modules) and `static` its static-shape decoder (None: eager shapes). With `join` (sample_stream) each row is
    reported as it finishes, and on the fast path requests that arrive meanwhile join the batch at a step boundary.

    State, per batch slot s (the model's row s): `live[s]`, the index in `rows` of the row it decodes (rows only
    grow: joiners are appended); `keys_ok[s]`, the cache slots it attends to; `next_pos[s]`, the cache slot (and
    position) of its next token; `logits[s]`, its next-token logits. `lp_buf[i, t]` is row i's logprob at step t."""

    def __init__(self, sampler: Sampler, rows: list[Row], join: Join | None, fast: LlamaDecoder | None,
                 static: StaticDecoder | None):
        self.sampler, self.join, self.fast, self.static = sampler, join, fast, static
        self.dev = sampler.device
        self.steps = max(r.limit for r in rows)  # grows when a request joins
        # Already-finished filler rows make every forward's row count a multiple of ROW_QUANTUM (a static batch:
        # its row bucket instead, one captured graph per bucket).
        size = row_bucket(len(rows)) if static is not None else round_up(len(rows), ROW_QUANTUM)
        self.rows = rows + [_filler(rows[0].prompt) for _ in range(size - len(rows))]
        self.live = list(range(size))
        self.batch: StaticBatch | None = None  # the static path's current (rows, capacity) batch
        # slots: the batch-invariant layout (see ROW_QUANTUM), or None for HF's own cache, left-padded.
        self.cache: DynamicCache | DecodeCache
        self.slots: Slots | None
        self.longest: int  # the longest prompt: where a left-padded batch's prompts end
        self.capacity: int  # cache slots per row
        self.logits = self._prefill()
        self.keys_ok, self.next_pos, self.valid = self._prompt_masks()
        self.lp_buf = torch.zeros((size, self.steps), dtype=torch.float32, device=self.dev)
        self._replan()
        # Requests may join only where each row's cache row is its own (the fast path), within the cache budget.
        self.joins = join is not None and fast is not None
        # (A static batch counts twice: the smaller buckets' batches are kept too; see Sampler._chunks.)
        slots_per_row = self.capacity * (1 if self.batch is None else 2)
        room = sampler.budget_slots() // slots_per_row
        if self.batch is not None and room > 0:
            # A static batch grows to a whole row bucket (_grow): at most the largest bucket that fits, else 12
            # rows in a 16-row budget would grow into a 16-row bucket, up to twice the budget's memory.
            room = 1 << (room.bit_length() - 1)
        self.max_rows = max(size, room) if self.joins else size

    # ------------------------------------------------------------------ setup

    def _prefill(self) -> torch.Tensor:
        """Fills the cache with every row's prompt; each row's next-token logits. Sets longest, capacity, cache,
        slots (and batch on the static path)."""
        rows, dev, fast, static = self.rows, self.dev, self.fast, self.static
        # Each distinct prompt is prefilled once (RL asks for many samples of one prompt); its cache rows
        # are then copied to every sample of it. A row's KV is the same bits either way (see ROW_QUANTUM).
        if self.sampler.share_prefill:
            distinct: dict[tuple[int, ...], int] = {}
            source = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in rows]
            prompts = [list(p) for p in distinct]
        else:
            source, prompts = list(range(len(rows))), [r.prompt for r in rows]
        if fast is None:
            # HF's modules run one padded row per prompt: a multiple of ROW_QUANTUM rows. The fast path
            # packs the prompts' tokens and rounds that count itself, so a lone prompt is prefilled once.
            prompts += [prompts[0]] * (round_up(len(prompts), ROW_QUANTUM) - len(prompts))
        self.longest = longest = max(len(p) for p in prompts)
        self.capacity = capacity = (
            round_up(longest + self.steps) if static is None else capacity_bucket(longest + self.steps)
        )
        if fast is not None:
            # A static batch's prefill needs only the prompts' slots; they are then copied into its cache.
            self.slots = Slots()
            self.cache = fast.new_cache(len(prompts), capacity if static is None else round_up(longest), self.slots)
            logits = self._fast_prefill(prompts, self.cache)
        else:
            self.cache, self.slots = self._hf_cache(capacity)
            logits = self._hf_prefill(prompts, self.slots, self.cache)
        if static is not None:
            index = torch.tensor(source, device=dev)
            self.batch = static.batch(len(rows), capacity)
            self.batch.load(cast(DecodeCache, self.cache), index)
            self.cache, self.slots, logits = self.batch.cache, self.batch.cache.slots, logits[index]
        elif source != list(range(len(prompts))):
            index = torch.tensor(source, device=dev)
            self.cache.batch_select_indices(index)
            logits = logits[index]
        return logits

    def _prompt_masks(self) -> tuple[torch.Tensor, torch.Tensor, bool | float]:
        """keys_ok over the prompts' slots, next_pos after them, and the value keys_ok marks a slot valid with."""
        keys_ok = torch.zeros((len(self.rows), self.capacity), dtype=torch.bool)
        for i, r in enumerate(self.rows):
            if self.slots is not None:
                keys_ok[i, : len(r.prompt)] = True
            else:
                keys_ok[i, self.longest - len(r.prompt) : self.longest] = True
        keys_ok = keys_ok.to(self.dev)
        next_pos = torch.tensor([[len(r.prompt)] for r in self.rows], device=self.dev)
        if self.slots is not None and self.fast is None and self.sampler.attn_impl == "eager":
            # eager attention adds its mask to the scores; sdpa takes the boolean one as is.
            dtype = self.sampler.dtype
            additive = torch.zeros(keys_ok.shape, dtype=dtype, device=self.dev)
            return additive.masked_fill_(~keys_ok, torch.finfo(dtype).min), next_pos, 0.0
        return keys_ok, next_pos, True

    def _hf_cache(self, capacity: int) -> tuple[DynamicCache, Slots | None]:
        """HF's cache for this model. When every layer is plain full attention under sdpa or eager attention,
        its layers become preallocated per-row-slot ones (the batch-invariant layout; returns their shared
        Slots); otherwise HF's own layers stay, prompts are left-padded, and the slots are None."""
        cache = DynamicCache(config=self.sampler.model.config)
        plain = bool(cache.layers) and all(type(layer) is DynamicLayer for layer in cache.layers)
        if not (plain and self.sampler.attn_impl in ("sdpa", "eager")):
            return cache, None
        slots = Slots()
        cache.layers[:] = [_GrowingLayer(capacity, slots) for _ in cache.layers]
        return cache, slots

    def _hf_prefill(self, prompts: list[list[int]], slots: Slots | None, cache: DynamicCache) -> torch.Tensor:
        """Runs the distinct prompts through HF's modules into the cache; the next-token logits of each."""
        s, dev, lens = self.sampler, self.dev, [len(p) for p in prompts]
        if slots is None:  # left padding: every prompt ends at the last column
            width = max(lens)
            ids = torch.full((len(prompts), width), s.pad_id, dtype=torch.long)
            mask = torch.zeros((len(prompts), width), dtype=torch.long)
            for j, prompt in enumerate(prompts):
                ids[j, width - len(prompt) :] = torch.tensor(prompt)
                mask[j, width - len(prompt) :] = 1
            ids, mask = ids.to(dev), mask.to(dev)
            pos = (mask.cumsum(1) - 1).clamp_(min=0)
            extra = {"logits_to_keep": 1} if s.keep_arg else {}
            out = s.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{s.cache_kw: cache}, **extra
            )
            return out.logits[:, -1]
        # Right padding: prompt token i sits at slot i in every batch. Causal attention never lets a real
        # token see the pads after it, so no mask is needed.
        width = round_up(max(lens))
        ids = torch.full((len(prompts), width), s.pad_id, dtype=torch.long)
        for j, prompt in enumerate(prompts):
            ids[j, : len(prompt)] = torch.tensor(prompt)
        ids = ids.to(dev)
        pos = torch.arange(width, device=dev).expand(len(prompts), width)
        slots.write, slots.view = None, width
        last = sorted({n - 1 for n in lens})
        extra = {"logits_to_keep": torch.tensor(last, device=dev)} if s.keep_arg else {}
        logits = s.model(input_ids=ids, position_ids=pos, use_cache=True, **{s.cache_kw: cache}, **extra).logits
        col = {p: (i if s.keep_arg else p) for i, p in enumerate(last)}
        return logits[torch.arange(len(prompts), device=dev), torch.tensor([col[n - 1] for n in lens], device=dev)]

    def _fast_prefill(self, prompts: list[list[int]], cache: DecodeCache) -> torch.Tensor:
        """_hf_prefill's right-padded layout on the fast path: the next-token logits of each prompt."""
        assert self.fast is not None
        width = round_up(max(len(p) for p in prompts))
        cache.slots.view = width
        return self.fast.prefill(prompts, width, self.sampler.pad_id, cache, ROW_QUANTUM)

    def _replan(self) -> None:
        """After the batch's rows change: their sampling plan, and the cache's rows written each step."""
        self.plan = _Plan(self.rows, self.live, self.logits.shape[-1], self.dev)
        if self.slots is not None:
            self.slots.rows = torch.arange(len(self.live), device=self.dev)

    # ------------------------------------------------------------------ the steps

    def run(self) -> None:
        """Decodes until every row has finished (or the longest budget is spent); each row's tokens, logprobs and
        stop reason are then set."""
        t = 0
        while t < self.steps:  # `steps` grows when a request joins
            tok = self._choose(t)
            if self._record(tok):
                break  # every row has finished
            tok = self._retire(tok)
            self._step(tok, t)
            if self.joins:
                self._admit(t)
            t += 1
        self._deliver()

    def _choose(self, t: int) -> torch.Tensor:
        """Each batch slot's next token (finished rows' too: they are ignored); their logprobs go to lp_buf."""
        tok, lp = self.plan.choose(self.logits.to(LOGITS_DTYPE), self.sampler.gen)
        self.lp_buf[self.plan.row_ids, t] = lp
        return tok

    def _record(self, tok: torch.Tensor) -> bool:
        """Appends each running row's token and applies its stop rules; True when no row is left running."""
        rows, tokenizer = self.rows, self.sampler.tokenizer
        ended = [i for i, tk in zip(self.live, tok.tolist()) if rows[i].reason is None and rows[i].add(tk, tokenizer)]
        if self.join is not None and ended:  # reported now: their callers need not wait for the whole batch
            for i, by_step in zip(ended, self.lp_buf[torch.tensor(ended, device=self.dev)].tolist()):
                rows[i].take_logprobs(by_step)
            for i in ended:  # after all their logprobs: siblings may end at the same step
                self.join.finished(rows[i])
        return all(rows[i].reason is not None for i in self.live)

    def _retire(self, tok: torch.Tensor) -> torch.Tensor:
        """Drops finished rows from the batch when it pays (the cache is copied); the tokens of the rows kept."""
        rows, live = self.rows, self.live
        running = sum(rows[i].reason is None for i in live)
        dead = len(live) - running
        # Dropping finished rows copies the cache once; worth it once a quarter of the batch is idle (a
        # static batch: once the live rows fit a smaller bucket, whose batch they move to).
        target = round_up(running, ROW_QUANTUM) if self.batch is None else row_bucket(running)
        if not ((4 * dead >= len(live) or self.batch is not None) and target < len(live)):
            return tok
        keep = [s for s, i in enumerate(live) if rows[i].reason is None]
        keep += [s for s, i in enumerate(live) if rows[i].reason is not None][: target - len(keep)]
        keep.sort()
        index = torch.tensor(keep, device=self.dev)
        if self.batch is not None:
            assert self.static is not None
            smaller = self.static.batch(target, self.capacity)
            smaller.load(self.batch.cache, index)
            self._use(smaller)
        else:
            self.cache.batch_select_indices(index)
        self.keys_ok, self.next_pos = self.keys_ok[index], self.next_pos[index]
        self.live = [live[s] for s in keep]
        self._replan()
        return tok[index]

    def _use(self, batch: StaticBatch) -> None:
        """Decode in `batch` from now on (the live rows' cache already loaded into it)."""
        self.batch, self.cache, self.slots = batch, batch.cache, batch.cache.slots

    def _step(self, tok: torch.Tensor, t: int) -> None:
        """One forward: feeds each slot's token at its next position; the next logits."""
        attn = self._step_mask(t)
        pos = self.next_pos[:, 0]
        if self.batch is not None:
            self.logits = self.batch.step(tok, pos, self.keys_ok[:, None, None])
        elif self.fast is not None:
            assert attn is not None
            self.logits = self.fast.step(tok, pos, attn, cast(DecodeCache, self.cache))
        else:
            s = self.sampler
            self.logits = s.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=self.next_pos,
                use_cache=True,
                **{s.cache_kw: self.cache},
            ).logits[:, -1]
        self.next_pos += 1
        if self.joins:
            # A finished row kept in the batch still writes each step; past the capacity it writes its last
            # slot again (its own row, never read for a live row). Live rows never get there.
            self.next_pos.clamp_(max=self.capacity - 1)

    def _step_mask(self, t: int) -> torch.Tensor | None:
        """Marks the slots this step writes as valid; the step's attention mask (None: a static batch, which
        reads keys_ok whole)."""
        slots = self.slots
        if slots is None:  # left-padded: every row writes the same column
            self.keys_ok[:, self.longest + t] = True
            return self.keys_ok[:, : self.longest + t + 1].long()
        write = self.next_pos[:, 0]
        slots.write = write
        self.keys_ok[slots.rows, write] = self.valid
        if self.batch is not None:  # a static batch attends over its whole capacity (no host sync for the view)
            return None
        slots.view = min(self.capacity, round_up(int(write.max()) + 1))
        return self.keys_ok[:, None, None, : slots.view]

    def _admit(self, t: int) -> None:
        """Requests that arrived and fit join the batch for step t + 1: their prefill (each distinct prompt once),
        then their slots: finished rows' first, then new ones."""
        assert self.join is not None and self.fast is not None
        free = [s for s, i in enumerate(self.live) if self.rows[i].reason is not None]
        new = self.join.take(self.capacity, self.max_rows - len(self.live) + len(free))
        if not new:
            return
        distinct: dict[tuple[int, ...], int] = {}
        src = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in new]
        pre = self.fast.new_cache(len(distinct), round_up(max(len(r.prompt) for r in new)), Slots())
        pre_logits = self._fast_prefill([list(p) for p in distinct], pre)
        targets = free[: len(new)]
        if len(new) > len(free):
            new, src, targets = self._grow(new, src, targets)
        else:
            self.logits = self.logits.clone()  # a graph's output buffer is rewritten by its next replay anyway
        where = torch.tensor(targets, device=self.dev)
        cast(DecodeCache, self.cache).put(where, pre, torch.tensor(src, device=self.dev))
        ok = torch.zeros((len(new), self.capacity), dtype=torch.bool)
        for j, r in enumerate(new):
            ok[j, : len(r.prompt)] = True
            r.start = t + 1
            self.live[targets[j]] = len(self.rows)
            self.rows.append(r)
        self.keys_ok[where] = ok.to(self.dev)
        self.next_pos[where] = torch.tensor([[len(r.prompt)] for r in new], device=self.dev)
        self.logits[where] = pre_logits[torch.tensor(src, device=self.dev)]
        self.steps = max(self.steps, t + 1 + max(r.limit for r in new))
        grown = torch.zeros((len(self.rows), self.steps), dtype=torch.float32, device=self.dev)
        grown[: self.lp_buf.shape[0], : self.lp_buf.shape[1]] = self.lp_buf
        self.lp_buf = grown
        self._replan()

    def _grow(self, new: list[Row], src: list[int], targets: list[int]) -> tuple[list[Row], list[int], list[int]]:
        """More slots for joiners than finished rows free: the batch grows to a multiple of ROW_QUANTUM (or the
        next bucket), topped up with finished fillers. The joiners and fillers, their prefill rows and slots."""
        live = len(self.live)
        size = live + len(new) - len(targets)
        size = round_up(size, ROW_QUANTUM) if self.batch is None else row_bucket(size)
        add = size - live
        new = new + [_filler(new[0].prompt) for _ in range(add - (len(new) - len(targets)))]
        src = src + [src[0]] * (len(new) - len(src))
        if self.batch is not None:
            assert self.static is not None
            bigger = self.static.batch(size, self.capacity)
            bigger.load(self.batch.cache, torch.arange(live, device=self.dev))
            self._use(bigger)
        else:
            cast(DecodeCache, self.cache).grow(add)
        self.keys_ok = torch.cat((self.keys_ok, self.keys_ok.new_zeros((add, self.capacity))))
        self.next_pos = torch.cat((self.next_pos, self.next_pos.new_zeros((add, 1))))
        self.logits = torch.cat((self.logits, self.logits.new_zeros((add, self.logits.shape[-1]))))
        self.live = self.live + [-1] * add  # each filled by _admit
        return new, src, targets + list(range(live, size))

    def _deliver(self) -> None:
        """Every row's logprobs and stop reason; with `join`, each row not reported yet is."""
        lps = self.lp_buf.tolist()
        for i, r in enumerate(self.rows):
            r.take_logprobs(lps[i])
            r.reason = r.reason or "length"
        if self.join is not None:  # every row ends inside the loop; this only makes sure none goes unreported
            for r in self.rows:
                self.join.finished(r)


class _Plan:
    """Per-step sampling work for the current batch, grouped once per batch so a step does only what its
    rows need: scale by temperature if any row has T != 1, truncate only rows with top-k / top-p, one
    uniform draw for all unseeded rows, one per seeded row, argmax for greedy rows."""

    def __init__(self, rows: list[Row], live: list[int], vocab: int, dev: torch.device):
        ps = [rows[i].params for i in live]
        self.row_ids = torch.tensor(live, device=dev)
        # Below the floors (backends/types.py): greedy, or only the most likely token kept (top_k = 1).
        hot = [p.temperature >= TEMPERATURE_FLOOR for p in ps]
        top1 = [p.top_p < TOP_P_FLOOR for p in ps]
        temps = [p.temperature if h else 1.0 for p, h in zip(ps, hot, strict=True)]
        self.temp = None if all(t == 1.0 for t in temps) else torch.tensor(temps, device=dev)[:, None]
        greedy = [s for s, h in enumerate(hot) if not h]
        self.all_greedy = len(greedy) == len(ps)
        self.greedy = torch.tensor(greedy, device=dev) if greedy and not self.all_greedy else None
        seeded = [s for s, p in enumerate(ps) if hot[s] and p.seed is not None]
        self.seeded = [(s, rows[live[s]].gen) for s in seeded]
        free = [s for s, p in enumerate(ps) if hot[s] and p.seed is None]
        self.free_all = len(free) == len(ps)
        self.free = torch.tensor(free, device=dev) if free and not self.free_all else None
        topk = [s for s, p in enumerate(ps) if hot[s] and (p.top_k > 0 or top1[s])]
        ks = [1 if top1[s] else min(ps[s].top_k, vocab) for s in topk]
        self.topk = (torch.tensor(topk, device=dev), torch.tensor(ks, device=dev)[:, None], max(ks)) if topk else None
        topp = [s for s, p in enumerate(ps) if hot[s] and not top1[s] and p.top_p < 1]
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



def _filler(prompt: list[int]) -> Row:
    """A row that is finished from the start: it only pads a batch to a multiple of ROW_QUANTUM rows, and is
    never returned."""
    return Row(
        -1, 0, prompt, SamplingParams(max_tokens=1, temperature=0.0), 1, frozenset(), (), 0, None, reason="length"
    )
