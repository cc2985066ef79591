"""`runner serve`'s OpenAI-compatible endpoints (backends/serve/openai_api.py, docs/openai.md), driven by the `openai`
client over loopback HTTP against a real `runner serve` process: the base model, a sampler checkpoint trained
through the server (tinker://) and a local run dir's checkpoint each answer as their weights do; n, stop,
max_tokens, seed, temperature, logprobs / top_logprobs, echo and streaming are honoured; bad requests get
OpenAI-shaped 4xx errors."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from runner.cli import main  # noqa: E402
from tests.test_serve import runner_serve, service_client  # noqa: E402

QUESTION = [{"role": "user", "content": "Name a fruit."}]


def _train_run_dir(tmp: Path) -> Path:
    """A local `runner run` SFT that teaches the tiny model to answer QUESTION with "lime" (in this process: the run
    dir is what is tested, not the command's process)."""
    data = tmp / "lime.jsonl"
    row = {"messages": [*QUESTION, {"role": "assistant", "content": "lime"}]}
    data.write_text("".join(json.dumps(row) + "\n" for _ in range(16)))
    recipe = tmp / "lime.toml"
    run = tmp / "lime-run"
    recipe.write_text(f"""
[recipes.lime]
lr = 1e-2
max_steps = 24
log_dir = "{run}"
save_every = 12
schedule = {{ kind = "constant" }}
[recipes.lime.algo]
kind = "sft"
data = {{ kind = "jsonl", path = "{data}" }}
batch_size = 4
epochs = 6
[recipes.lime.lora]
rank = 8
""")
    assert main(["run", f"{recipe}#lime"]) == 0
    return run


def _train_plum(url: str) -> str:
    """A sampler checkpoint trained through the server (the tinker SDK) to answer QUESTION with "plum"."""
    from runner.renderers import get_renderer
    from runner.renderers.chat import ChatRenderer

    with service_client(url) as sc:
        tc = sc.create_lora_training_client("tiny", rank=8, seed=0).result()
        chat = ChatRenderer(get_renderer("auto", tc.get_tokenizer(), model_name="tiny"))
        prompt = chat.build_prompt(QUESTION)
        answer = [*chat.tokenizer.encode("plum", add_special_tokens=False), *chat.stop_tokens]
        seq = [*prompt, *answer]
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
        datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                            loss_fn_inputs={"target_tokens": seq[1:], "weights": weights})
        for _ in range(20):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return tc.save_weights_for_sampler("plum").result().path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("openai")
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    try:
        # The server starts (a process importing torch, ~10 s) while this process trains the run dir: --runs is a
        # folder the server resolves run dirs under per request, so the run need not exist before it starts. On
        # leaving, the pool waits for the start and the stack stops a server that started.
        with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(1) as pool:
            starting = pool.submit(stack.enter_context, runner_serve(tmp / "storage", "--device", "cpu", "--runs", str(tmp)))
            run = _train_run_dir(tmp)
            url, _ = starting.result()
            plum = _train_plum(url)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            yield {"url": url, "client": client, "plum": plum, "run": run, "log": tmp / "storage.log"}
    finally:
        mp.undo()


def _greedy(client: Any, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8)
    return r.choices[0].message.content


def test_base_and_checkpoints_answer_as_their_weights(served):
    client, run = served["client"], served["run"]
    base = _greedy(client, "tiny")
    assert _greedy(client, served["plum"]) == "plum"
    assert _greedy(client, str(run)) == "lime"  # a run dir: its last checkpoint
    assert base not in ("plum", "lime")
    # A run dir's checkpoint by name (save_every = 12: one half-way through the training).
    names = [json.loads(line)["name"] for line in (run / "checkpoints.jsonl").read_text().splitlines()]
    assert names[-1] == "final" and len(names) >= 2
    assert _greedy(client, f"{run}:final") == "lime"
    with pytest.raises(openai.BadRequestError, match="no checkpoint 'nope'"):
        _greedy(client, f"{run}:nope")
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == "tiny" and served["plum"] in ids
    assert client.models.retrieve("tiny").id == "tiny"


