"""The sampler's static-shape decode path (backends/local/static_decode.py) and its shared prefill, on the tiny
Qwen3 model.

On the CPU the static path runs eagerly and must give the eager fast path's tokens and logprobs bit for bit
(fp32 and bf16, greedy, seeded and unseeded rows): its row buckets are multiples of 4 and its KV capacity a
multiple of 16, which the CPU's batch invariance covers (decoding.ROW_QUANTUM). The CUDA graph capture is
checked against the eager static path on CUDA only (`gpu` mark).

    OMP_NUM_THREADS=1 python -m pytest tests/test_static_decode.py
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import transformers

from backends.local import static_decode
from backends.local.sampler import Sampler, SampleRequest
from backends.local.static_decode import capacity_bucket, row_bucket
from backends.local.tiny import build_config, build_tokenizer
from backends.types import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _model(tok, dtype=torch.float32, device=CPU):
    cfg = build_config(tok)
    cfg.initializer_range = 0.2  # peaky: greedy choices have clear margins
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval().to(device, dtype)


def _requests(tok):
    """Mixed prompts, groups, budgets and sampling modes: greedy, seeded (with a stop token that ends some rows
    early, so rows move to smaller buckets), unseeded."""
    return [
        SampleRequest(tok.encode("hello there"), 3, SamplingParams(max_tokens=20, temperature=1.0, seed=7, stop=[])),
        SampleRequest(tok.encode("a much longer prompt than the other ones"), 2, SamplingParams(max_tokens=9, temperature=0.0, stop=[])),
        SampleRequest(tok.encode("x"), 1, SamplingParams(max_tokens=30, temperature=0.7, seed=3, stop=[5, 101])),
        SampleRequest(tok.encode("unseeded"), 2, SamplingParams(max_tokens=12, temperature=1.0, top_k=20, stop=[])),
        SampleRequest(tok.encode("topp"), 4, SamplingParams(max_tokens=40, temperature=1.3, top_p=0.9, seed=11, stop=[7, 9])),
    ]


def _flat(outs):
    return [(s.tokens, s.logprobs, s.stop_reason) for o in outs for s in o.sequences]


def test_buckets():
    assert [row_bucket(n) for n in (1, 3, 4, 5, 8, 9, 64, 65)] == [4, 4, 4, 8, 8, 16, 64, 128]
    assert [capacity_bucket(n) for n in (1, 64, 65, 192, 257)] == [64, 64, 128, 256, 512]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_path_equals_the_eager_fast_path(tok, one_thread, dtype):
    """Same tokens and the same logprobs, bit for bit (tolerance 0), on the CPU; and the static path really ran:
    its steps are bucketed (4, 8, 16 rows), never the eager path's multiples of 4 in between."""
    model = _model(tok, dtype)
    eager = Sampler(model, tok, CPU, seed=1)
    static = Sampler(model, tok, CPU, seed=1)
    static.static_decode = True
    sizes: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _m, a: sizes.append(a[0].shape[0]))
    try:
        got = static.sample_batch(_requests(tok))
    finally:
        hook.remove()
    want = eager.sample_batch(_requests(tok))
    assert _flat(got) == _flat(want)
    assert sizes[1] == 16 and set(sizes[1:]) <= {4, 8, 16}  # 12 rows -> the 16-row bucket, then smaller ones
    assert sorted(static._static.batches) == [(4, 128), (8, 128), (16, 128)]  # kept for the next call
    # A second call reuses those batches (buffers zeroed and reloaded): still the eager path's results.
    assert _flat(static.sample_batch(_requests(tok))) == _flat(eager.sample_batch(_requests(tok)))


def test_static_path_follows_a_new_capacity(tok, one_thread):
    model = _model(tok)
    eager, static = Sampler(model, tok, CPU, seed=2), Sampler(model, tok, CPU, seed=2)
    static.static_decode = True
    for budget in (5, 100, 7):  # capacity 64, then 128 (the 64 batches dropped), then 64 again
        req = [SampleRequest(tok.encode("grow"), 2, SamplingParams(max_tokens=budget, seed=1, stop=[]))]
        assert _flat(static.sample_batch(req)) == _flat(eager.sample_batch(req))
        assert {c for _, c in static._static.batches} == {capacity_bucket(len(tok.encode("grow")) + budget)}


