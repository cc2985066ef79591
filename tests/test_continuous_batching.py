"""Continuous batching (Sampler.sample_stream, and the local sampling client that decodes through it): requests
that arrive while a batch decodes join it at a step boundary, and each request is delivered as soon as its
samples finish. On the CPU a seeded request's tokens and logprobs are those it gets alone, bit for bit.

    OMP_NUM_THREADS=1 python -m pytest tests/test_continuous_batching.py
"""

from __future__ import annotations

import threading

import pytest
import torch
import transformers

from backends.local.backend import LocalBackend
from backends.local.local_config import Local
from backends.local.sampler import Sampler, SampleRequest
from backends.local.tiny import build_config, build_tokenizer
from backends.types import SampleOutput, SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    cfg = build_config(tok)
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _req(tok, text, n, max_tokens, seed, **kw):
    return SampleRequest(tok.encode(text), n, SamplingParams(max_tokens=max_tokens, temperature=kw.pop("temperature", 1.0),
                                                             seed=seed, stop=kw.pop("stop", []), **kw))


def _flat(out: SampleOutput):
    return [(s.tokens, s.logprobs, s.stop_reason) for s in out.sequences]


def _stream(sampler, first, arrivals):
    """sample_stream with `arrivals` {more() call number: requests}; (results by request number, the more() call
    at which each was delivered, rows per forward)."""
    calls, got, when = [0], {}, {}

    def more():
        calls[0] += 1
        return arrivals.pop(calls[0], [])

    def done(i, out):
        got[i], when[i] = out, calls[0]

    sizes: list[int] = []
    hook = sampler.model.get_input_embeddings().register_forward_pre_hook(lambda _m, a: sizes.append(a[0].shape[0]))
    try:
        sampler.sample_stream(first, more, done)
    finally:
        hook.remove()
    assert not arrivals, "more() was not polled at every step"
    return got, when, sizes


@pytest.mark.parametrize("static", [False, True])
def test_joining_requests_get_their_alone_results(tok, model, one_thread, static):
    reqs = [
        _req(tok, "hello there", 3, 20, 7),
        _req(tok, "a much longer prompt than the other", 2, 9, None, temperature=0.0),
        _req(tok, "x", 1, 30, 3, stop=[5], temperature=0.7),
        _req(tok, "late", 5, 12, 9, top_k=20),
        _req(tok, "later one", 2, 6, 19, top_p=0.8),
    ]
    sampler = Sampler(model, tok, CPU, seed=1)
    sampler.static_decode = static
    alone = [sampler.sample_batch([r])[0] for r in reqs]
    got, when, sizes = _stream(sampler, reqs[:2], {3: [reqs[2]], 6: [reqs[3]], 9: [reqs[4]]})
    for i, r in enumerate(reqs):
        assert _flat(got[i]) == _flat(alone[i]), i
    # The prefill of the first two (46 tokens packed), 3 steps of 8 rows (5 + 3 fillers), "x"'s prefill (one
    # token, 4 rows), and it takes a filler's slot: still 8 rows. "late"'s 5 rows then grow the batch.
    assert sizes[:6] == [48, 8, 8, 8, 4, 8]
    assert sizes[8:10] == [4, 16 if static else 12]
    # Delivered as they finish: the greedy pair (9 tokens) long before the 20-token group, which ends at step 20.
    assert when[1] == 8 and when[0] == 19 and when[3] < when[2]


def test_requests_that_do_not_fit_run_next_and_bad_ones_fail_alone(tok, model, one_thread):
    sampler = Sampler(model, tok, CPU, seed=1)
    small = _req(tok, "ab", 2, 4, 1)  # capacity 16 slots: 2 + 4 tokens
    big = _req(tok, "ab", 1, 40, 2)  # 2 + 40 > 16: waits for the next batch
    bad = SampleRequest(tok.encode("bad"), 1, SamplingParams(max_tokens=0, stop=[]))
    got, when, sizes = _stream(sampler, [small], {2: [big, bad]})
    assert isinstance(got[2], ValueError) and "max_tokens" in str(got[2])
    assert _flat(got[0]) == _flat(sampler.sample_batch([small])[0])
    assert _flat(got[1]) == _flat(sampler.sample_batch([big])[0])
    # small's prefill and 3 steps, then big's own batch: its prefill and 39 steps of 4 rows.
    assert sizes == [4, 4, 4, 4, 4] + [4] * 39 and when[0] < when[1]


def test_client_delivers_a_joining_request_before_the_running_one(tmp_path, one_thread):
    """Through the local sampling client: a short request submitted while a long one decodes joins its batch
    and is delivered while the long one is still decoding; both get their alone results."""
    be = LocalBackend(Local(), "tiny", None, tmp_path, seed=0)
    try:
        sc = be.create_sampling_client(base_model="tiny").result()
        engine = sc._sampler
        long_req = SampleRequest([1, 2, 3], 1, SamplingParams(max_tokens=200, seed=1, stop=[]))
        short_req = SampleRequest([4, 5], 2, SamplingParams(max_tokens=3, seed=2, stop=[]))
        alone = [engine.sample_batch([r])[0] for r in (long_req, short_req)]
        running, submitted, streams = threading.Event(), threading.Event(), []
        inner = engine.sample_stream

        def spy(reqs, more, done):
            streams.append(len(reqs))

            def polled():
                running.set()
                submitted.wait(120)  # the short request is queued before the long one's first step
                return more()
            return inner(reqs, polled, done)

        engine.sample_stream = spy
        delivered: list[str] = []  # in the order the results were set, whenever this thread gets to look
        first = sc.sample(long_req.prompt, long_req.num_samples, long_req.params)
        first.future().add_done_callback(lambda _: delivered.append("long"))
        assert running.wait(60)
        second = sc.sample(short_req.prompt, short_req.num_samples, short_req.params)
        second.future().add_done_callback(lambda _: delivered.append("short"))
        submitted.set()
        out = second.result(120)
        long_out = first.result(120)
        assert delivered == ["short", "long"]  # 3 tokens after joining, of the long one's 200
        assert _flat(out) == _flat(alone[1]) and _flat(long_out) == _flat(alone[0])
        assert streams == [1]  # one decode run served both
    finally:
        be.close()
