"""The local sampling engine (backends/local/sampler.py) on the tiny Qwen3 architecture, CPU, fp32.

Two models: `rand`, random weights made peaky (initializer_range 0.2) so greedy choices have clear margins;
and `counter`, whose greedy continuation of token t is t+1, t+2, ... so stops land at known places.

    OMP_NUM_THREADS=1 python -m pytest tests/test_local_sampler.py
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from backends.local.sampler import Sampler, SampleRequest
from backends.local.tiny import build_config, build_tokenizer
from backends.types import SamplingParams

CPU = torch.device("cpu")
EOS = 258  # <|im_end|>


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _model(tok, attn="sdpa", **overrides):
    cfg = build_config(tok)
    cfg.initializer_range = 0.2
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()


@pytest.fixture(scope="module")
def rand(tok):
    return _model(tok)


# The counter's successor of each token, with a detour through "é" (0xC3 0xA9, one character, two tokens),
# and around the pad token 256 (its embedding is zero, so it can't lead anywhere).
SUCCESSOR = {t: (t + 1) % 259 for t in range(259)} | {0xC3: 0xA9, 0xA9: ord("A"), 255: 257}


@pytest.fixture(scope="module")
def counter(tok):
    """Attention and MLP outputs zeroed, so the last hidden state is the current token's embedding; unembedding
    row SUCCESSOR[t] holds token t's embedding (scaled), so the top logit after t is SUCCESSOR[t]."""
    torch.manual_seed(0)
    cfg = build_config(tok)
    cfg.tie_word_embeddings = False
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        model.lm_head.weight.zero_()
        for t, nxt in SUCCESSOR.items():
            model.lm_head.weight[nxt] += emb[t] * 50
    return model


def _greedy(n, stop=None):
    return SamplingParams(max_tokens=n, temperature=0.0, stop=stop)


def _one(sampler, prompt, params, n=1):
    return sampler.sample_batch([SampleRequest(prompt, n, params)])[0].sequences


def _logits(model, seq):
    with torch.inference_mode():
        return model(torch.tensor([seq])).logits[0].float()


# ---------------------------------------------------------------- stops


def test_counter_model_counts(counter, tok):
    (s,) = _one(Sampler(counter, tok, CPU), tok.encode("a"), _greedy(6, stop=[]))
    assert tok.decode(s.tokens) == "bcdefg" and s.stop_reason == "length"


def test_stop_string_spanning_tokens(counter, tok):
    sampler = Sampler(counter, tok, CPU)
    (s,) = _one(sampler, tok.encode("a"), _greedy(20, stop=["def"]))
    assert tok.decode(s.tokens) == "bcdef" and s.stop_reason == "stop"  # includes the whole stop string
    assert _one(sampler, tok.encode("a"), _greedy(20, stop="def"))[0] == s  # a bare string, as Tinker allows
    # The earliest completed string wins, whatever the list order; sampling at T=1 on this peaky model too.
    (s,) = _one(sampler, tok.encode("a"), SamplingParams(max_tokens=20, stop=["xyz", "cd"], seed=1))
    assert tok.decode(s.tokens) == "bcd" and s.stop_reason == "stop"
    # The prompt's text does not count: "a" + "b" would be "ab", but only generated text is searched.
    (s,) = _one(sampler, tok.encode("a"), _greedy(5, stop=["ab"]))
    assert tok.decode(s.tokens) == "bcdef" and s.stop_reason == "length"


def test_stop_string_in_multibyte_char(counter, tok):
    # After 0xC2 the counter writes 0xC3 0xA9 ("é") then "ABC...". The lone first byte decodes to U+FFFD and
    # must not match; the string is found once its second token lands.
    sampler = Sampler(counter, tok, CPU)
    (s,) = _one(sampler, [0xC2], _greedy(10, stop=["é"]))
    assert s.tokens == [0xC3, 0xA9] and s.stop_reason == "stop"
    (s,) = _one(sampler, [0xC2], _greedy(10, stop=["éAB"]))
    assert tok.decode(s.tokens) == "éAB" and s.stop_reason == "stop"


