"""Decode steps of fixed shapes, replayed from CUDA graphs on CUDA: the Sampler's GPU decode path (issue #29).

On a GPU a small model's decode step launches several hundred kernels (about 20 per layer, 28 layers for
Qwen3-0.6B), each doing little work at 64 rows: the step is most likely bound by Python and the launches, not
by arithmetic (our eager sampler measured 0.89x HF's `generate` on an H200, issue #29). A CUDA graph
records a step's kernels once and replays them with one launch, but it wants every tensor at a fixed address
and shape and no host synchronisation inside. So here a decode batch is a `StaticBatch`:

- its rows are padded to a bucket (`row_bucket`: 4, 8, 16, ... rows; fillers are finished rows), and its KV
  cache has a fixed capacity per layer (`capacity_bucket`: a power of two, at least 64 slots), allocated once;
- a step reads its inputs from fixed buffers (tokens, positions, the (rows, 1, 1, capacity) mask), writes each
  row's new key and value at its own slot by a scatter and attends over the whole capacity under the mask
  (llama.LlamaDecoder.step_static); the rotary table is grown to the capacity beforehand;
- on CUDA, the first step of a batch runs eagerly (on a side stream: the warm-up a capture needs) and is then
  captured on that stream, one capture at a time in the process (each sampling client's worker thread captures
  its own batches; torch allows one capture at a time); later steps copy their inputs into the buffers and
  replay. A step is idempotent (it rewrites the same slot), so the capture's own recording changes nothing.
  When rows finish, the Sampler moves the live ones into a smaller bucket's batch, and when requests join
  (sample_stream) into a bigger one once the finished rows' slots are taken (each bucket keeps its buffers and
  graph for the next call).

The prefill stays eager (llama.LlamaDecoder.prefill: one per distinct prompt) and is copied into the batch's
cache. Sampling (temperature, top-k/p, the generators) stays eager too: it is a few kernels per step, and the
stop rules need the tokens on the host anyway.

Everything but the capture runs on the CPU too (Sampler.static_decode = True): tests/test_static_decode.py
checks it gives the eager fast path's tokens and logprobs, runs the capture-and-replay plumbing with a
stand-in graph, and `gpu`-marked tests compare graph and eager on CUDA. Should a capture fail (an op that cannot
be captured, too little memory), the decoder logs one warning and runs every later step eagerly, on the stream
the thread was on; what torch's capture_end leaves in capture mode when CUDA reports the failure (the caching
allocator's routing to the graph's pool, the default CUDA generator) is taken out of it.
"""

from __future__ import annotations

import logging
import threading

import torch

from backends.local.llama import DecodeCache, LlamaDecoder, Slots

log = logging.getLogger(__name__)

# Held while a decode step is captured: torch allows one CUDA graph capture at a time in a process, and every
# sampling client's worker thread captures its own batches. torch.cuda.empty_cache() asserts that no capture is
# underway: the workers' out-of-memory handling holds it too (backends/local/worker.py).
CAPTURE_LOCK = threading.Lock()

# Smallest row bucket: the sampler's row quantum (4 rows keep the CPU's matmuls batch-invariant).
MIN_ROWS = 4
# Smallest KV capacity; capacities are powers of two (multiples of the CPU's 16-slot key quantum).
MIN_CAPACITY = 64


def row_bucket(n: int) -> int:
    """Rows a batch of n live rows is padded to: the next power of two, at least MIN_ROWS."""
    return max(MIN_ROWS, 1 << max(0, n - 1).bit_length())


def capacity_bucket(n: int) -> int:
    """KV slots for a batch whose rows need at most n: the next power of two, at least MIN_CAPACITY."""
    return max(MIN_CAPACITY, 1 << max(0, n - 1).bit_length())


