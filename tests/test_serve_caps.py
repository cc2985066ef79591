"""`runner serve`'s caps on what live sessions hold (backends/serve/memory.py, docs/serve.md "Memory caps"):
the N+1th live training run is refused with a 4xx naming --max-models; a run whose bytes do not fit is refused
naming --max-bytes; the estimate of a run's bytes is what its tensors hold; a sampling request's bytes are
reserved before it runs (it waits while runs hold them, runs once a session ends, fails after
max_sample_wait_s, and a request over the cap outright is a 413); and a run the server no longer holds (a
restart) is a 404 that names its last checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.serve import memory
from backends.serve.http import ServeConfig, build_service, running
from backends.serve.limits import Limits
from backends.serve.service import Service

TIMEOUT = 60


def _serve(tmp_path: Path, **limits: Any) -> tuple[Service, Any]:
    service = build_service(ServeConfig(storage=tmp_path / "storage", device="cpu", limits=Limits(**limits)))
    return service, running(service)


def _result(http: httpx.Client, reply: httpx.Response) -> Any:
    assert reply.status_code == 200, reply.text
    rid = reply.json()["request_id"]
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        r = http.post("/retrieve_future", json={"request_id": rid})
        if r.headers["content-type"] != "application/json" or r.json().get("type") != "try_again":
            return r
    raise AssertionError("no result")


def _create(http: httpx.Client, sid: str, seq: int, rank: int) -> httpx.Response:
    return http.post("/create_model", json={"session_id": sid, "model_seq_id": seq, "base_model": "tiny",
                                            "lora_config": {"rank": rank, "seed": 0}})


def _client(url: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", timeout=TIMEOUT)


def _held_tensor_bytes(service: Service) -> int:
    """What the live training clients' tensors hold: adapters, their gradients and AdamW's moments."""
    total = 0
    for run in list(service._runs.values()):
        tc = run.tc.result()
        params = [p for p in tc.model.parameters() if p.requires_grad]
        total += sum(p.nbytes + (p.grad.nbytes if p.grad is not None else 0) for p in params)
        total += sum(t.nbytes for st in tc.optimizer.state.values() for t in st.values() if hasattr(t, "nbytes")
                     and t.dim() > 0)
    return total


@pytest.mark.parametrize("rank, attn, mlp, unembed", [(4, True, True, True), (8, True, False, False),
                                                      (3, False, True, True)])
def test_lora_bytes_is_what_a_trained_client_holds(rank, attn, mlp, unembed, tmp_path):
    """The estimate (made from shapes on the meta device) equals the adapters' size, times 4: the adapters,
    gradients and two AdamW moments a client holds in a step."""
    from backends.local.backend import LocalBackend
    from backends.local.local_config import Local
    from backends.types import AdamParams, Datum, LoraSpec

    backend = LocalBackend(Local(device="cpu"), "tiny", None, tmp_path)
    try:
        tc: Any = backend.create_training_client(LoraSpec("tiny", rank=rank, train_attn=attn, train_mlp=mlp,
                                                          train_unembed=unembed)).result()
        import numpy as np

        d = Datum(model_input=[5, 6, 7, 8], target_tokens=np.array([6, 7, 8, 9]), weights=np.ones(4, np.float32))
        tc.forward_backward([d], "cross_entropy").result()
        grads = sum(p.grad.nbytes for p in tc.model.parameters() if p.requires_grad)
        tc.optim_step(AdamParams(learning_rate=1e-3)).result()
        adapters = sum(p.nbytes for p in tc.model.parameters() if p.requires_grad)
        moments = sum(t.nbytes for st in tc.optimizer.state.values() for t in st.values() if t.dim() > 0)
        est = memory.lora_bytes(memory.shapes("tiny"), rank, attn, mlp, unembed)
        assert adapters + grads + moments == est
    finally:
        backend.close()


def test_the_n_plus_1th_model_is_refused_until_a_session_ends(tmp_path):
    service, srv = _serve(tmp_path, max_models=2)
    with srv as server, _client(f"http://127.0.0.1:{server.server_address[1]}") as http:
        sid = http.post("/create_session", json={}).json()["session_id"]
        for seq in (0, 1):
            assert "model_id" in _result(http, _create(http, sid, seq, 2)).json()
        refused = _create(http, sid, 2, 2)
        assert refused.status_code == 400
        assert "2 live training runs, its cap (--max-models 2)" in refused.json()["detail"]
        assert "higher --max-models" in refused.json()["detail"]
        assert service.memory.runs() == 2
        assert http.post(f"/sessions/{sid}/finish", json={}).status_code == 200
        assert service.memory.runs() == 0
        sid2 = http.post("/create_session", json={}).json()["session_id"]
        assert "model_id" in _result(http, _create(http, sid2, 0, 2)).json()
    service.close()


def test_bytes_held_never_exceed_max_bytes(tmp_path):
    """A cap with room for the base and two rank-64 runs: the third is refused naming --max-bytes, a small one
    still fits, and what the clients' tensors hold after a step stays under the cap."""
    s = memory.shapes("tiny")
    run64 = memory.lora_bytes(s, 64, True, True, True)
    cap = memory.base_bytes(s, 4) + 2 * run64 + run64 // 2
    service, srv = _serve(tmp_path, max_bytes=cap)
    with srv as server, _client(f"http://127.0.0.1:{server.server_address[1]}") as http:
        sid = http.post("/create_session", json={}).json()["session_id"]
        for seq in (0, 1):
            _result(http, _create(http, sid, seq, 64))
        refused = _create(http, sid, 2, 64)
        assert refused.status_code == 400
        detail = refused.json()["detail"]
        assert "a LoRA rank-64 training run of tiny needs" in detail and "higher --max-bytes" in detail
        model = _result(http, _create(http, sid, 3, 8)).json()["model_id"]  # a rank-8 run fits beside them
        step = {"model_id": model, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}}
        _result(http, http.post("/optim_step", json=step))
        assert service.memory.used <= cap
        held = _held_tensor_bytes(service) + memory.base_bytes(s, 4)
        assert 0 < held <= service.memory.used <= cap
    service.close()