def test_stop_tokens_eos_and_empty_stop(counter, tok):
    sampler = Sampler(counter, tok, CPU)
    (s,) = _one(sampler, [250], _greedy(20))  # stop=None: the model's EOS
    assert s.tokens == [251, 252, 253, 254, 255, 257, EOS] and s.stop_reason == "stop"
    (s,) = _one(sampler, [250], _greedy(10, stop=[]))  # []: EOS is just a token
    assert s.tokens == [251, 252, 253, 254, 255, 257, EOS, 0, 1, 2] and s.stop_reason == "length"
    (s,) = _one(sampler, [250], _greedy(20, stop=[255, 253]))  # token ids, first hit wins
    assert s.tokens == [251, 252, 253] and s.stop_reason == "stop"


def test_max_tokens_and_context_limit(rand, tok):
    (s,) = _one(Sampler(rand, tok, CPU), [1, 2, 3], SamplingParams(max_tokens=7, stop=[]))
    assert len(s.tokens) == len(s.logprobs) == 7 and s.stop_reason == "length"
    short = _model(tok, max_position_embeddings=16)
    sampler = Sampler(short, tok, CPU)
    (s,) = _one(sampler, list(range(10)), SamplingParams(max_tokens=100, stop=[]))
    assert len(s.tokens) == 6 and s.stop_reason == "length"  # prompt + completion fill the context exactly
    with pytest.raises(ValueError, match="context"):
        _one(sampler, list(range(16)), SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    "request_, match",
    [
        (([], 1, SamplingParams()), "empty prompt"),
        (([1, 259], 1, SamplingParams()), "259 outside the vocabulary"),
        (([-1], 1, SamplingParams()), "outside the vocabulary"),
        (([1], 0, SamplingParams()), "num_samples"),
        (([1], 1, SamplingParams(max_tokens=0)), "max_tokens"),
        (([1], 1, SamplingParams(temperature=-1)), "temperature"),
        (([1], 1, SamplingParams(temperature=math.inf)), "temperature must be finite"),
        (([1], 1, SamplingParams(temperature=math.nan)), "temperature must be finite"),
        (([1], 1, SamplingParams(top_p=0)), "top_p"),
        (([1], 1, SamplingParams(stop=[1, "x"])), "mix"),
        (([1], 1, SamplingParams(stop=[999])), "stop token id 999"),
    ],
)
def test_bad_requests_raise_value_error(rand, tok, request_, match):
    with pytest.raises(ValueError, match=match):
        Sampler(rand, tok, CPU).sample_batch([SampleRequest([5, 6], 1, SamplingParams()), SampleRequest(*request_)])


# ---------------------------------------------------------------- correctness against the plain forward


def test_greedy_equals_argmax_decoding(rand, tok):
    prompt = tok.encode("hello there")
    (s,) = _one(Sampler(rand, tok, CPU), prompt, _greedy(24, stop=[]))
    seq = list(prompt)
    for _ in range(24):
        seq.append(int(_logits(rand, seq)[-1].argmax()))
    assert s.tokens == seq[len(prompt) :]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=1e-40, stop=[]),
                                    SamplingParams(max_tokens=12, temperature=5e-324, seed=3, stop=[]),
                                    SamplingParams(max_tokens=12, top_p=1e-300, stop=[]),
                                    SamplingParams(max_tokens=12, temperature=0.7, top_p=1e-9, top_k=5, stop=[])])
def test_below_the_floors_is_greedy(rand, tok, params):
    """A temperature below TEMPERATURE_FLOOR samples greedily, a top_p below TOP_P_FLOOR keeps only the top token
    (backends/types.py). Before: 'index 259 is out of bounds' (logits / 1e-40 overflowed; 1e-300 rounds to 0 in
    float32 and dropped every token). Mixed in one batch with ordinary rows, which still sample."""
    prompt = tok.encode("hello there")
    sampler = Sampler(rand, tok, CPU)
    (greedy,) = _one(sampler, prompt, _greedy(12, stop=[]))
    outs = sampler.sample_batch([SampleRequest(prompt, 2, params),
                                 SampleRequest(prompt, 2, SamplingParams(max_tokens=12, stop=[], seed=1))])
    assert [s.tokens for s in outs[0].sequences] == [greedy.tokens] * 2
    assert all(math.isfinite(lp) for s in outs[0].sequences for lp in s.logprobs)
    assert all(s.tokens != greedy.tokens for s in outs[1].sequences)  # the seeded T = 1 rows are not greedy