def test_sampling_parameters_are_honoured(served):
    client, model = served["client"], "tiny"
    ask = dict(model=model, messages=[{"role": "user", "content": "Tell me about glimmerhorns."}])
    r = client.chat.completions.create(**ask, n=3, max_tokens=12, seed=7, temperature=1.5)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert r.usage.completion_tokens <= 36 and r.usage.prompt_tokens > 0
    again = client.chat.completions.create(**ask, n=3, max_tokens=12, seed=7, temperature=1.5)
    assert [c.message.content for c in again.choices] == texts  # seeded: repeatable
    other = client.chat.completions.create(**ask, n=3, max_tokens=12, seed=8, temperature=1.5)
    assert [c.message.content for c in other.choices] != texts
    # max_tokens: cut replies say "length" and hold at most that many tokens.
    short = client.chat.completions.create(**ask, max_tokens=2, seed=0, temperature=1.5, logprobs=True)
    assert short.choices[0].finish_reason == "length" and len(short.choices[0].logprobs.content) == 2
    # stop: a string the unstopped sample holds ends it there, and is not returned.
    long = client.chat.completions.create(**ask, max_tokens=12, seed=7, temperature=1.5).choices[0].message.content
    cut = next(i for i in range(2, len(long)) if long[i] != " ")
    stop = long[cut:cut + 1]
    stopped = client.chat.completions.create(**ask, max_tokens=12, seed=7, temperature=1.5, stop=[stop]).choices[0]
    assert stopped.message.content == long[: long.index(stop)] and stopped.finish_reason == "stop"
    # temperature 0: greedy, every sample the same.
    greedy = client.chat.completions.create(**ask, n=2, max_tokens=6, temperature=0)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_logprobs(served):
    client, model = served["client"], "tiny"
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6, seed=3, temperature=1.0,
                                       logprobs=True, top_logprobs=3)
    c = r.choices[0]
    content = c.logprobs.content
    assert "".join(t.token for t in content) == c.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and tops[0] >= t.logprob - 1e-4
        if t.token in [x.token for x in t.top_logprobs]:  # the same distribution (temperature 1)
            assert dict((x.token, x.logprob) for x in t.top_logprobs)[t.token] == pytest.approx(t.logprob, abs=1e-4)
    # /v1/completions with echo and max_tokens = 0 scores a text (lm-eval's loglikelihood requests): the scores of a
    # sampled continuation are the sampler's own logprobs of it.
    prompt = "The capital of France is"
    gen = client.completions.create(model=model, prompt=prompt, max_tokens=5, seed=2, temperature=1.0, logprobs=0)
    assert gen.choices[0].logprobs.top_logprobs == [None] * len(gen.choices[0].logprobs.tokens)
    toks = httpx.post(f"{served['url']}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": 5, "seed": 2, "temperature": 1.0, "return_token_ids": True}).json()
    assert toks["choices"][0]["text"] == gen.choices[0].text
    # vLLM's return_token_ids: the prompt's and the sample's token ids (what verifiers records)
    choice = toks["choices"][0]
    assert len(choice["prompt_token_ids"]) == toks["usage"]["prompt_tokens"] > 0
    assert len(choice["token_ids"]) == toks["usage"]["completion_tokens"] >= len(gen.choices[0].logprobs.tokens)
    scored = client.completions.create(model=model, prompt=prompt + gen.choices[0].text, max_tokens=0, echo=True,
                                       logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt + gen.choices[0].text and lp.token_logprobs[0] is None
    n = len(gen.choices[0].logprobs.tokens)
    if "".join(lp.tokens[-n:]) == gen.choices[0].text:  # the text re-encodes to the sampled tokens
        assert lp.token_logprobs[-n:] == pytest.approx(gen.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    # lm-eval's local-completions loglikelihood request, verbatim (token ids, max_tokens 1, echo): it reads the
    # continuation's scores as token_logprobs[ctxlen:-1] (the last one is the sampled token's).
    tokens = [*range(60, 70), *range(70, 75)]
    lm_eval = httpx.post(f"{served['url']}/v1/completions", json={
        "model": model, "prompt": tokens, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
        "echo": True}).json()["choices"][0]["logprobs"]
    alone = client.completions.create(model=model, prompt=tokens, max_tokens=0, echo=True, logprobs=1).choices[0]
    assert len(lm_eval["token_logprobs"]) == len(tokens) + 1
    assert lm_eval["token_logprobs"][10:-1] == pytest.approx(alone.logprobs.token_logprobs[10:], abs=1e-5)


def test_stream_matches_the_whole_reply(served):
    client = served["client"]
    ask = dict(model="tiny", messages=QUESTION, max_tokens=10, seed=5, temperature=1.2, n=2)
    whole = client.chat.completions.create(**ask)
    parts: dict[int, str] = {0: "", 1: ""}
    finish, usage = {}, None
    for chunk in client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert [parts[0], parts[1]] == [c.message.content for c in whole.choices]
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    text = "".join(c.choices[0].text for c in client.completions.create(model="tiny", prompt="Hello", max_tokens=4,
                                                                          seed=1, stream=True))
    assert text == client.completions.create(model="tiny", prompt="Hello", max_tokens=4, seed=1).choices[0].text


@pytest.mark.parametrize(("body", "status", "says"), [
    ({"model": "tiny", "messages": QUESTION, "temperature": 3}, 400, "temperature"),
    ({"model": "tiny", "messages": QUESTION, "n": 0}, 400, "n must be"),
    ({"model": "tiny", "messages": QUESTION, "n": "2"}, 400, "n must be an integer"),
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role 'wizard': expected one of"),
    ({"model": "tiny"}, 400, "messages"),
    ({"messages": QUESTION}, 400, "model is required"),
    ({"model": "gpt-9", "messages": QUESTION}, 404, "neither a served model"),
    ({"model": "tinker://nope/sampler_weights/x", "messages": QUESTION}, 404, "no checkpoint"),
    ({"model": "tiny", "messages": QUESTION, "top_logprobs": 2}, 400, "needs logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "only text"),
    ({"model": "tiny", "messages": QUESTION, "stop": [""]}, 400, "stop"),
    ({"model": "tiny", "messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "messages": QUESTION, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": "tiny", "messages": QUESTION, "n": 128, "max_tokens": 10**5}, 413, "tokens"),
])
def test_bad_requests_get_openai_errors(served, body, status, says):
    r = httpx.post(f"{served['url']}/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["type"].endswith("_error")


def test_bad_bodies_and_routes(served):
    url = served["url"]
    assert httpx.post(f"{url}/v1/completions", content=b"{not json").status_code == 400
    assert httpx.post(f"{url}/v1/completions", json=[1]).status_code == 400
    assert httpx.get(f"{url}/v1/chat/completions").status_code == 405
    assert httpx.post(f"{url}/v1/embeddings", json={}).json()["error"]["type"] == "not_found_error"
    bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [10**9]})
    assert bad.status_code == 400 and "outside the model's vocabulary" in bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        served["client"].completions.create(model="tiny", prompt="x", max_tokens=0)  # 0 only with echo
    # The server still samples after all that, and logged no traceback.
    assert _greedy(served["client"], "tiny")
    assert "Traceback" not in served["log"].read_text()


def test_a_prompt_over_the_context_fails_alone(served):
    """A prompt that fills the model's context is the request's own fault: a 400 (was a 500 and a logged traceback),
    and the requests sent beside it get their own answers."""
    from concurrent.futures import ThreadPoolExecutor

    url = served["url"]
    good = [{"model": "tiny", "prompt": p, "max_tokens": 6, "temperature": 0} for p in ("Hello", "2+3=", "Name a")]
    long = {"model": "tiny", "prompt": [65] * 3000, "max_tokens": 4}
    alone = [httpx.post(f"{url}/v1/completions", json=b, timeout=60).json()["choices"][0]["text"] for b in good]
    with ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(httpx.post, f"{url}/v1/completions", json=b, timeout=60) for b in [*good[:2], long, good[2]]]
        replies = [f.result() for f in futs]
    bad = replies.pop(2)
    assert bad.status_code == 400 and "fills the model's context of 2048" in bad.json()["error"]["message"]
    assert [r.json()["choices"][0]["text"] for r in replies] == alone
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "word " * 3000}]}, timeout=60)
    assert chat.status_code == 400 and "context" in chat.json()["error"]["message"]
    assert "Traceback" not in served["log"].read_text()