def _sample(http: httpx.Client, sampler: str, n: int, max_tokens: int) -> httpx.Response:
    return http.post("/asample", json={"sampling_session_id": sampler, "num_samples": n,
                                       "prompt": {"chunks": [{"tokens": [5, 6, 7]}]},
                                       "sampling_params": {"max_tokens": max_tokens, "seed": 0}})


def test_sampling_bytes_are_reserved_and_wait_for_a_run_to_end(tmp_path):
    """Two runs hold most of the cap: a sample request that needs more than is left waits (nothing else is
    in flight), starts when the session holding the runs ends, and gives its bytes back; one that needs more
    than the whole cap is a 413; one that waits longer than max_sample_wait_s fails naming --max-bytes."""
    s = memory.shapes("tiny")
    need = memory.sample_bytes(s, 4, 64, 3, 32)
    run = memory.lora_bytes(s, 64, True, True, True)
    cap = memory.base_bytes(s, 4) + 2 * run + need // 2
    service, srv = _serve(tmp_path, max_bytes=cap, max_sample_wait_s=3.0)
    with srv as server, _client(f"http://127.0.0.1:{server.server_address[1]}") as http:
        owner = http.post("/create_session", json={}).json()["session_id"]
        for seq in (0, 1):
            _result(http, _create(http, owner, seq, 64))
        sid = http.post("/create_session", json={}).json()["session_id"]
        sampler = http.post("/create_sampling_session", json={"session_id": sid, "sampling_session_seq_id": 0,
                                                              "base_model": "tiny"}).json()["sampling_session_id"]
        too_big = _sample(http, sampler, 1024, 255)
        assert too_big.status_code == 413 and "--max-bytes" in too_big.json()["detail"]
        waiting = _sample(http, sampler, 64, 32)
        deadline = time.monotonic() + TIMEOUT  # (a fixed 1 s sleep before, a third of max_sample_wait_s)
        while service.stats()["waiting_samples"] != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert service.stats()["waiting_samples"] == 1 and service.memory.sampling == 0
        assert http.post(f"/sessions/{owner}/finish", json={}).status_code == 200
        out = _result(http, waiting)
        assert out.headers["content-type"] == "application/x-protobuf"
        assert service.memory.sampling == 0 and service.stats()["waiting_samples"] == 0
        # Runs hold the bytes again and nothing ends: the request fails after max_sample_wait_s (the reaper).
        owner2 = http.post("/create_session", json={}).json()["session_id"]
        for seq in (0, 1):
            _result(http, _create(http, owner2, seq, 64))
        t = time.monotonic()
        failed = _result(http, _sample(http, sampler, 64, 32)).json()
        assert 3.0 <= time.monotonic() - t < 3.0 + 30.0  # the reaper's tick, late on a loaded machine
        assert failed["category"] == "user" and "waited 3 s" in failed["error"]
        assert "higher --max-bytes" in failed["error"]
        assert service.memory.sampling == 0 and service.stats()["waiting_samples"] == 0
    service.close()


def test_a_run_the_server_no_longer_holds_names_its_last_checkpoint(tmp_path):
    """After a restart on the same storage, a request for a run of the old server is a 404 with code
    training_run_not_loaded that says to load its last checkpoint, by path."""
    service, srv = _serve(tmp_path)
    with srv as server, _client(f"http://127.0.0.1:{server.server_address[1]}") as http:
        sid = http.post("/create_session", json={}).json()["session_id"]
        model = _result(http, _create(http, sid, 0, 2)).json()["model_id"]
        for seq, name in ((1, "first"), (2, "second")):
            _result(http, http.post("/save_weights", json={"model_id": model, "seq_id": seq, "path": name}))
    service.close()
    service, srv = _serve(tmp_path)  # the same storage: a restarted server
    with srv as server, _client(f"http://127.0.0.1:{server.server_address[1]}") as http:
        r = http.post("/optim_step", json={"model_id": model, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}})
        assert r.status_code == 404 and r.json()["code"] == "training_run_not_loaded"
        assert f"load its last checkpoint, tinker://{model}/weights/second, with " in r.json()["detail"]
        unknown = http.post("/optim_step", json={"model_id": "s1:train:9", "seq_id": 1,
                                                 "adam_params": {"learning_rate": 1e-3}})
        assert unknown.status_code == 404 and "code" not in unknown.json()
    service.close()