def test_sampled_logprobs_match_compute_logprobs(rand, tok):
    sampler = Sampler(rand, tok, CPU)
    prompts = [tok.encode("x"), tok.encode("a longer prompt here")]
    outs = sampler.sample_batch([SampleRequest(p, 2, SamplingParams(max_tokens=16, stop=[])) for p in prompts])
    seqs = [p + s.tokens for p, o in zip(prompts, outs) for s in o.sequences]
    scored = sampler.compute_logprobs_batch(seqs)
    for seq, lps, s in zip(seqs, scored, [s for o in outs for s in o.sequences]):
        assert lps[0] is None and len(lps) == len(seq)
        assert lps[len(seq) - 16 :] == pytest.approx(s.logprobs, abs=1e-4)


def test_logprobs_at_temperature_ignore_truncation(rand, tok):
    """At T != 1 a sampled token's logprob is under softmax(logits / T), before top-k/top-p: the hosted Tinker
    service's behaviour (docs/logprobs.md). compute_logprobs of the same sequence stays at T = 1."""
    prompt = tok.encode("temperature")
    params = SamplingParams(max_tokens=8, temperature=0.6, top_k=4, top_p=0.9, stop=[], seed=3)
    sampler = Sampler(rand, tok, CPU)
    (s,) = _one(sampler, prompt, params)
    logits = _logits(rand, prompt + s.tokens)[len(prompt) - 1 : -1]
    want = (logits / 0.6).log_softmax(-1).gather(1, torch.tensor(s.tokens)[:, None])[:, 0]
    assert s.logprobs == pytest.approx(want.tolist(), abs=1e-4)
    raw = logits.log_softmax(-1).gather(1, torch.tensor(s.tokens)[:, None])[:, 0]
    (recomputed,) = sampler.compute_logprobs_batch([prompt + s.tokens])
    assert recomputed[len(prompt):] == pytest.approx(raw.tolist(), abs=1e-4)
    assert max(abs(a - b) for a, b in zip(s.logprobs, raw.tolist())) > 1e-2  # the two really differ at T = 0.6
    (g,) = _one(Sampler(rand, tok, CPU), prompt, _greedy(8, stop=[]))  # T=0 reports T=1 logprobs
    want = _logits(rand, prompt + g.tokens)[len(prompt) - 1 : -1].log_softmax(-1)
    assert g.logprobs == pytest.approx(want.gather(1, torch.tensor(g.tokens)[:, None])[:, 0].tolist(), abs=1e-4)


def test_compute_logprobs_batch_matches_single(rand, tok):
    sampler = Sampler(rand, tok, CPU)
    seqs = [[5], [1, 2], tok.encode("some text"), tok.encode("a much longer piece of text than that")]
    batched = sampler.compute_logprobs_batch(seqs)
    assert batched[0] == [None]
    for seq, lps in zip(seqs[1:], batched[1:]):
        want = _logits(rand, seq)[:-1].log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
        assert lps[0] is None and lps[1:] == pytest.approx(want.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="empty"):
        sampler.compute_logprobs_batch([[1, 2], []])


def test_left_padding_changes_nothing(rand, tok):
    sampler = Sampler(rand, tok, CPU)
    short = tok.encode("hi")
    (alone,) = _one(sampler, short, _greedy(20, stop=[]))
    outs = sampler.sample_batch(
        [
            SampleRequest(tok.encode("a far longer prompt to force left padding"), 1, _greedy(20, stop=[])),
            SampleRequest(short, 1, _greedy(20, stop=[])),
            SampleRequest(tok.encode("medium length"), 1, _greedy(20, stop=[])),
        ]
    )
    (padded,) = outs[1].sequences
    assert padded.tokens == alone.tokens
    assert padded.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


@pytest.mark.parametrize("attn", ["eager", "hf-sdpa", "hf-eager", "2d-mask"])
def test_other_attention_paths_agree(rand, tok, attn):
    """The sampler's plain-tensor path (the reference here) agrees with HF's modules decoding: under sdpa and
    eager attention (hf-*: the per-row cache slots, eager with its 4-D additive mask) and through the generic
    2-D mask path."""
    requests = [SampleRequest(tok.encode("left padded"), 1, _greedy(12, stop=[])),
                SampleRequest(tok.encode("x"), 1, _greedy(12, stop=[]))]
    ref = Sampler(rand, tok, CPU).sample_batch(requests)
    if attn.endswith("eager"):
        sampler = Sampler(_model(tok, attn="eager"), tok, CPU)
    else:
        sampler = Sampler(rand, tok, CPU)
    if attn.startswith("hf-"):
        sampler.fast = None
    elif attn == "2d-mask":
        sampler.attn_impl = "generic"  # as for flash-attention or sliding-window models
    for a, b in zip(ref, sampler.sample_batch(requests)):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-5)