def test_api_key_is_a_bearer_token(monkeypatch, tmp_path):
    from backends.serve.http import ServeConfig, build_service

    monkeypatch.setenv("OA_KEY", "sk-local-123")
    svc = build_service(ServeConfig(storage=tmp_path / "s", device="cpu", api_key_env="OA_KEY"))
    try:
        body = json.dumps({"model": "tiny", "messages": QUESTION}).encode()
        for headers in ({}, {"authorization": "Bearer sk-wrong"}):
            r = svc.handle("POST", "/v1/chat/completions", headers, body)
            assert r.status == 401 and json.loads(r.body)["error"]["code"] == "invalid_api_key"
        ok = svc.handle("GET", "/v1/models", {"authorization": "Bearer sk-local-123"}, b"")
        assert ok.status == 200 and json.loads(ok.body)["data"][0]["id"] == "tiny"
    finally:
        svc.close()


@pytest.mark.extras("inspect")
def test_inspect_openai_provider_scores_the_checkpoint(served, tmp_path, monkeypatch):
    """inspect's OpenAI-compatible provider (`openai-api/<service>/<model>`, as docs/openai.md shows) against the
    server: the plum checkpoint answers the task right, the base model does not."""
    inspect_ai = pytest.importorskip("inspect_ai")
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import exact

    monkeypatch.setenv("RUNNER_API_KEY", "unused")
    task = inspect_ai.Task(dataset=[Sample(input="Name a fruit.", target="plum", id=i) for i in (1, 2)], scorer=exact())
    scores = {}
    for model in (served["plum"], "tiny"):
        log = inspect_ai.eval(task, model=f"openai-api/runner/{model}", model_base_url=f"{served['url']}/v1",
                              temperature=0, max_tokens=8, log_dir=str(tmp_path), display="none")[0]
        assert log.status == "success", log.error
        scores[model] = log.results.scores[0].metrics["mean"].value
    assert scores == {served["plum"]: 1.0, "tiny": 0.0}


