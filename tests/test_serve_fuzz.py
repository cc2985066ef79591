"""Malformed requests against every route of `runner serve` (a Service behind the real HTTP server in a
thread): each one gets a 4xx with a JSON reason, never a dropped connection, a 5xx or a server traceback,
and the server still serves a valid request afterwards."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tinker")
from tinker.proto import tinker_public_pb2 as pb

from backends.serve.http import ServeConfig, build_service, running
from backends.serve.limits import Limits

LIMITS = Limits(max_body_bytes=1 << 20, max_metadata_bytes=1024, max_request_tokens=4096, max_live_tokens=8192)
# Values of every JSON type; a field is fuzzed with those whose type differs from its valid value's.
BAD: list[Any] = ["abc", -7, 1.5, [], {}, True, [1, [2]], {"a": {"b": 1}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    service = build_service(ServeConfig(storage=tmp_path_factory.mktemp("fuzz") / "storage", device="cpu",
                                        limits=LIMITS))
    with running(service) as srv:
        yield service, srv.server_address[1]
    service.close()


class Conn:
    def __init__(self, port: int):
        self.port = port
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(self, method: str, route: str, body: Any = None, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
        self.c.request(method, route if route.startswith("/") else f"/api/v1/{route}", body=data,
                       headers={"content-type": "application/json", **(headers or {})})
        r = self.c.getresponse()
        payload = r.read()
        if r.getheader("connection", "").lower() == "close":
            self.c.close()
            self.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        ctype = r.getheader("content-type", "")
        return r.status, json.loads(payload) if "json" in ctype else payload

    def result(self, rid: str) -> Any:
        for _ in range(100):
            status, out = self.call("POST", "retrieve_future", {"request_id": rid})
            assert status == 200, out
            if not (isinstance(out, dict) and out.get("type") == "try_again"):
                return out
        raise AssertionError("no result")


def _types_differ(a: Any, b: Any) -> bool:
    def kind(x: Any) -> str:
        return "bool" if isinstance(x, bool) else "num" if isinstance(x, (int, float)) else type(x).__name__
    if isinstance(a, float) and isinstance(b, int) and not isinstance(b, bool):
        return False  # an integer is a fine float
    if isinstance(a, int) and not isinstance(a, bool) and isinstance(b, float):
        return True
    return kind(a) != kind(b)


@pytest.fixture(scope="module")
def world(server):
    """A session, a training run and a sampling session, made with valid requests."""
    _, port = server
    c = Conn(port)
    status, out = c.call("POST", "create_session", {"tags": [], "type": "create_session"})
    sid = out["session_id"]
    status, out = c.call("POST", "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                  "lora_config": {"rank": 2}, "type": "create_model"})
    assert status == 200, out
    model_id = c.result(out["request_id"])["model_id"]
    status, out = c.call("POST", "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                             "base_model": "tiny"})
    assert status == 200, out
    return {"session": sid, "model": model_id, "sampler": out["sampling_session_id"], "seq": [100]}


def _templates(w: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A valid body per JSON route (seq ids far ahead, so an accepted one waits harmlessly)."""
    seq = w["seq"]
    seq[0] += 1
    return {
        "session_heartbeat": {"session_id": w["session"]},
        "create_model": {"session_id": w["session"], "model_seq_id": 50 + seq[0], "base_model": "tiny",
                         "lora_config": {"rank": 2, "seed": 1, "train_mlp": True}, "user_metadata": {"a": "b"}},
        "get_info": {"model_id": w["model"]},
        "optim_step": {"model_id": w["model"], "seq_id": seq[0], "adam_params": {"learning_rate": 1e-3, "beta1": 0.9}},
        "save_weights": {"model_id": w["model"], "seq_id": seq[0], "path": "ck", "ttl_seconds": 3600,
                         "overwrite": False, "user_metadata": {"a": "b"}},
        "save_weights_for_sampler": {"model_id": w["model"], "seq_id": seq[0], "sampling_session_seq_id": 9,
                                     "kind": "snapshot"},
        "load_weights": {"session_id": w["session"], "model_seq_id": 90, "path": "tinker://x:train:0/weights/a",
                         "optimizer": False},
        "create_sampling_session": {"session_id": w["session"], "sampling_session_seq_id": 1, "base_model": "tiny"},
        "asample": {"sampling_session_id": w["sampler"], "num_samples": 1, "seq_id": 0,
                    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
                    "sampling_params": {"max_tokens": 2, "temperature": 1.0, "top_k": -1, "top_p": 1.0, "seed": 3},
                    "prompt_logprobs": False, "topk_prompt_logprobs": 0},
        "retrieve_future": {"request_id": "req-1-abc"},
        "cancel_future": {"request_id": "req-1-abc"},
        "weights_info": {"tinker_path": "tinker://x:train:0/weights/a"},
        "copy_weights": {"source_path": "tinker://x:train:0/weights/a", "session_id": w["session"],
                         "model_seq_id": 3},
    }