def _family_model(kind: str, **extra):
    common = {
        "vocab_size": 259, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "initializer_range": 0.2, "pad_token_id": 256, "eos_token_id": 258, "tie_word_embeddings": kind != "llama",
    }
    llama3_rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = {
        # Biases everywhere and a rope_type with its own frequency table.
        "llama": lambda: transformers.LlamaConfig(**common, attention_bias=True, mlp_bias=True,
                                                  rope_parameters=llama3_rope, **extra),
        "qwen2": lambda: transformers.Qwen2Config(**common, **extra),  # q/k/v biases
        "mistral": lambda: transformers.MistralConfig(**common, **{"sliding_window": None, **extra}),
        "qwen3": lambda: transformers.Qwen3Config(**common, **extra),  # q/k norms
    }[kind]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3"])
def test_fast_path_of_each_family_matches_hf(tok, kind, one_thread):
    """The plain-tensor path (llama.LlamaDecoder) of every family it takes gives HF's greedy tokens, with
    logprobs within 1e-5 of a plain HF forward of the whole sequence and of HF's modules decoding."""
    model = _family_model(kind)
    sampler = Sampler(model, tok, CPU)
    assert sampler.fast is not None
    requests = [SampleRequest(tok.encode("a longer prompt, thirty-odd bytes"), 1, _greedy(20, stop=[])),
                SampleRequest(tok.encode("short"), 2, _greedy(20, stop=[]))]
    fast = sampler.sample_batch(requests)
    sampler.fast = None
    hf = sampler.sample_batch(requests)
    for r, a, b in zip(requests, fast, hf):
        prompt = r.prompt
        for s, h in zip(a.sequences, b.sequences):
            assert s.tokens == h.tokens
            assert s.logprobs == pytest.approx(h.logprobs, abs=1e-5)
            lp = _logits(model, prompt + s.tokens).log_softmax(-1)
            ref = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(s.tokens)]
            assert s.logprobs == pytest.approx(ref, abs=1e-5)


def test_fast_path_declines_what_it_does_not_know(tok):
    """Sliding-window attention (and any non-Llama-family model) decodes through HF's modules."""
    sampler = Sampler(_family_model("mistral", sliding_window=8), tok, CPU)
    assert sampler.fast is None
    (s,) = _one(sampler, tok.encode("a prompt longer than the window"), _greedy(12, stop=[]))
    assert len(s.tokens) == 12


# ---------------------------------------------------------------- seeds and mixed batches


def test_seed_reproducible_whatever_the_batch(rand, tok):
    prompt = tok.encode("seeded")
    params = SamplingParams(max_tokens=12, seed=7, stop=[])
    alone = _one(Sampler(rand, tok, CPU), prompt, params, n=3)
    crowd = (
        Sampler(rand, tok, CPU, seed=99)
        .sample_batch(
            [
                SampleRequest(tok.encode("a longer prompt first, so the seeded one is padded"), 4,
                              SamplingParams(max_tokens=20)),
                SampleRequest(prompt, 3, params),
                SampleRequest(tok.encode("greedy"), 1, _greedy(3)),
            ]
        )[1]
        .sequences
    )
    assert [s.tokens for s in crowd] == [s.tokens for s in alone]
    assert len({tuple(s.tokens) for s in alone}) == 3  # each sample index has its own stream
    other = _one(Sampler(rand, tok, CPU), prompt, SamplingParams(max_tokens=12, seed=8, stop=[]), n=3)
    assert [s.tokens for s in other] != [s.tokens for s in alone]


