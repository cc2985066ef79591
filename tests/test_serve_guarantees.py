"""What `runner serve` guarantees beyond the happy path, through the real tinker SDK (and raw HTTP where the
SDK would refuse to send the request): refused training requests leave no gap in the seq ids (the SDK would
hang on try_again), the legacy load_state, inflight samplers that follow later saves, checkpoint expiry on
access, sampling-parameter errors as 4xx, and the sampling caps (a refused num_samples = 1e9, a budget that
queues and comes back)."""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types

from backends.serve.http import ServeConfig, build_service, running
from backends.serve.limits import Limits

KEY = "tml-test"
TIMEOUT = 60  # a hang fails the test instead of the suite


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    limits = Limits(max_request_tokens=20_000, max_live_tokens=40)
    service = build_service(ServeConfig(storage=tmp_path / "storage", device="cpu", limits=limits))
    with running(service) as srv:
        yield service, f"http://127.0.0.1:{srv.server_address[1]}"
    service.close()


@pytest.fixture
def sc(server):
    client = tinker.ServiceClient(base_url=server[1], api_key=KEY)
    yield client
    client.close("success").result(timeout=30)


def _datum(tokens: list[int]) -> types.Datum:
    inputs: Any = {"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)}  # the SDK converts lists
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


DATA = [_datum([5, 6, 7, 8, 9, 10]), _datum([11, 12, 13, 14])]


def _loss(tc) -> float:
    return tc.forward(DATA, "cross_entropy").result(timeout=TIMEOUT).metrics["loss:sum"]


def _step(tc, lr: float = 5e-2) -> None:
    tc.forward_backward(DATA, "cross_entropy").result(timeout=TIMEOUT)
    tc.optim_step(types.AdamParams(learning_rate=lr)).result(timeout=TIMEOUT)


def test_refused_requests_leave_no_seq_gap(sc):
    tc = sc.create_lora_training_client("tiny", rank=2, seed=0).result(timeout=TIMEOUT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(Exception, match="no checkpoint"):
            tc.load_state("tinker://nope:train:0/weights/missing").result(timeout=TIMEOUT)
    _step(tc)  # the next seq id runs: no hang
    with pytest.raises(Exception, match="AdamW only"):
        tc.optim_step(types.DimuonParams(learning_rate=1e-3)).result(timeout=TIMEOUT)
    with pytest.raises(Exception, match="plain file name"):
        tc.save_state(".hidden").result(timeout=TIMEOUT)
    t = time.monotonic()
    _step(tc)
    assert _loss(tc) > 0 and time.monotonic() - t < TIMEOUT


def test_legacy_load_state_restores_weights(sc):
    tc = sc.create_lora_training_client("tiny", rank=2, seed=0).result(timeout=TIMEOUT)
    _step(tc)
    saved = tc.save_state("a").result(timeout=TIMEOUT).path
    at_save = _loss(tc)
    _step(tc)
    _step(tc)
    assert abs(_loss(tc) - at_save) > 1e-4  # training moved on
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert tc.load_state(saved).result(timeout=TIMEOUT).path == saved
        assert _loss(tc) == pytest.approx(at_save, abs=1e-5)
        _step(tc)  # and it trains on from there
        tc.load_state_with_optimizer(saved).result(timeout=TIMEOUT)
    assert _loss(tc) == pytest.approx(at_save, abs=1e-5)


def _prompt_logprobs(sampler) -> np.ndarray:
    out = sampler.compute_logprobs(types.ModelInput.from_ints([5, 6, 7, 8, 9])).result(timeout=TIMEOUT)
    return np.asarray(out[1:], np.float64)


def test_inflight_samplers_follow_later_saves(sc):
    tc = sc.create_lora_training_client("tiny", rank=2, seed=0).result(timeout=TIMEOUT)
    snapshot = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=TIMEOUT)
    w0 = _prompt_logprobs(first)
    _step(tc)
    _step(tc)
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result(timeout=TIMEOUT)
    w1 = _prompt_logprobs(second)
    assert np.abs(w1 - w0).max() > 1e-4
    np.testing.assert_allclose(_prompt_logprobs(first), w1, atol=1e-6)  # the first one follows the save
    np.testing.assert_allclose(_prompt_logprobs(snapshot), w0, atol=1e-6)  # a snapshot does not


def test_expired_checkpoint_is_gone_on_access(server, sc):
    service, url = server
    tc = sc.create_lora_training_client("tiny", rank=2).result(timeout=TIMEOUT)
    path = tc.save_state("short", ttl_seconds=3600).result(timeout=TIMEOUT).path
    sampler_path = tc.save_weights_for_sampler("s", ttl_seconds=3600).result(timeout=TIMEOUT).path
    for p in (path, sampler_path):
        run_id, kind, name = p.removeprefix("tinker://").split("/")
        service.store.set_ttl(run_id, kind, name, -1)  # expired now; no housekeeping sweep runs in between
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_training_client_from_state(path).result(timeout=TIMEOUT)
    with pytest.raises(Exception, match="no checkpoint"):
        sc.create_sampling_client(model_path=sampler_path).result(timeout=TIMEOUT)
    rc = tinker.RestClient(base_url=url, api_key=KEY)
    assert rc.list_checkpoints(tc.model_id).result().checkpoints == []
    assert not service.store.checkpoint_dir(run_id, kind, name).exists()


def _http(url: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": KEY}, timeout=TIMEOUT)


def _sampler(http: httpx.Client) -> str:
    sid = http.post("/create_session", json={}).json()["session_id"]
    return http.post("/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0,
                                                       "base_model": "tiny"}).json()["sampling_session_id"]


def _sample_body(sampler: str, n: int = 1, **params) -> dict:
    return {"sampling_session_id": sampler, "num_samples": n, "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 4, **params}}


@pytest.mark.parametrize("params, reason", [({"seed": "abc"}, "seed must be an integer"),
                                            ({"top_k": -5}, "top_k must be >= -1"),
                                            ({"temperature": -1.0}, "temperature must be in"),
                                            ({"top_p": 0}, "top_p must be in"),
                                            ({"max_tokens": 0}, "max_tokens must be >= 1"),
                                            ({"stop": [1, "x"]}, "stop must be")])
def test_bad_sampling_params_are_4xx(server, params, reason):
    with _http(server[1]) as http:
        r = http.post("/asample", json=_sample_body(_sampler(http), **params))
        assert r.status_code == 400 and reason in r.json()["detail"]


def test_huge_sample_requests_are_refused_at_once(server):
    service, url = server
    with _http(url) as http:
        sampler = _sampler(http)
        t = time.monotonic()
        for n in (10**9, 5000):  # over max_num_samples; over max_request_tokens
            r = http.post("/asample", json=_sample_body(sampler, n))
            assert r.status_code == 413 and "num_samples" in r.json()["detail"]
        assert time.monotonic() - t < 30  # refused, not run (1e9 samples would not end)
        assert service.stats()["live_sample_tokens"] == 0


def test_sampling_budget_queues_and_is_returned(server, monkeypatch):
    """max_live_tokens=40 holds two requests of 3 x (3 + 4) = 21 tokens at a time: five sent at once all
    finish, and the budget is back to zero after."""
    service, url = server
    budget = service.budget
    real_acquire, real_release = budget.acquire, budget.release
    waiting: list[int] = []  # the queue's length after each request came in
    all_in = threading.Event()

    def acquire(*args: Any, **kw: Any) -> None:
        real_acquire(*args, **kw)
        waiting.append(budget.waiting())
        if len(waiting) == 5:
            all_in.set()

    def release(*args: Any, **kw: Any) -> None:
        # Nothing finishes before all five are in (a test thread slower than the sampler saw an empty queue).
        all_in.wait(120)
        real_release(*args, **kw)

    monkeypatch.setattr(budget, "acquire", acquire)
    monkeypatch.setattr(budget, "release", release)
    with _http(url) as http:
        sampler = _sampler(http)
        rids = [http.post("/asample", json=_sample_body(sampler, 3, seed=i)).json()["request_id"] for i in range(5)]
        assert max(waiting) >= 1
        for rid in rids:
            r = http.post("/retrieve_future", json={"request_id": rid})
            while r.headers["content-type"] == "application/json" and r.json().get("type") == "try_again":
                r = http.post("/retrieve_future", json={"request_id": rid})
            assert r.headers["content-type"] == "application/x-protobuf"
    assert service.stats()["live_sample_tokens"] == 0 and service.stats()["waiting_samples"] == 0


def test_gather_dispatches_a_burst_once_it_is_complete():
    """A sampler's first burst goes as soon as it has as many requests as the client's previous sampler had
    (an RL step's next sampler), later ones once they match the sampler's largest burst; otherwise after the
    gap / max wait (here 2 s; a burst that goes at once must land within 1 s, room for a loaded machine)."""
    from backends.serve.samplers import Gather

    g = Gather()
    g.GAP_S, g.MAX_S = 20.0, 2.0
    ran: list[tuple[str, float]] = []

    def burst(key: str, n: int) -> float:
        t = time.monotonic()
        for i in range(n):
            g.add(key, lambda i=i: ran.append((f"{key}{i}", time.monotonic())), group="session")
        while len([r for r in ran if r[0].startswith(key)]) < n:
            time.sleep(0.005)
        return max(t1 for k, t1 in ran if k.startswith(key)) - t

    try:
        assert burst("a", 3) >= 1.9  # nothing known yet: the max wait
        assert burst("b", 3) < 1.0  # the previous sampler had 3: no wait (ms on an idle machine)
        ran.clear()
        assert burst("b", 3) < 1.0  # b's largest burst is 3
    finally:
        g.close()


def test_a_nan_metric_reaches_the_sdk_as_nan(sc):
    """A step whose gradients overflow (here weights of 3e38; on a GPU, a diverged bfloat16 step) has an infinite
    loss and a NaN grad_norm. json.dumps wrote it as the bare word NaN, which is not JSON: the SDK (orjson) raised
    JSONDecodeError on the optim_step reply. The server sends non-finite floats as strings the SDK's models read
    back as floats. A NaN loss input itself is refused (backends/types.py Datum), as a user error."""
    tc = sc.create_lora_training_client("tiny", rank=2, seed=0).result(timeout=TIMEOUT)
    tokens = [5, 6, 7, 8]

    def datum(w: float) -> types.Datum:
        inputs: Any = {"target_tokens": tokens[1:], "weights": [w] * 3}
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)

    with pytest.raises(Exception, match="weights holds nan at position 0: loss inputs must be finite"):
        tc.forward_backward([datum(float("nan"))], "cross_entropy").result(timeout=TIMEOUT)
    fb = tc.forward_backward([datum(3e38)], "cross_entropy").result(timeout=TIMEOUT)
    assert np.isinf(fb.metrics["loss:sum"])
    out = tc.optim_step(types.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).result(timeout=TIMEOUT)
    assert np.isnan(out.metrics["grad_norm:mean"]), out.metrics