def test_tool_calls_round_trip_through_the_plain_call_convention():
    """The tiny model's renderer (its chat template) has no tool format: tools are declared as JSON schemas, an
    assistant's tool_calls go in as `CALL` lines and tool results as `RESULT` lines, and a reply's `CALL` line comes
    back as an OpenAI tool call with finish_reason "tool_calls"."""
    import transformers

    from backends.local.model import resolve_model_dir
    from backends.serve.chat_api import chat_plan, chat_response
    from backends.types import SampledSequence, SampleOutput
    from runner.renderers.base import make_tool_call
    from runner.rl.openai_chat import chat_format

    tok = transformers.AutoTokenizer.from_pretrained(resolve_model_dir("tiny"))
    fmt = chat_format("tiny", tok)
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": None, "tool_calls": [make_tool_call("add", '{"a": 2, "b": 3}', "c1")]},
                {"role": "tool", "tool_call_id": "c1", "name": "add", "content": "5"}]
    plan = chat_plan({"model": "tiny", "messages": messages, "tools": tools}, fmt)
    text = tok.decode(plan.prompts[0])
    assert '"name": "add"' in text and 'CALL add {"a": 2, "b": 3}' in text and "RESULT add: 5" in text
    reply = [*tok.encode('Adding.\nCALL add {"a": 1, "b": 2}', add_special_tokens=False), *fmt.chat.stop_tokens]
    out = SampleOutput([SampledSequence(reply, [-0.5] * len(reply), "stop")])
    choice = chat_response(plan, out, fmt)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert choice["message"]["content"] == 'Adding.\nCALL add {"a": 1, "b": 2}'