def test_sample_k_of_seed_s_is_the_one_sample_of_seed_s_plus_k(rand, tok):
    """n samples seeded s are n one-sample requests seeded s, s+1, ... (logprobs too): the RL rollouts send a
    group's members as one request (runner/rl/rollouts.py _FirstTurn) and get the tokens they would alone."""
    prompt = tok.encode("group")
    params = SamplingParams(max_tokens=10, temperature=1.5, stop=[], seed=2**31 - 2)
    together = _one(Sampler(rand, tok, CPU), prompt, params, n=4)
    alone = [_one(Sampler(rand, tok, CPU), prompt, SamplingParams(max_tokens=10, temperature=1.5, stop=[],
                                                                  seed=params.seed + k))[0] for k in range(4)]
    assert [(s.tokens, s.logprobs) for s in together] == [(s.tokens, s.logprobs) for s in alone]
    assert len({tuple(s.tokens) for s in together}) > 1


def test_unseeded_reproducible_from_sampler_seed(rand, tok):
    def calls(seed):
        sampler = Sampler(rand, tok, CPU, seed=seed)
        params = SamplingParams(max_tokens=10, stop=[])
        return [[s.tokens for s in sampler.sample_batch([SampleRequest([1, 2, 3], 2, params)])[0].sequences] for _ in range(2)]

    first = calls(0)
    assert first == calls(0) and first != calls(1)
    assert first[0] != first[1]  # the generator moves on between calls


def test_mixed_params_in_one_batch(rand, tok):
    p1, p2, p3, p4 = tok.encode("one"), tok.encode("prompt two"), tok.encode("3"), tok.encode("four four")
    requests = [
        SampleRequest(p1, 1, _greedy(30, stop=[])),
        SampleRequest(p2, 2, SamplingParams(max_tokens=25, temperature=0.8, top_k=3, stop=[], seed=1)),
        SampleRequest(p3, 2, SamplingParams(max_tokens=2, top_p=0.3, stop=[])),
        SampleRequest(p4, 1, SamplingParams(max_tokens=40, temperature=1.3, top_k=10, top_p=0.8, stop=[], seed=2)),
    ]
    sampler = Sampler(rand, tok, CPU)
    outs = sampler.sample_batch(requests)
    assert [len(o.sequences) for o in outs] == [1, 2, 2, 1]
    assert [len(s.tokens) for o in outs for s in o.sequences] == [30, 25, 25, 2, 2, 40]
    # Rows that finish early are dropped mid-decode; the greedy and seeded rows still match running alone.
    for i in (0, 1, 3):
        alone = Sampler(rand, tok, CPU).sample_batch([requests[i]])[0]
        assert [s.tokens for s in alone.sequences] == [s.tokens for s in outs[i].sequences]
    # Every sampled token lies inside its row's top-k / nucleus.
    for r, out in zip(requests[1:], outs[1:]):
        prompt, params = r.prompt, r.params
        for s in out.sequences:
            scaled = _logits(rand, prompt + s.tokens)[len(prompt) - 1 : -1] / params.temperature
            for step, token in enumerate(s.tokens):
                order = scaled[step].argsort(descending=True).tolist()
                allowed = order[: params.top_k] if params.top_k > 0 else order
                probs = scaled[step][allowed].softmax(-1)
                before = (probs.cumsum(-1) - probs).tolist()
                allowed = [t for t, b in zip(allowed, before) if b < params.top_p]
                assert token in allowed


def _batch_sizes(model, fn):
    """Rows fed to each forward while fn runs (counted at the input embeddings, which the HF path and the
    sampler's plain-tensor path both call once per forward)."""
    sizes: list[int] = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: sizes.append(args[0].shape[0]))
    try:
        return fn(), sizes
    finally:
        handle.remove()