def test_static_batches_count_their_buckets_against_the_cache_budget(tok, one_thread):
    """A static batch of k rows over n slots holds 2 x row_bucket(k) x capacity_bucket(n) slots in the budget
    (its bucket's cache and the smaller ones kept): a budget for 16 such slots takes rows one batch each, and
    the results stay the eager path's."""
    model = _model(tok)
    cfg = model.config
    per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    req = [SampleRequest(tok.encode("b"), 3, SamplingParams(max_tokens=5, seed=1, stop=[]))]  # 1 + 5 slots per row
    eager, static = Sampler(model, tok, CPU, seed=2), Sampler(model, tok, CPU, seed=2)
    static.static_decode = True
    assert [len(c) for c in static._chunks(static._rows(0, req[0]))] == [3]
    static.cache_budget = eager.cache_budget = 2 * 4 * 64 * per_slot  # one bucket of 4 rows x 64 slots
    assert [len(c) for c in static._chunks(static._rows(0, req[0]))] == [3]
    static.cache_budget = 2 * 4 * 64 * per_slot - 1
    assert [len(c) for c in static._chunks(static._rows(0, req[0]))] == [1, 1, 1]
    assert [len(c) for c in eager._chunks(eager._rows(0, req[0]))] == [3]  # 3 x 6 slots fit
    assert _flat(static.sample_batch(req)) == _flat(eager.sample_batch(req))


def test_joins_grow_a_static_batch_within_the_cache_budget(tok, one_thread):
    """Requests joining a static batch grow it to whole row buckets: with room for 12 rows in the budget (2 x 12 x
    64 slots), 4 running rows and two requests of 4 joining made 12 rows, a 16-row bucket (twice the budget's
    slots with the smaller buckets kept). Now the batch grows to 8 rows at most, the last request runs next, and
    each request still gets its results alone."""
    from tests.test_continuous_batching import _stream

    model = _model(tok)
    cfg = model.config
    per_slot = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    sampler = Sampler(model, tok, CPU, seed=2)
    sampler.static_decode = True
    sampler.cache_budget = 2 * 12 * 64 * per_slot
    reqs = [SampleRequest(tok.encode(t), 4, SamplingParams(max_tokens=20, seed=i, stop=[])) for i, t in enumerate(["a", "b", "c"])]
    alone = [sampler.sample_batch([r])[0] for r in reqs]
    got, _, _ = _stream(sampler, reqs[:1], {2: [reqs[1]], 3: [reqs[2]]})
    assert sorted(got) == [0, 1, 2] and all(_flat([got[i]]) == _flat([alone[i]]) for i in range(3))
    assert sampler._static is not None and max(r for r, _ in sampler._static.batches) == 8