class StaticBatch:
    """One (rows, capacity) decode batch: its KV cache, input buffers and (on CUDA) captured step."""

    def __init__(self, owner: StaticDecoder, rows: int, capacity: int):
        fast = owner.fast
        self.owner, self.rows, self.capacity = owner, rows, capacity
        self.cache = fast.new_cache(rows, capacity, Slots())
        dev = fast.embed.device
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.mask = torch.zeros((rows, 1, 1, capacity), dtype=torch.bool, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None  # the graph's logits buffer

    def load(self, cache: DecodeCache, index: torch.Tensor) -> None:
        """Row i of this batch's cache := row index[i] of `cache` (a prefill's, or another batch's when rows
        finish or join), for the first len(index) rows; the rest, and slots past what `cache` holds, are zeroed
        (masked slots are read, so they must be finite)."""
        width, k = min(cache.keys[0].shape[2], self.capacity), len(index)
        for dst, src in zip(self.cache.keys + self.cache.values, cache.keys + cache.values, strict=True):
            dst[:k, :, :width].copy_(src[:, :, :width].index_select(0, index))
            dst[:k, :, width:].zero_()
            dst[k:].zero_()
        self.cache.filled = width

    def step(self, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The next-token logits of each row after feeding tok (rows,) at slot pos (rows,), attending to the
        slots mask (rows, 1, 1, capacity) allows."""
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        self.mask.copy_(mask)
        if self.graph is not None:
            self.graph.replay()
            assert self.out is not None
            return self.out
        return self._capture() if self._wants_capture() else self._forward()

    def _wants_capture(self) -> bool:
        return self.owner.graphs and self.tok.device.type == "cuda"

    def _forward(self) -> torch.Tensor:
        return self.owner.fast.step_static(self.tok, self.pos, self.mask, self.cache)

    def _capture(self) -> torch.Tensor:
        dev = self.tok.device
        cur = torch.cuda.current_stream(dev)
        # Warm-up on a side stream (what torch.cuda.graphs asks before a capture): this step, run for real.
        side = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            logits = self._forward()
        cur.wait_stream(side)
        if logits.is_cuda:
            logits.record_stream(cur)  # allocated on `side`, read on `cur`: not reused before cur is done with it
        pool = None
        began = ended = False
        try:
            graph = torch.cuda.CUDAGraph()
            pool = torch.cuda.graph_pool_handle()  # the graph's own memory pool, named so a failed capture can free it
            # On the warm-up's stream, one capture at a time in the process (CAPTURE_LOCK: torch allows one, and
            # each sampling client captures from its own worker thread). capture_begin/capture_end, not
            # torch.cuda.graph: that one synchronizes the device and empties the caching allocator (and the pinned
            # host cache) before each capture, which an RL run's training thread would pay for at every capture of
            # every new sampling client (its next step re-allocating from the driver); and its __exit__ leaves its
            # capture stream current for the thread when capture_end raises. Each graph its own memory pool:
            # sharing one is safe only for graphs replayed in capture order. thread_local: the training worker may
            # use the same GPU from its own thread meanwhile; in the default (global) mode its syncs and mallocs
            # would be errors during this capture.
            with CAPTURE_LOCK, torch.cuda.stream(side):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                began = True
                try:
                    out = self._forward()
                finally:
                    graph.capture_end()  # raises when the capture failed (then the stream context still exits)
                    ended = True
        except Exception as exc:  # noqa: BLE001 - any failure: decode eagerly from now on, said once
            if pool is not None and not ended:
                _release_pool(dev, pool, began)
            if began and not ended:
                _end_generator_capture(dev)
            self.owner.give_up(exc)
            return logits
        self.graph, self.out = graph, out
        # The capture only recorded; the warm-up's logits are this step's (the step is idempotent).
        return logits


def _release_pool(dev: torch.device, pool: tuple[int, int], began: bool) -> None:
    """The allocator's side of a capture whose capture_end did not complete. capture_begin sets the allocator to
    route this capture's allocations to `pool` (and takes a reference on it); capture_end undoes that only after
    CUDA ended the capture without error, and a graph releases its pool only once captured. Left as is, the
    allocator counts the capture as still underway: the next torch.cuda.empty_cache() in the process (the
    workers' out-of-memory handling calls it) fails torch's assert that no capture is underway, and the pool's
    memory is never returned."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    try:
        torch._C._cuda_endAllocateToPool(index, pool)
        underway = True
    except Exception:  # noqa: BLE001 - not routed to the pool (capture_end got that far, or capture_begin did not)
        underway = False
    if underway or began:
        try:
            torch._C._cuda_releasePool(index, pool)
        except Exception as exc:  # noqa: BLE001 - the eager fallback works without it; say so
            log.warning("could not release a failed capture's memory pool (%s: %s)", type(exc).__name__, exc)


def _end_generator_capture(dev: torch.device) -> None:
    """capture_begin puts the default CUDA generator in capture mode and capture_end takes it out only after CUDA
    ended the capture without error: after a failed capture every later draw from that generator (torch.rand on
    cuda without a generator, dropout) fails torch's assert "Offset increment outside graph capture". A capture
    of one addition, which draws nothing (the generator's offset is unchanged), runs the generator's epilogue."""
    try:
        with CAPTURE_LOCK, torch.cuda.stream(torch.cuda.Stream(dev)):
            graph = torch.cuda.CUDAGraph()
            one = torch.zeros(1, device=dev)
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                one.add_(1)
            finally:
                graph.capture_end()
    except Exception as exc:  # noqa: BLE001 - the eager fallback works without it; say so
        log.warning("the default CUDA generator may be left in capture mode (%s: %s)", type(exc).__name__, exc)


class StaticDecoder:
    """The static-shape decode path of one LlamaDecoder: StaticBatch per (rows, capacity), kept for reuse
    across sample_batch calls (only the latest capacity's: a new capacity drops the others)."""

    def __init__(self, fast: LlamaDecoder, graphs: bool):
        self.fast = fast
        self.graphs = graphs  # capture CUDA graphs (on CUDA tensors only; False after a failed capture)
        self.batches: dict[tuple[int, int], StaticBatch] = {}
        self.table_seen: torch.Tensor | None = None

    def batch(self, rows: int, capacity: int) -> StaticBatch:
        key = (rows, capacity)
        self.fast.table(capacity)  # before any capture: step_static reads the table as it is
        if self.fast.cos is not self.table_seen:
            # A graph holds the addresses of the table it was captured with; a grown table is a new tensor.
            self.batches.clear()
            self.table_seen = self.fast.cos
        if key not in self.batches:
            if any(c != capacity for _, c in self.batches):
                self.batches.clear()  # their caches and graphs go
            self.batches[key] = StaticBatch(self, rows, capacity)
        return self.batches[key]

    def give_up(self, exc: BaseException) -> None:
        log.warning("CUDA graph capture of the decode step failed (%s: %s); decoding eagerly from now on",
                    type(exc).__name__, exc)
        self.graphs = False
        for b in self.batches.values():
            b.graph = b.out = None