@pytest.mark.parametrize("text, n", [("8G", 8 << 30), ("512M", 512 << 20), ("1.5GiB", 3 << 29), ("4096", 4096),
                                     ("2t", 2 << 40), ("64kb", 64 << 10)])
def test_max_bytes_sizes(text, n):
    assert memory.parse_bytes(text) == n


@pytest.mark.parametrize("args, error", [(["--max-bytes", "lots"], "--max-bytes 'lots' is not a size"),
                                         (["--max-bytes", "0"], "at least 1 byte"),
                                         (["--max-models", "0"], "--max-models 0: must be at least 1"),
                                         # These four were tracebacks after the model loaded (or taken as given):
                                         (["--port", "99999"], "--port 99999: expected 0 (a free port) to 65535"),
                                         (["--port", "-1"], "--port -1: expected 0"),
                                         (["--storage", f"{__file__}/store"], f"{__file__} is a file, not a folder"),
                                         (["--max-live-samplers", "0"], "--max-live-samplers 0: must be at least 1"),
                                         (["--sampler-idle-s", "-1"], "--sampler-idle-s -1.0: must be a number"),
                                         # a user's renderer is taken, as in a recipe (it was "unknown"), and imported
                                         (["--renderer", "nomod:X"], "--renderer: renderer 'nomod:X': cannot import")])
def test_bad_cap_flags_are_one_line_exit_2(args, error, capsys):
    from runner.cli import main

    assert main(["serve", "--port", "0", "--port-file", "unused", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and error in err and err.count("\n") == 1


def test_budget_holds_a_request_that_does_not_fit_beside_runs_then_fails_it():
    """The ledger under the routes: bytes a waiting request needs are taken only when they fit; with nothing in
    flight it fails after max_wait_s; a session ending (pump) starts it."""
    from backends.serve.limits import Budget

    mem = memory.Memory(max_models=4, max_bytes=100)
    budget = Budget(1000, mem, max_wait_s=5.0)
    mem.reserve_run("a", 70, "run a")
    started, failed = [], []
    budget.acquire(10, lambda: started.append("first"), 20, failed.append)  # 70 + 20 <= 100: runs
    budget.acquire(10, lambda: started.append("second"), 20, failed.append)  # 110 > 100: waits
    assert started == ["first"] and mem.sampling == 20 and budget.waiting() == 1
    budget.release(10, 20)  # the first finished: the second fits now
    assert started == ["first", "second"] and mem.sampling == 20
    budget.release(10, 20)
    budget.acquire(10, lambda: started.append("third"), 40, failed.append)  # 70 + 40 > 100, nothing in flight
    budget.expire(time.monotonic() + 1.0)
    assert budget.waiting() == 1 and not failed
    budget.expire(time.monotonic() + 6.0)
    assert budget.waiting() == 0 and len(failed) == 1 and "higher --max-bytes" in failed[0]
    budget.acquire(10, lambda: started.append("fourth"), 40, failed.append)
    mem.release("run:a")
    budget.pump()
    assert started[-1] == "fourth" and mem.used == 40
    with pytest.raises(Exception, match=r"--max-models 4"):
        for i in range(5):
            mem.reserve_run(f"r{i}", 1, "a run")


def test_tinker_backend_marks_a_run_the_server_lost():
    """The tinker backend's reading of the code (runner run resumes on BackendError.state_lost): from a 404's body,
    and from a failed future's text (the SDK passes only that on); other 404s stay the user's errors."""
    tinker = pytest.importorskip("tinker")
    from backends.tinker.backend import to_backend_error

    def not_found(body: dict) -> Exception:
        response = httpx.Response(404, json=body, request=httpx.Request("POST", "http://127.0.0.1/api/v1/optim_step"))
        return tinker.NotFoundError("Error code: 404", response=response, body=body)

    lost = to_backend_error(not_found({"detail": "training run r is not loaded on this server", "code":
                                       "training_run_not_loaded"}), "optim_step #3", "tml-x")
    assert lost.state_lost and not lost.user_error
    assert str(lost) == "optim_step #3: the server no longer holds this client: training run r is not loaded on this server"
    text = to_backend_error(RuntimeError("request req-1 was made before runner serve restarted (training_run_not_loaded)"),
                            "sample #1", "tml-x")
    assert text.state_lost
    other = to_backend_error(not_found({"detail": "unknown training run r"}), "optim_step #3", "tml-x")
    assert not other.state_lost and other.user_error


def test_the_listen_backlog_takes_a_burst():
    """socketserver's backlog of 5 dropped connects while the server was busy (a checkpoint loading, the GIL held):
    measured 18 of 100 clients timed out over an 8 s stall, none with 128 (backends/serve/aio.py BACKLOG)."""
    from backends.serve.aio import BACKLOG

    assert BACKLOG >= 128