def test_shared_prefill_equals_one_prefill_per_row(tok, one_thread):
    """share_prefill (one prefill per distinct prompt, its KV copied into the group's rows) against one prefill
    per row: the same bits on the CPU, on the eager and the static path, and the prefill runs once."""
    model = _model(tok)
    per_row = Sampler(model, tok, CPU, seed=4)
    per_row.share_prefill = False
    want = _flat(per_row.sample_batch(_requests(tok)))
    for static in (False, True):
        shared = Sampler(model, tok, CPU, seed=4)
        shared.static_decode = static
        sizes: list[int] = []
        hook = model.get_input_embeddings().register_forward_pre_hook(lambda _m, a: sizes.append(a[0].shape[0]))
        try:
            assert _flat(shared.sample_batch(_requests(tok))) == want
        finally:
            hook.remove()
        # The prefill's packed tokens: each distinct prompt once, rounded up to 4 rows.
        distinct = sum(len(r.prompt) for r in _requests(tok))
        assert sizes[0] == -(-distinct // 4) * 4


class _Stream:
    def wait_stream(self, _s):
        pass


class _FakeStreams:
    """torch.cuda's stream calls on the CPU: one current stream (the default at first), new side streams,
    torch.cuda.stream's context and torch.cuda.set_stream. A stand-in graph's capture_begin calls `begin`, which
    records the stream the capture runs on and whether the capture lock is held. torch.cuda.graph must not be
    used (it empties the caching allocator before each capture): `graph_ctx` counts its uses."""

    def __init__(self, monkeypatch):
        self.default = self.current = _Stream()
        self.made: list[_Stream] = []
        self.captured_on: list[_Stream] = []
        self.locked: list[bool] = []
        self.graph_ctx = 0
        cuda = static_decode.torch.cuda
        monkeypatch.setattr(cuda, "Stream", self._new)
        monkeypatch.setattr(cuda, "current_stream", lambda *_a: self.current)
        monkeypatch.setattr(cuda, "stream", self._ctx)
        monkeypatch.setattr(cuda, "set_stream", self._set)
        monkeypatch.setattr(cuda, "graph", self._graph)
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: (0, len(self.pools) + 1))
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        self.pools: list[tuple[int, int]] = []  # handed to capture_begin
        self.underway: list[tuple[int, int]] = []  # pools the (stand-in) allocator routes a capture's allocations to
        self.released: list[tuple[int, int]] = []
        monkeypatch.setattr(static_decode.torch._C, "_cuda_endAllocateToPool", self._end, raising=False)
        monkeypatch.setattr(static_decode.torch._C, "_cuda_releasePool", lambda _d, p: self.released.append(p),
                            raising=False)
        monkeypatch.setattr(static_decode.StaticBatch, "_wants_capture", lambda self: self.owner.graphs)

    def _new(self, *_a):
        self.made.append(_Stream())
        return self.made[-1]

    def _set(self, s):
        self.current = s

    @contextlib.contextmanager
    def _ctx(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    def _graph(self, *_a, **_kw):
        self.graph_ctx += 1
        raise RuntimeError("torch.cuda.graph used")

    def _end(self, _device, pool):
        if pool not in self.underway:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.underway.remove(pool)

    def begin(self, capture_error_mode: str, pool=None) -> None:
        assert capture_error_mode == "thread_local"  # a training thread may share the GPU
        if pool is not None:  # a decode step's capture (the generator's reset after a failed one takes none)
            self.pools.append(pool)
            self.underway.append(pool)
        lock = getattr(static_decode, "CAPTURE_LOCK", None)
        self.locked.append(lock is not None and lock.locked())  # one capture at a time in the process
        self.captured_on.append(self.current)


def test_a_failed_capture_falls_back_to_eager_once(tok, one_thread, monkeypatch, caplog):
    """The capture path on the CPU, with CUDA's stream calls stubbed and the capture failing: one warning, the
    step's eager result returned, and no further capture attempts."""
    model = _model(tok)
    eager, static = Sampler(model, tok, CPU, seed=3), Sampler(model, tok, CPU, seed=3)
    static.static_decode = True
    tries: list[int] = []

    def boom():
        tries.append(1)
        raise RuntimeError("capture refused")

    streams = _FakeStreams(monkeypatch)
    monkeypatch.setattr(static_decode.torch.cuda, "CUDAGraph", boom)
    req = [SampleRequest(tok.encode("fallback"), 3, SamplingParams(max_tokens=12, seed=5, stop=[]))]
    with caplog.at_level(logging.WARNING, logger="backends.local.static_decode"):
        got = static.sample_batch(req)
        again = static.sample_batch(req)
    assert _flat(got) == _flat(eager.sample_batch(req)) and _flat(again) == _flat(got)
    assert len(tries) == 1 and not static._static.graphs
    assert streams.current is streams.default
    assert [r.message for r in caplog.records if "CUDA graph" in r.message] == [
        "CUDA graph capture of the decode step failed (RuntimeError: capture refused); decoding eagerly from now on"
    ]


def test_a_capture_failing_at_its_end_gives_the_thread_its_stream_back(tok, one_thread, monkeypatch, caplog):
    """A capture that fails (an op that cannot be captured: capture_end raises) used to leave the capture stream
    current for the thread (torch.cuda.graph's __exit__ restores it only after capture_end), so every later eager
    step ran on that stream while its tensors belonged to the default one. The thread gets its stream back; the
    capture ran on the warm-up's own stream (not torch's one default capture stream for the process), under the
    capture lock, and without torch.cuda.graph (which empties the caching allocator before each capture). And the
    allocator is told the capture is over (torch's capture_end skips that when CUDA reports the failure, and the
    next torch.cuda.empty_cache() then fails an assert), its pool released once; and a capture that draws nothing
    takes the default CUDA generator out of capture mode (the same skip left it there)."""
    model = _model(tok)
    eager, static = Sampler(model, tok, CPU, seed=3), Sampler(model, tok, CPU, seed=3)
    static.static_decode = True

    streams = _FakeStreams(monkeypatch)

    class _Invalidated:
        """The decode step's capture fails at its end; the one-addition capture after it succeeds."""

        def capture_begin(self, pool=None, capture_error_mode="global"):
            streams.begin(capture_error_mode, pool)
            self.step = pool is not None

        def capture_end(self):  # as torch's: CUDA's error raised before the allocator is told the capture ended
            if self.step:
                raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(static_decode.torch.cuda, "CUDAGraph", _Invalidated)
    seen: list[object] = []
    forward = static_decode.StaticBatch._forward
    monkeypatch.setattr(static_decode.StaticBatch, "_forward", lambda self: (seen.append(streams.current), forward(self))[1])
    req = [SampleRequest(tok.encode("fallback"), 3, SamplingParams(max_tokens=12, seed=5, stop=[]))]
    with caplog.at_level(logging.WARNING, logger="backends.local.static_decode"):
        got = static.sample_batch(req)
    assert streams.current is streams.default
    assert static._static is not None and not static._static.graphs
    assert _flat(got) == _flat(eager.sample_batch(req))
    # warm-up and capture on the side stream made for them, then the default generator's one-addition capture
    # on a stream of its own; every other step on the thread's own stream
    assert len(streams.made) == 2 and streams.captured_on == streams.made and streams.locked == [True, True]
    assert streams.graph_ctx == 0
    # the allocator no longer routes to the failed capture's pool, and its reference is dropped, once
    assert streams.underway == [] and streams.released == streams.pools == [(0, 1)]
    assert seen[:2] == [streams.made[0]] * 2 and set(map(id, seen[2:])) == {id(streams.default)}
    assert [r.message for r in caplog.records] == [
        "CUDA graph capture of the decode step failed (RuntimeError: operation not permitted when stream is "
        "capturing); decoding eagerly from now on"]


def test_replayed_steps_read_the_batch_buffers(tok, one_thread, monkeypatch):
    """The capture-and-replay plumbing on the CPU, with a stand-in for CUDA's graph whose replay reruns the
    captured step on the batch's buffers (what a real replay does) and writes the captured output tensor: the
    samples equal the eager path's, and all steps but each batch's first are replays."""
    model = _model(tok)
    eager, static = Sampler(model, tok, CPU, seed=3), Sampler(model, tok, CPU, seed=3)
    static.static_decode = True
    capturing: list[_FakeGraph] = []
    streams = _FakeStreams(monkeypatch)
    forward = static_decode.StaticBatch._forward
    replays: list[int] = []

    class _FakeGraph:
        def __init__(self):
            self.batch = self.out = None

        def capture_begin(self, pool=None, capture_error_mode="global"):
            streams.begin(capture_error_mode, pool)
            capturing.append(self)

        def capture_end(self):
            capturing.pop()
            streams.underway.remove(streams.pools[-1])

        def replay(self):
            replays.append(1)
            self.out.copy_(forward(self.batch))

    def recording_forward(self):
        out = forward(self)
        if capturing:
            capturing[-1].batch, capturing[-1].out = self, out
        return out

    monkeypatch.setattr(static_decode.torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(static_decode.StaticBatch, "_forward", recording_forward)
    assert _flat(static.sample_batch(_requests(tok))) == _flat(eager.sample_batch(_requests(tok)))
    graphs = [b.graph for b in static._static.batches.values()]
    assert len(graphs) == 3 and all(isinstance(g, _FakeGraph) for g in graphs) and len(replays) > 30
    assert streams.captured_on == streams.made and streams.current is streams.default  # each on its warm-up's stream
    assert streams.locked == [True] * 3 and streams.graph_ctx == 0
    assert len(streams.pools) == 3 and streams.underway == streams.released == []  # captured graphs own their pools
    before = len(replays)
    assert _flat(static.sample_batch(_requests(tok))) == _flat(eager.sample_batch(_requests(tok)))
    assert [b.graph for b in static._static.batches.values()] == graphs  # kept: no new capture
    assert len(replays) > before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_replay_equals_eager(tok, dtype):
    """On CUDA: the captured steps against the same static shapes run eagerly. Greedy tokens equal; logprobs
    within 1e-5 (fp32) / 2e-2 (bf16) (a replay runs the same kernels, so they are normally equal too), and
    seeded samples equal."""
    dev = torch.device("cuda")
    model = _model(tok, dtype, dev)
    graph, eager = Sampler(model, tok, dev, seed=1), Sampler(model, tok, dev, seed=1)
    eager.cuda_graphs = False
    assert graph.fast is not None
    got, want = graph.sample_batch(_requests(tok)), eager.sample_batch(_requests(tok))
    assert any(b.graph is not None for b in graph._static.batches.values())
    assert all(b.graph is None for b in eager._static.batches.values())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for (ta, la, ra), (tb, lb, rb) in zip(_flat(got), _flat(want), strict=True):
        assert ta == tb and ra == rb
        assert la == pytest.approx(lb, abs=tol)
    # A second call replays the kept graphs (both samplers' own generators have advanced alike).
    got, want = graph.sample_batch(_requests(tok)), eager.sample_batch(_requests(tok))
    assert [s[0] for s in _flat(got)] == [s[0] for s in _flat(want)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graphs_with_joining_requests(tok):
    """On CUDA (bf16): requests joining a graph-replayed batch (a finished row's slot, then a bigger bucket) get
    the tokens the same stream gets with the graphs off (the same shapes step by step: CUDA promises no batch
    invariance, so "alone" is not the reference here), logprobs within 2e-2."""
    from tests.test_continuous_batching import _stream

    dev = torch.device("cuda")
    model = _model(tok, torch.bfloat16, dev)
    reqs = [r for r in _requests(tok) if r.params.seed is not None or r.params.temperature == 0]  # seeded or greedy
    graph, eager = Sampler(model, tok, dev, seed=1), Sampler(model, tok, dev, seed=1)
    eager.cuda_graphs = False
    want, _, _ = _stream(eager, reqs[:1], {2: [reqs[1]], 4: reqs[2:]})
    got, _, _ = _stream(graph, reqs[:1], {2: [reqs[1]], 4: reqs[2:]})
    assert any(b.graph is not None for b in graph._static.batches.values())
    assert sorted(got) == sorted(want) == list(range(len(reqs)))
    for i in want:
        for a, b in zip(got[i].sequences, want[i].sequences, strict=True):
            assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, abs=2e-2)


def test_out_of_memory_empties_the_cuda_cache_only_between_captures(monkeypatch):
    """A worker's out-of-memory handling empties CUDA's cache (backends/local/worker.py); torch asserts that no
    graph capture is underway there, and a sampling client's thread may be capturing a decode step: it waits for
    the capture lock. (On the CPU, with CUDA's calls stubbed.)"""
    from backends.local import worker

    held: list[bool] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: held.append(static_decode.CAPTURE_LOCK.locked()))
    assert worker.out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is not None
    assert held == [True] and not static_decode.CAPTURE_LOCK.locked()
