"""`runner serve`'s streams and tool calls over HTTP (backends/serve/streaming.py, responses.py, docs/openai.md), with a
scripted sampler in place of the model: it "samples" a fixed reply token by token, calling each row's watch hook as
the local sampler does (backends/local/decoding.py Row.add), so what is streamed, parsed and cancelled is known
exactly and no trained model is needed.

- a 10-token chat reply arrives in >= 2 content chunks, which add up to the non-streamed reply;
- a reply in the renderer's tool-call format comes back as `tool_calls` with finish_reason "tool_calls", streamed
  or not, and as a function_call item from /v1/responses;
- /v1/responses streams its events as the tokens come (several output_text.delta), ending in response.completed
  whose output_text is the deltas' sum;
- a stream with logprobs carries one logprob per token of the reply;
- a client that hangs up mid-stream ends its sampling at its next token and its budget comes back.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from backends.base import Future
from backends.serve.http import ServeConfig, build_service, running
from backends.serve.service import Service
from backends.types import SampledSequence, SampleOutput, SamplingParams
from runner.tools.openai_serve import serve_hooks

CALL = 'Adding.\nCALL add {"a": 1, "b": 2}'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


class Scripted:
    """A sampling client whose every sample is `tokens` (cut at max_tokens), one token each `delay` s."""

    def __init__(self, tokens: list[int], delay: float = 0.01):
        self.tokens = tokens
        self.delay = delay
        self.emitted = 0  # tokens handed out, all rows together
        self.stopped = threading.Event()  # a watch hook said stop

    def sample(self, prompt: list[int], n: int, params: SamplingParams) -> Future[SampleOutput]:
        inner: concurrent.futures.Future[SampleOutput] = concurrent.futures.Future()
        watch = getattr(params, "watch", None)

        def run() -> None:
            seqs = []
            for k in range(n):
                toks: list[int] = []
                for t in self.tokens[: params.max_tokens]:
                    time.sleep(self.delay)
                    toks.append(t)
                    self.emitted += 1
                    if watch is not None and not watch(k, t, None):
                        self.stopped.set()
                        break
                whole = len(toks) == len(self.tokens)
                seqs.append(SampledSequence(toks, [-0.25] * len(toks), "stop" if whole else "length"))
            inner.set_result(SampleOutput(seqs))

        threading.Thread(target=run, daemon=True).start()
        return Future(inner)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    svc = build_service(ServeConfig(storage=tmp_path_factory.mktemp("stream") / "s", device="cpu",
                                    openai=serve_hooks()))
    tok = svc.models["tiny"].engine().get_tokenizer()
    fmt = svc.openai.hooks.chat("tiny", tok, None)  # type: ignore[union-attr]
    stop = list(fmt.chat.stop_tokens)  # type: ignore[attr-defined]
    script: dict[str, Scripted] = {}
    svc.pool.client = lambda sess: Future.completed(script["now"])  # type: ignore[method-assign]
    with running(svc) as srv:
        yield {"svc": svc, "url": srv.url, "tok": tok, "stop": stop, "script": script}
    svc.close()


def _script(world: dict[str, Any], text: str, delay: float = 0.01, stop: bool = True) -> Scripted:
    tokens = [*world["tok"].encode(text, add_special_tokens=False), *(world["stop"] if stop else [])]
    world["script"]["now"] = s = Scripted(tokens, delay)
    return s


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def _chat(world: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, **extra}


def test_a_ten_token_reply_streams_in_several_chunks(world):
    s = _script(world, " one two three four five six seven eight nine ten")
    n_tokens = len(s.tokens) - len(world["stop"])
    assert n_tokens >= 10
    whole = httpx.post(f"{world['url']}/v1/chat/completions", json=_chat(world), timeout=60).json()
    with httpx.stream("POST", f"{world['url']}/v1/chat/completions", json=_chat(world, stream=True), timeout=60) as r:
        chunks = _events(r)
    texts = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert sum(1 for t in texts if t) >= 2, texts
    assert "".join(t or "" for t in texts) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_tool_calls_are_parsed_streamed_or_not(world):
    _script(world, CALL)
    whole = httpx.post(f"{world['url']}/v1/chat/completions", json=_chat(world, tools=TOOLS), timeout=60).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    with httpx.stream("POST", f"{world['url']}/v1/chat/completions", json=_chat(world, tools=TOOLS, stream=True),
                      timeout=60) as r:
        chunks = _events(r)
    calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"] for c in calls] == [call["function"]] and calls[0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    r = httpx.post(f"{world['url']}/v1/responses", json={"model": "tiny", "input": "Add 1 and 2.", "tools": [
        {"type": "function", "name": "add", "parameters": TOOLS[0]["function"]["parameters"]}]}, timeout=60).json()
    fc = [o for o in r["output"] if o["type"] == "function_call"]
    assert [(o["name"], o["arguments"]) for o in fc] == [("add", '{"a": 1, "b": 2}')] and fc[0]["call_id"]


def test_responses_stream_events_as_sampled(world):
    _script(world, " one two three four five six seven eight nine ten")
    body = {"model": "tiny", "input": "Count.", "max_output_tokens": 64}
    whole = httpx.post(f"{world['url']}/v1/responses", json=body, timeout=60).json()
    with httpx.stream("POST", f"{world['url']}/v1/responses", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"], kinds
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) >= 2
    done = events[-1]["response"]
    text = done["output"][0]["content"][0]["text"]
    assert "".join(deltas) == text == whole["output"][0]["content"][0]["text"]
    assert done["id"] == events[0]["response"]["id"] and done["status"] == "completed"
    assert done["output"][0]["id"] == events[2]["item"]["id"] and done["usage"]["output_tokens"] > 0


def test_streams_with_logprobs(world):
    _script(world, " one two three")
    body = _chat(world, stream=True, logprobs=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{world['url']}/v1/chat/completions", json=body, timeout=60) as r:
        chunks = _events(r)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    lps = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["content"]]
    assert text == " one two three" and "".join(x["token"] for x in lps) == text
    assert all(x["logprob"] == -0.25 for x in lps)
    assert chunks[-1]["usage"]["completion_tokens"] == len(world["script"]["now"].tokens)
    comp = {"model": "tiny", "prompt": "Count:", "max_tokens": 64, "stream": True, "logprobs": 0}
    _script(world, " one two three", stop=False)
    with httpx.stream("POST", f"{world['url']}/v1/completions", json=comp, timeout=60) as r:
        chunks = _events(r)
    toks = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert "".join(toks) == "".join(c["choices"][0]["text"] for c in chunks) == " one two three"


@pytest.mark.parametrize("route, body", [
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000, "stream": True}),
    ("responses", {"input": "Hi", "max_output_tokens": 2000, "stream": True}),
])
def test_a_client_gone_mid_stream_stops_its_sampling(world, route, body):
    s = _script(world, " word" * 2000, delay=0.02, stop=False)  # 1,000 tokens take 20 s at least
    svc: Service = world["svc"]
    with httpx.stream("POST", f"{world['url']}/v1/{route}", json={"model": "tiny", **body}, timeout=60) as r:
        next(line for line in r.iter_lines() if '"delta"' in line)
        assert svc.stats()["live_sample_tokens"] > 0
    assert s.stopped.wait(60), "the sampler was never told to stop"
    t = time.monotonic()
    while svc.stats()["live_sample_tokens"] and time.monotonic() - t < 60:
        time.sleep(0.05)
    assert svc.stats()["live_sample_tokens"] == 0 and svc.stats()["sampling_bytes"] == 0
    assert s.emitted < 1000  # it stopped at its next token, far from the 2,000 asked


def test_the_event_loop_answers_while_sampling_and_long_polls_wait(world):
    """Sampling runs on worker threads and a long-polled retrieve_future waits on the loop without one: while a slow
    stream samples and 40 long polls wait on a result that never comes, healthz still answers at once."""
    s = _script(world, " word" * 400, delay=0.01, stop=False)
    svc: Service = world["svc"]
    promise, reply = svc.promises.new("asample")  # a result that stays pending
    rid = json.loads(reply.body)["request_id"]
    url = world["url"]

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            c.post("/api/v1/retrieve_future", json={"request_id": rid})

    polls = [threading.Thread(target=poll, daemon=True) for _ in range(40)]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=_chat(world, stream=True, max_tokens=2000),
                      timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if '"delta"' in line)
        for t in polls:
            t.start()
        time.sleep(0.5)
        took = []
        for _ in range(5):
            t0 = time.monotonic()
            assert httpx.post(f"{url}/api/v1/healthz", json={}, timeout=10).json() == {"status": "ok"}
            took.append(time.monotonic() - t0)
        assert not s.stopped.is_set()  # still sampling meanwhile
    promise.resolve(reply)  # the polls get an answer and end
    for t in polls:
        t.join(60)
    assert not any(t.is_alive() for t in polls)
    assert min(took) < 5, took  # ms when idle; a healthz queued behind the polls would time out (10 s)