def _mutations(body: dict[str, Any]):
    """(description, body, must_refuse): every field with every value of another type, nested objects too."""
    for key, good in body.items():
        for bad in BAD:
            if _types_differ(good, bad):
                yield f"{key}={bad!r}", {**body, key: bad}, True
        if isinstance(good, dict):
            for sub, desc_body, refuse in _mutations(good):
                yield f"{key}.{sub}", {**body, key: desc_body}, refuse
        yield f"{key} missing", {k: v for k, v in body.items() if k != key}, False


def _check(status: int, out: Any, what: str, must_refuse: bool) -> None:
    assert status < 500, f"{what}: {status} {out}"
    if status >= 400:
        assert isinstance(out, dict) and isinstance(out.get("detail"), str) and out["detail"], f"{what}: {out}"
    elif must_refuse:
        # Accepted as a submit: then the promise fails as the user's error, or it is a harmless no-op reply.
        assert isinstance(out, dict), f"{what}: {status} {out}"


def test_every_json_route_refuses_malformed_bodies(server, world, caplog):
    caplog.set_level(logging.WARNING, logger="runner.serve")
    _, port = server
    c = Conn(port)
    refused = 0
    templates = _templates(world)
    for route, body in templates.items():
        for what, mutated, must_refuse in _mutations(body):
            status, out = c.call("POST", route, mutated)
            _check(status, out, f"{route} {what}", must_refuse)
            if must_refuse:
                assert 400 <= status < 500, f"{route} {what}: {status} {out}"
                refused += 1
        for raw in (b"{", b"[1, 2]", b'"str"', b"null", b"\xff\xfe garbage", b"[" * 5000 + b"]" * 5000,
                    b'{"a":' * 100 + b"1" + b"}" * 100, b"1e999999", b'{"session_id": "' + b"s" * 300 + b'"}'):
            status, out = c.call("POST", route, raw=raw)
            assert 400 <= status < 500 and out["detail"], f"{route} {raw[:20]!r}: {status} {out}"
            refused += 1
    assert refused > 300
    # Over-long ids, wrong methods, unknown routes.
    for method, route, body in [("POST", "session_heartbeat", {"session_id": "s" * 300}),
                                ("POST", "create_model", {**templates["create_model"], "session_id": "x" * 300}),
                                ("POST", f"sessions/{'s' * 300}/finish", {}),
                                ("POST", "get_info", {"model_id": "../../etc"}),
                                ("GET", "create_session", None), ("DELETE", "asample", None),
                                ("GET", "forward_backward", None), ("POST", "nope/nope", {}),
                                ("PUT", "training_runs", {}), ("GET", "training_runs?limit=abc", None),
                                ("GET", "training_runs/nope/checkpoints/weights/x", None),
                                ("POST", "create_session", {"user_metadata": {"big": "x" * 5000}}),
                                ("GET", "/api/v1/files/a/b/c/d?expires=abc&sig=x", None),
                                ("GET", "/elsewhere", None)]:
        status, out = c.call(method, route, body)
        assert 400 <= status < 500 and out["detail"], f"{method} {route[:40]}: {status} {out}"
    assert not [r for r in caplog.records if r.exc_info], "a malformed request logged a traceback"
    _still_serves(c, world)