def test_sampling_memory_over_max_bytes_is_an_openai_413(tmp_path):
    """The /v1 routes reserve their sampling memory as the Tinker API's sample requests do (backends/serve/memory.py):
    a request that could never fit under --max-bytes is refused at once, in OpenAI's error shape."""
    from backends.serve.http import ServeConfig, build_service
    from backends.serve.limits import Limits
    from runner.tools.openai_serve import serve_hooks

    svc = build_service(ServeConfig(storage=tmp_path / "s", device="cpu", openai=serve_hooks(),
                                    limits=Limits(max_bytes=64 << 20)))
    try:
        body = {"model": "tiny", "messages": QUESTION, "n": 128, "max_tokens": 2000}
        r = svc.handle("POST", "/v1/chat/completions", {}, json.dumps(body).encode())
        err = json.loads(r.body)["error"]
        assert r.status == 413 and "--max-bytes" in err["message"] and err["type"] == "invalid_request_error"
        ok = svc.handle("POST", "/v1/chat/completions", {}, json.dumps({**body, "n": 1, "max_tokens": 2}).encode())
        assert ok.status == 200 and svc.stats()["live_sample_tokens"] == 0  # returned when done
    finally:
        svc.close()


def test_openai_spec_details(served):
    """The deviations a pass with real clients found (issue 40), each fixed or refused with a 400 naming the field."""
    client, url = served["client"], served["url"]
    ask = dict(model="tiny", messages=QUESTION, max_tokens=4)
    for extra, field in [({"n": 129}, "n"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                         ({"tool_choice": "required"}, "tool_choice"),
                         ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
                         ({"parallel_tool_calls": False}, "parallel_tool_calls"),
                         ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
                         ({"stream_options": {"include_usage": True}}, "stream_options"),
                         ({"stop": ["a", "b", "c", "d", "e"]}, "stop")]:
        with pytest.raises(openai.BadRequestError, match=field):
            client.chat.completions.create(**ask, **extra)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="x", logprobs=21)
    # refusal: present and null (required by the spec), on the message and on logprobs.
    raw = httpx.post(f"{url}/v1/chat/completions", json={**ask, "logprobs": True}).json()["choices"][0]
    assert raw["message"]["refusal"] is None and "refusal" in raw["message"]
    assert raw["logprobs"]["refusal"] is None and "refusal" in raw["logprobs"]
    # With include_usage every chunk but the last has usage: null; the last has only usage.
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**ask, "stream": True, "n": 2,
                                                                   "stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["total_tokens"] > 0
    assert chunks[-1]["choices"] == []
    # /v1/models/{id} percent-decoded (the client quotes tinker://...); `created` stable across calls.
    assert client.models.retrieve(served["plum"]).id == served["plum"]
    first = {m.id: m.created for m in client.models.list().data}
    assert {m.id: m.created for m in client.models.list().data} == first
    # Only an unknown model is model_not_found; an unknown route is a plain 404.
    assert httpx.post(f"{url}/v1/embeddings", json={}).json()["error"]["code"] is None
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(**{**ask, "model": "gpt-9"})
    assert e.value.code == "model_not_found"


def test_usage_counts_the_stop_token_logprobs_list_the_content(served):
    """usage.completion_tokens counts each sampled token, the stop token included; logprobs.content lists the tokens
    of `content` (OpenAI's definition): one fewer for a reply the model ended, as many for one max_tokens cut. The
    stream, and the Responses API, say the same."""
    client, plum = served["client"], served["plum"]
    ask: dict[str, Any] = dict(model=plum, messages=QUESTION, temperature=0, max_tokens=8, logprobs=True)
    r = client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    content = choice.logprobs.content
    ids = (choice.model_extra or {})["token_ids"]
    assert choice.message.content == "plum" and choice.finish_reason == "stop"
    assert "".join(t.token for t in content) == "plum"
    assert r.usage.completion_tokens == len(ids) == len(content) + 1
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.content or []] == [t.logprob for t in content]
    resp = client.responses.create(model=plum, input=QUESTION, temperature=0, max_output_tokens=8,
                                   include=["message.output_text.logprobs"])
    assert resp.usage.output_tokens == r.usage.completion_tokens
    assert [t.logprob for t in resp.output[0].content[0].logprobs] == [t.logprob for t in content]
    cut = client.chat.completions.create(model="tiny", messages=QUESTION, temperature=0, max_tokens=4, logprobs=True)
    assert cut.choices[0].finish_reason == "length"
    assert cut.usage.completion_tokens == len(cut.choices[0].logprobs.content) == 4


