"""runner serve's API beyond the training loop, through the real tinker SDK against the server in a thread:
REST routes (capabilities, training runs, checkpoints list/delete/ttl, weights_info, external weights
download), top-k logprobs, the gspo and stable_reinforce losses, freeing of idle samplers, cancel_future,
quiet client disconnects."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types

from backends.serve.http import ServeConfig, build_service, running

KEY = "tml-test"


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    service = build_service(ServeConfig(storage=tmp_path / "storage", device="cpu", max_live_samplers=2))
    with running(service) as srv:
        yield service, f"http://127.0.0.1:{srv.server_address[1]}"
    service.close()


@pytest.fixture
def sc(server):
    client = tinker.ServiceClient(base_url=server[1], api_key=KEY)
    yield client
    client.close("success").result(timeout=30)


def _sft(tok, text: str) -> types.Datum:
    ids = tok.encode(text)
    inputs: Any = {"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)}  # the SDK converts lists
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def test_rest_routes_checkpoints_and_expiry(server, sc):
    service, url = server
    rc = tinker.RestClient(base_url=url, api_key=KEY)
    caps = rc.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]
    tc = sc.create_lora_training_client("tiny", rank=4, train_unembed=False, user_metadata={"who": "test"}).result()
    tc.forward_backward([_sft(tc.get_tokenizer(), "hello there")], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    a = tc.save_state("a", ttl_seconds=3600).result().path
    b = tc.save_state("b").result().path
    s = tc.save_weights_for_sampler("s").result().path

    run = rc.get_training_run(tc.model_id).result()
    assert run.lora_rank == 4 and run.base_model == "tiny" and run.user_metadata == {"who": "test"}
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == b
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == s
    assert rc.get_training_run_by_tinker_path(a).result().training_run_id == tc.model_id
    listed = rc.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {a, b, s}
    assert next(c for c in listed if c.tinker_path == a).expires_at is not None
    info = rc.get_weights_info_by_tinker_path(a).result()
    assert (info.lora_rank, info.train_unembed, info.train_attn) == (4, False, True)
    assert tc.model_id in [r.training_run_id for r in rc.list_training_runs().result().training_runs]

    rc.delete_checkpoint_from_tinker_path(b).result()
    assert b not in {c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_training_client_from_state(b).result()

    # ttl_seconds: an expired checkpoint is deleted by the housekeeping pass.
    run_id, kind, name = a.removeprefix("tinker://").split("/")
    service.store.set_ttl(run_id, kind, name, -1)
    assert service.store.expire() == [a]
    assert not service.store.checkpoint_dir(run_id, kind, name).exists()
    sc.create_sampling_client(base_model="tiny").result()
    sid = service.pool.ids()[0]
    assert rc.get_sampler(sid).result().base_model == "tiny"


def test_unknown_model_is_a_clear_error(sc):
    with pytest.raises(tinker.BadRequestError, match="not served here; runner serve offers: tiny"):
        sc.create_lora_training_client("Qwen/Qwen3-8B", rank=4).result()


def test_external_weights_download_is_a_peft_adapter(server, sc, tmp_path):
    _, url = server
    tc = sc.create_lora_training_client("tiny", rank=4, seed=0).result()
    tok = tc.get_tokenizer()
    tc.forward_backward([_sft(tok, "some text to learn")], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_weights_external("export").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/export"
    rc = tinker.RestClient(base_url=url, api_key=KEY)
    urls = rc.get_external_weights_urls(path).result().urls
    assert "adapter_config.json" in urls and "adapter_model.safetensors" in urls
    out = tmp_path / "adapter"
    out.mkdir()
    for name, u in urls.items():
        urllib.request.urlretrieve(u, out / name)  # signed URLs: no API key needed
    bad = urls["adapter_config.json"].replace("sig=", "sig=x")
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlretrieve(bad, tmp_path / "nope")

    import peft
    import torch

    from backends.local import model as M

    base = M.load_base(M.resolve_model_dir("tiny"), torch.device("cpu"), torch.float32)
    merged = M.sampling_copy(peft.PeftModel.from_pretrained(base, out))
    prompt = tok.encode("some text")
    lps = tc.save_weights_and_get_sampling_client().result().compute_logprobs(
        types.ModelInput.from_ints(prompt)).result()
    with torch.no_grad():
        logits = merged(input_ids=torch.tensor([prompt])).logits[0].log_softmax(-1)
    ours = [float(logits[i - 1, t]) for i, t in enumerate(prompt) if i > 0]
    assert ours == pytest.approx(lps[1:], abs=1e-4)


@pytest.mark.extras("cookbook", "pyrage")
def test_weights_download_with_cookbook(server, sc, tmp_path, monkeypatch):
    """tinker_cookbook.weights.download: load the state into a new run, export it age-encrypted, download the
    files from their signed URLs, decrypt, delete the export."""
    weights = pytest.importorskip("tinker_cookbook.weights")
    pytest.importorskip("pyrage")
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    tc = sc.create_lora_training_client("tiny", rank=4).result()
    state = tc.save_state("ckpt").result().path
    out = weights.download(tinker_path=state, output_dir=str(tmp_path / "dl"), base_url=server[1])
    assert (Path(out) / "adapter_config.json").is_file() and (Path(out) / "adapter_model.safetensors").is_file()
    rc = tinker.RestClient(base_url=server[1], api_key=KEY)
    assert not [r for r in rc.list_user_checkpoints().result().checkpoints if r.checkpoint_type == "external"]


def test_topk_logprobs(sc):
    tc = sc.create_lora_training_client("tiny", rank=4).result()
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("The cat sat on the"))
    res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=3, temperature=1.0),
                         include_prompt_logprobs=True, topk_prompt_logprobs=4, topk_sample_logprobs=3).result()
    assert res.topk_prompt_logprobs is not None and len(res.topk_prompt_logprobs) == prompt.length
    assert res.topk_prompt_logprobs[0] is None
    ids = prompt.to_ints()
    for i in range(1, prompt.length):
        top = res.topk_prompt_logprobs[i]
        assert top is not None and len(top) == 4
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert res.prompt_logprobs[i] <= top[0][1] + 1e-5
        for t, lp in top:
            if t == ids[i]:
                assert lp == pytest.approx(res.prompt_logprobs[i], abs=1e-4)
    for s in res.sequences:
        assert s.topk_logprobs is not None and len(s.topk_logprobs) == len(s.tokens)
        for tok_id, lp, top in zip(s.tokens, s.logprobs, s.topk_logprobs, strict=True):
            assert lp <= top[0][1] + 1e-5
            for t, tlp in top:
                if t == tok_id:
                    assert tlp == pytest.approx(lp, abs=1e-4)


def _rl_batch(tc, record: bool):
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=record).result()
    prompt = tok.encode("1+2=")
    res = sampler.sample(types.ModelInput.from_ints(prompt), 4,
                         types.SamplingParams(max_tokens=4, seed=5, temperature=1.0, stop=[])).result()
    data = []
    for i, s in enumerate(res.sequences):
        ob = len(prompt) - 1
        adv = [0.0] * ob + [1.0 if i % 2 else -1.0] * len(s.tokens)
        inputs: Any = {
            "target_tokens": [0] * ob + s.tokens, "logprobs": [0.0] * ob + s.logprobs, "advantages": adv,
            "sequence_ratio_mask": np.asarray([0.0] * ob + [1.0] * len(s.tokens), dtype=np.float32)}
        d = types.Datum(model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]), loss_fn_inputs=inputs)
        data.append((d, s, len(prompt)))
    return data


def _provenance(d, s, n_prompt):
    sid = s.sequence_id
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=n_prompt),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(s.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(s.tokens))])


def _strip_mask(d):
    import dataclasses

    return dataclasses.replace(d, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"})


def test_gspo_and_stable_reinforce_on_policy_match_importance_sampling(sc):
    """On-policy (the learner's logprobs are the sampler's) all three losses equal -sum(A) with the same
    gradient; off the recorded sequences stable_reinforce is refused the way the service refuses it."""
    seed = 7
    tcs = {k: sc.create_lora_training_client("tiny", rank=4, seed=seed).result()
           for k in ("importance_sampling", "gspo", "stable_reinforce")}
    batch = _rl_batch(tcs["stable_reinforce"], record=True)
    data = {"importance_sampling": [_strip_mask(d) for d, _, _ in batch],
            "gspo": [d for d, _, _ in batch],
            "stable_reinforce": [_provenance(_strip_mask(d), s, n) for d, s, n in batch]}
    out = {}
    for k, tc in tcs.items():
        fb = tc.forward_backward(data[k], k).result()
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        out[k] = (fb.metrics["loss:sum"], op.metrics["grad_norm:mean"])
    expect = -sum(float(np.sum(d.loss_fn_inputs["advantages"].to_numpy())) for d, _, _ in batch)
    for k, (loss, norm) in out.items():
        assert loss == pytest.approx(expect, abs=1e-3), k
        assert norm == pytest.approx(out["importance_sampling"][1], rel=1e-3), k

    tc = tcs["stable_reinforce"]
    with pytest.raises(tinker.RequestFailedError, match="provenance"):
        tc.forward_backward(data["importance_sampling"], "stable_reinforce").result()
    unrecorded = _rl_batch(tc, record=False)
    with pytest.raises(tinker.RequestFailedError, match="record_stability_info"):
        tc.forward_backward([_provenance(_strip_mask(d), s, n) for d, s, n in unrecorded], "stable_reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="sequence_ratio_mask"):
        tc.forward_backward(data["importance_sampling"], "gspo").result()
    with pytest.raises(tinker.RequestFailedError, match="unknown loss_fn"):
        tc.forward_backward(data["importance_sampling"], "nonsense").result()  # type: ignore[arg-type]
    # A refused request spends its seq id; the client goes on.
    assert tc.forward(data["stable_reinforce"], "stable_reinforce").result().metrics["loss:sum"] < 0


def test_idle_samplers_are_freed_and_rebuilt(server, sc):
    service, _ = server  # max_live_samplers=2
    tc = sc.create_lora_training_client("tiny", rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("Once upon"))
    params = types.SamplingParams(max_tokens=6, seed=11)
    samplers, firsts = [], []
    for i in range(5):
        tc.forward_backward([_sft(tok, f"story number {i} begins")], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
        s = tc.save_weights_and_get_sampling_client().result()
        samplers.append(s)
        firsts.append([q.tokens for q in s.sample(prompt, 2, params).result().sequences])
    service.reap()
    assert service.stats()["live_samplers"] <= 2 and service.stats()["samplers"] == 5
    # The first sampler was freed (its weights spilled to disk) and comes back with the same weights.
    assert [q.tokens for q in samplers[0].sample(prompt, 2, params).result().sequences] == firsts[0]
    assert service.stats()["live_samplers"] <= 2


def test_cancel_future_and_quiet_disconnects(server, caplog):
    import httpx

    _, url = server
    with httpx.Client(base_url=url, headers={"X-API-Key": KEY}) as http:
        assert http.post("/api/v1/cancel_future", json={"request_id": "req-nope"}).status_code == 200
        assert http.post("/api/v1/retrieve_future", json={"request_id": "req-nope"}).status_code == 410
        assert http.post("/api/v1/nonsense", json={}).status_code == 404
        # A retried submit (same X-Idempotency-Key) gets the first answer, not a second session.
        once = [http.post("/api/v1/create_session", json={}, headers={"X-Idempotency-Key": "k1"}).json()
                for _ in range(2)]
        assert once[0] == once[1] != http.post("/api/v1/create_session", json={}).json()
    caplog.set_level(logging.DEBUG, logger="runner.serve")
    host, port = url.removeprefix("http://").split(":")
    for _ in range(3):  # hang up mid-request and right after sending one
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        with socket.create_connection((host, int(port))) as s:
            body = json.dumps({"request_id": "req-nope"}).encode()
            s.sendall(b"POST /api/v1/retrieve_future HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    import time

    time.sleep(0.3)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