def _fb(model_id: str, seq_id: int, tokens: list[int] | None = None, **inputs: np.ndarray) -> pb.ForwardBackwardRequest:
    toks = np.asarray(tokens or [1, 2, 3], np.int32)
    d = pb.Datum()
    d.model_input.add().encoded_text.tokens = toks.tobytes()
    for k, v in inputs.items():
        t = d.loss_fn_inputs[k]
        t.dtype = pb.DTYPE_INT64 if v.dtype == np.int64 else pb.DTYPE_FLOAT32
        t.shape.extend(v.shape)
        t.dense = v.tobytes()
    return pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy", data=[d])


def test_forward_backward_refuses_garbage_protobuf(server, world, caplog):
    caplog.set_level(logging.WARNING, logger="runner.serve")
    _, port = server
    c = Conn(port)
    rng = np.random.default_rng(0)
    good = _fb(world["model"], 1000, target_tokens=np.array([2, 3, 4], np.int64)).SerializeToString()
    bodies = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in (1, 7, 64, 1000)]
    bodies += [good[:n] for n in (3, 10, len(good) // 2, len(good) - 1)]
    bodies += [b"", b"\x0a\xff\xff\xff\xff\x0f", _fb("nope", 1).SerializeToString(),
               _fb("s" * 300, 1).SerializeToString()]
    for body in bodies:
        status, out = c.call("POST", "forward_backward", raw=body, headers={"content-type": "application/x-protobuf"})
        assert 400 <= status < 500 and out["detail"], f"{body[:20]!r}: {status} {out}"
    status, out = c.call("POST", "forward_backward", raw=b"\x28\xb5\x2f\xfd garbage",
                         headers={"content-encoding": "zstd"})
    assert 400 <= status < 500 and out["detail"]
    # Decodable but wrong: a failed future (the user's error), and the seq id is spent (a fresh run, so
    # seq ids 1, 2, ... run now).
    status, out = c.call("POST", "create_model", {"session_id": world["session"], "model_seq_id": 7,
                                                  "base_model": "tiny", "lora_config": {"rank": 2}})
    model_id = c.result(out["request_id"])["model_id"]
    for req in [_fb(model_id, 1, target_tokens=np.array([2, 3], np.int64)),  # wrong length
                _fb(model_id, 2),  # no target_tokens
                _fb(model_id, 3, target_tokens=np.array([2, 3, 4], np.int64), mask=np.ones(3, np.float32)),
                _fb(model_id, 4, tokens=[10**6, 2, 3], target_tokens=np.array([2, 3, 4], np.int64))]:
        status, out = c.call("POST", "forward_backward", raw=req.SerializeToString())
        assert status == 200, out
        res = c.result(out["request_id"])
        assert res.get("category") == "user" and res["error"], res
    status, out = c.call("POST", "forward_backward", raw=_fb(model_id, 5, target_tokens=np.array([2, 3, 4], np.int64),
                                                             weights=np.ones(3, np.float32)).SerializeToString())
    assert status == 200
    assert pb.ForwardBackwardOutput.FromString(c.result(out["request_id"])).metrics["loss:sum"] > 0
    assert not [r for r in caplog.records if r.exc_info]


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _status_and_json(resp: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body.split(b"\r\n\r\n")[0] if b"HTTP/1." in body else body)


@pytest.mark.parametrize("request_bytes, status", [
    (b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}", 400),
    (b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}", 400),
    (b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    (b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999999\r\n\r\n{}", 413),
    (b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n{}", 413),
    # A chunked body over the cap (aiohttp reads chunked bodies; the cap holds while it reads).
    (b"POST /api/v1/create_session HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1e8480\r\n"
     + b" " * 2_000_000 + b"\r\n0\r\n\r\n", 413),
    (b"BREW /api/v1/healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405),
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET /api/v1/healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431),
])
def test_bad_http_framing_is_a_json_4xx(server, request_bytes, status):
    _, port = server
    got, out = _status_and_json(_raw(port, request_bytes))
    assert got == status and out["detail"], (got, out)


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n{}",
    b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1e8480\r\n"
    + b" " * 2_000_000 + b"\r\n0\r\n\r\n",
])
def test_an_oversized_v1_body_is_an_openai_413(server, request_bytes):
    """A body over the cap on a /v1 route is refused unread in OpenAI's error shape (the openai client reads its
    message from it), by its Content-Length or, chunked, as it is read; Tinker's routes keep {"detail": ...} (above)."""
    _, port = server
    got, out = _status_and_json(_raw(port, request_bytes))
    err = out["error"]
    assert got == 413 and "bytes" in err["message"] and str(1 << 20) in err["message"], out
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}


def test_an_oversized_v1_body_read_whole_is_an_openai_413():
    """The /v1 routes check the body cap themselves too (a transport that reads the body whole): OpenAI's shape."""
    from backends.serve.openai_api import OpenAIRoutes

    class Service:
        limits = Limits(max_body_bytes=100)
        api_key = None

    reply = OpenAIRoutes(Service()).handle("POST", "v1/chat/completions", {}, b"{" + b" " * 200 + b"}")
    assert reply.status == 413 and "at most 100" in json.loads(reply.body)["error"]["message"]


def test_body_without_content_length_does_not_desync(server):
    """A body sent with no Content-Length is read as the next request: a 400, then the connection closes (aiohttp
    refuses the whole read that holds it, so the request before it may go unanswered too; nothing runs the body)."""
    _, port = server
    resp = _raw(port, b"POST /api/v1/healthz HTTP/1.1\r\nHost: x\r\n\r\n{\"a\": 1}")
    assert b" 400 " in resp.split(b"\r\n\r\n")[-2] or resp.startswith(b"HTTP/1.0 400"), resp


def test_chunked_bodies_are_read():
    """aiohttp reads a chunked request body (the stdlib server refused it with 411)."""
    from backends.serve.aio import running
    from backends.serve.limits import Limits
    from backends.serve.replies import Reply

    class Echo:
        limits = Limits()

        def handle(self, method, path, headers, body, base_url="", gone=None):
            return Reply.json({"body": body.decode()})

    with running(Echo()) as srv:
        resp = _raw(srv.server_address[1], b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                           b"2\r\n{}\r\n0\r\n\r\n")
    assert resp.startswith(b"HTTP/1.1 200") and resp.endswith(b'{"body": "{}"}'), resp


def _still_serves(c: Conn, world: dict[str, Any]) -> None:
    status, out = c.call("GET", "healthz")
    assert status == 200 and out == {"status": "ok"}
    status, out = c.call("POST", "asample", {"sampling_session_id": world["sampler"], "num_samples": 2,
                                             "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
                                             "sampling_params": {"max_tokens": 3, "seed": 1}})
    assert status == 200, out
    res = c.result(out["request_id"])
    seqs = pb.SampleResponse.FromString(res).sequences
    assert len(seqs) == 2 and all(len(np.frombuffer(s.tokens, np.int32)) >= 1 for s in seqs)


def test_server_still_serves_after_fuzzing(server, world):
    _, port = server
    t = time.monotonic()
    _still_serves(Conn(port), world)
    assert time.monotonic() - t < 90  # a healthz and a small sample: ms idle; a wedged server times out


def test_a_lora_seed_torch_cannot_take_is_a_4xx(server, world):
    """lora_config.seed = 2**64 was accepted and its future failed as the server's error (torch: "Overflow when
    unpacking long long"); torch takes [-2**63, 2**64), and outside that the request is refused (400 under the
    range, 413 over it, as every capped integer)."""
    c = Conn(server[1])
    for seed, refused in [(2**64, True), (-2**63 - 1, True), (2**64 - 1, False), (-5, False)]:
        status, out = c.call("POST", "create_model", {"session_id": world["session"], "model_seq_id": 700 + (seed % 97),
                                                      "base_model": "tiny", "lora_config": {"rank": 2, "seed": seed}})
        if refused:
            assert status in (400, 413) and "seed must be" in out["detail"], (seed, status, out)
        else:
            assert status == 200, (seed, out)
            assert "model_id" in c.result(out["request_id"]), seed