def test_finished_rows_leave_the_batch(rand, tok, one_thread):
    sampler = Sampler(rand, tok, CPU)
    requests = [SampleRequest([i + 1, 2, 3], 1, _greedy(2 if i < 6 else 12, stop=[])) for i in range(8)]
    outs, sizes = _batch_sizes(rand, lambda: sampler.sample_batch(requests))
    assert [len(o.sequences[0].tokens) for o in outs] == [2] * 6 + [12] * 2
    # Prefill (the 8 prompts' 3 tokens each, packed into one matrix), step 2, then the two long rows and two
    # finished ones: no forward has fewer than 4 rows (batch invariance, see decoding.ROW_QUANTUM).
    assert sizes == [8 * 3, 8] + [4] * 10
    # Samples of one prompt share a single prefill (its 3 tokens, packed rows rounded up to 4).
    outs, sizes = _batch_sizes(rand, lambda: sampler.sample_batch([SampleRequest([5, 6, 7], 6, _greedy(4, stop=[]))]))
    assert sizes[0] == 4 and sizes[1:] == [8] * 3  # 6 rows and 2 fillers
    assert all(s == outs[0].sequences[0] for s in outs[0].sequences)
    (alone,) = _one(sampler, [5, 6, 7], _greedy(4, stop=[]))
    assert outs[0].sequences[0].tokens == alone.tokens
    assert outs[0].sequences[0].logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_rows_over_the_cache_budget_run_in_turn(rand, tok, one_thread):
    requests = [SampleRequest(tok.encode(f"chunk {i}"), 2, SamplingParams(max_tokens=6, stop=[], seed=i)) for i in range(5)]
    whole = Sampler(rand, tok, CPU).sample_batch(requests)
    sampler = Sampler(rand, tok, CPU)
    sampler.cache_budget = 1  # one row per decode batch
    split, sizes = _batch_sizes(rand, lambda: sampler.sample_batch(requests))
    # Per batch, one real row and three fillers sharing its prompt: a prefill of its 7 tokens (packed rows
    # rounded up to 8), then 5 steps of 4 rows.
    assert sizes == ([8] + [4] * 5) * 10
    assert [s.tokens for o in split for s in o.sequences] == [s.tokens for o in whole for s in o.sequences]
    assert [s.logprobs for o in split for s in o.sequences] == [s.logprobs for o in whole for s in o.sequences]


@pytest.mark.parametrize("threads", [1])
def test_batch_invariant_samples_and_logprobs(rand, tok, threads):
    """A request's tokens and logprobs are bit-identical alone or coalesced with any other requests (prompt
    lengths, sample counts, budgets and temperatures all mixed), and so are compute_logprobs results: what
    makes a seeded local run repeat exactly however its requests were batched. The backend's samplers run
    one thread on the CPU, and that is what is promised (see the one_thread fixture)."""
    import random

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(threads)
        sampler = Sampler(rand, tok, CPU, seed=5)
        requests = []
        for i in range(10):
            prompt = [rng.randrange(256) for _ in range(rng.choice([1, 3, 15, 16, 17, 40, 90]))]
            params = SamplingParams(
                max_tokens=rng.choice([1, 6, 17, 40]),
                temperature=rng.choice([0.0, 0.7, 2.0]),
                top_k=rng.choice([-1, 20]),
                seed=100 + i,
                stop=[rng.randrange(256)],
            )
            requests.append(SampleRequest(prompt, rng.choice([1, 2, 3, 5, 8]), params))
        alone = [sampler.sample_batch([r])[0] for r in requests]
        for _ in range(4):
            picked = rng.sample(range(len(requests)), rng.randint(2, len(requests)))
            for i, out in zip(picked, sampler.sample_batch([requests[i] for i in picked])):
                assert [(s.tokens, s.logprobs, s.stop_reason) for s in out.sequences] == [
                    (s.tokens, s.logprobs, s.stop_reason) for s in alone[i].sequences
                ]
        seqs = [r.prompt + o.sequences[0].tokens for r, o in zip(requests, alone)]
        assert sampler.compute_logprobs_batch(seqs) == [sampler.compute_logprobs_batch([s])[0] for s in seqs]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bfloat16_model_samples(tok, attn):
    """The bf16 path (CUDA's default dtype), run on the CPU: the cache buffers, masks and logprobs follow the
    model's dtype, and seeded samples stay batch-invariant in tokens. (CUDA itself is not exercised here.)"""
    model = _model(tok, attn=attn).to(torch.bfloat16)
    sampler = Sampler(model, tok, CPU)
    params = SamplingParams(max_tokens=10, seed=3, stop=[], temperature=0.8)
    (alone,) = sampler.sample_batch([SampleRequest(tok.encode("bf16"), 2, params)])
    crowd = sampler.sample_batch([SampleRequest(tok.encode("a longer prompt first"), 3, params),
                                  SampleRequest(tok.encode("bf16"), 2, params)])
    assert [s.tokens for s in crowd[1].sequences] == [s.tokens for s in alone.sequences]
    for s in alone.sequences:
        assert len(s.tokens) == 10 and all(lp <= 0 and not math.isnan(lp) for lp in s.logprobs)