def test_logprobs_are_one_number(served):
    """A token's logprob and its own top_logprobs entry come from one pass: equal bit for bit, so lm-eval's is_greedy
    (the continuation token is the top-1 alternative, with its logprob) reads true on a greedy continuation."""
    client, url = served["client"], served["url"]
    r = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    for t in r.choices[0].logprobs.content:
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
    # lm-eval local-completions: a greedy continuation, then its loglikelihood request (echo, logprobs 1, max_tokens 1).
    context = [*range(60, 70)]
    greedy = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": context, "max_tokens": 5,
                                                        "temperature": 0, "return_token_ids": True}).json()
    cont = greedy["choices"][0]["token_ids"][:4]
    lp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [*context, *cont], "temperature": 0,
                                                    "max_tokens": 1, "logprobs": 1, "echo": True}).json()
    lp = lp["choices"][0]["logprobs"]
    ctxlen = len(context)
    for tok, own, top in zip(lp["tokens"][ctxlen:-1], lp["token_logprobs"][ctxlen:-1], lp["top_logprobs"][ctxlen:-1],
                             strict=True):
        assert max(top, key=top.get) == tok and top[tok] == own  # is_greedy, and one number


def test_responses_api(served):
    """`client.responses.create`, the openai SDK's first example (and inspect's default `openai/` provider's API):
    text or message input, instructions, max_output_tokens, streaming events; what it cannot honour is a 400."""
    client, plum = served["client"], served["plum"]
    r = client.responses.create(model=plum, input="Name a fruit.", temperature=0, max_output_tokens=8)
    assert r.output_text == "plum" and r.status == "completed" and r.usage.output_tokens > 0
    chat = client.chat.completions.create(model=plum, messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
                                          temperature=0, max_tokens=8).choices[0].message.content
    r = client.responses.create(model=plum, instructions="Be brief.", temperature=0, max_output_tokens=8,
                                input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}])
    assert r.output_text == chat
    cut = client.responses.create(model="tiny", input="Tell me about glimmerhorns.", max_output_tokens=1,
                                  temperature=1.0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    kinds, text, done = [], "", None
    for event in client.responses.create(model=plum, input="Name a fruit.", temperature=0, max_output_tokens=8,
                                         stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            done = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert text == "plum" and done is not None and done.output_text == "plum"
    for bad in ({"previous_response_id": "resp_1"}, {"tools": [{"type": "web_search"}]}, {"input": []}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(**{"model": "tiny", "input": "hi", **bad})


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"model": "tiny", "messages": [], "n": "2"}, "n", "n must be an integer, not str"),
    ({"messages": []}, "model", "model is required"),
    ({"model": "tiny", "messages": [{"content": "x"}]}, "messages[0].role", "messages[0].role is required"),
    ({"model": "tiny", "messages": [], "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "must be true or false, not int"),
    ({"model": "tiny", "messages": [], "stop": 5}, "stop", "stop must be a string or a list or null, not int"),
    ({"model": "tiny", "messages": [{"role": "user", "content": 7}]}, "messages[0].content", "not int"),
])
def test_request_bodies_are_typed_and_errors_name_the_field(body, param, says):
    """/v1 bodies are decoded into msgspec structs (backends/serve/chat_api.py `read`): a wrong type or a missing field
    is a 400 whose message names the field and whose `param` (OpenAI's error field) is its path."""
    from backends.serve.chat_api import ChatRequest, error_body, read
    from backends.serve.replies import ApiError

    with pytest.raises(ApiError) as err:
        read(body, ChatRequest)
    assert err.value.status == 400 and err.value.param == param and says in err.value.detail, err.value.detail
    assert error_body(400, err.value.detail, err.value.param)["error"]["param"] == param
