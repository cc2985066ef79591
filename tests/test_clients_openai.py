"""The `openai` Python client as its users call it, against a real `runner serve` on loopback (the tiny model, offline;
issue 40's "tests that run the real clients"): `client.responses.create` (the SDK's first example), streaming that
arrives token by token (chunks counted), n > 1 streams interleaved by index, the usage chunk, the client's exception
classes for the server's errors, `models.retrieve` of a `tinker://` checkpoint, and greedy logprobs that are their own
top_logprobs entry. tests/test_openai_api.py covers the routes' semantics (trained checkpoints, seeds, stop, ...)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pydantic
import pytest

openai = pytest.importorskip("openai")
tinker = pytest.importorskip("tinker")

from tests.test_serve import runner_serve, service_client  # noqa: E402

STORY = [{"role": "user", "content": "Tell me a story about a glimmerhorn."}]


class Answer(pydantic.BaseModel):
    """A structured output (`parse`'s response_format): JSON schemas are not supported, a 400."""

    value: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One server for the module, its model loaded (the first request loads it), and a sampler checkpoint saved
    through the Tinker API (an untrained LoRA: the base model's answers, under a `tinker://` name)."""
    tmp = tmp_path_factory.mktemp("clients-openai")
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_TELEMETRY", "0")
    try:
        with runner_serve(tmp / "storage", "--device", "cpu") as (url, _), service_client(url) as sc:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
            tc = sc.create_lora_training_client("tiny", rank=8, seed=0).result()
            checkpoint = tc.save_weights_for_sampler("untrained").result().path
            yield {"url": url, "client": client, "checkpoint": checkpoint, "log": tmp / "storage.log"}
    finally:
        mp.undo()


def _seed_for(client: Any, chars: int = 4, **ask: Any) -> tuple[int, Any]:
    """The first seed whose (non-streamed) chat reply gives every choice at least `chars` characters, and that reply:
    a reply the stop sequence ended after a token could not show streaming. (The tiny model's replies run 5-8
    tokens, a character each.)"""
    for seed in range(20):
        whole = client.chat.completions.create(**ask, seed=seed)
        if all(len(c.message.content) >= chars for c in whole.choices):
            return seed, whole
    raise AssertionError(f"no seed in 0-19 gave replies of {chars} characters or more to {ask}")


def test_responses_create_answers_as_chat_does(served):
    """`client.responses.create` with text input, with messages and instructions, and with max_output_tokens: the
    greedy `output_text` is what the chat route answers for the same conversation."""
    client = served["client"]

    def chat(messages: list[dict[str, str]]) -> str:
        return client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                              max_tokens=8).choices[0].message.content

    r = client.responses.create(model="tiny", input=STORY[0]["content"], temperature=0, max_output_tokens=8)
    assert r.output_text == chat(STORY) and r.output_text
    assert r.object == "response" and r.model == "tiny" and 0 < r.usage.output_tokens <= 8
    r = client.responses.create(model="tiny", instructions="Answer in one word.", temperature=0, max_output_tokens=8,
                                input=[{"role": "user", "content": "Name a fruit."},
                                       {"role": "assistant", "content": "Plum."},
                                       {"role": "user", "content": [{"type": "input_text", "text": "Another."}]}])
    assert r.output_text == chat([{"role": "system", "content": "Answer in one word."},
                                  {"role": "user", "content": "Name a fruit."},
                                  {"role": "assistant", "content": "Plum."},
                                  {"role": "user", "content": "Another."}])
    seed, whole = _seed_for(client, 3, model="tiny", messages=STORY, temperature=1.0, max_tokens=3)
    cut = client.responses.create(model="tiny", input=STORY, max_output_tokens=3, temperature=1.0,
                                extra_body={"seed": seed})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output_text == whole.choices[0].message.content


def test_responses_include(served):
    """`store: false` and `include` values asking for items this server never makes (reasoning.encrypted_content,
    which inspect's default provider sends) are taken; `include: ["message.output_text.logprobs"]` (with
    top_logprobs) gives the output text's logprobs, the same numbers chat's logprobs.content has, streamed or not;
    a value not in OpenAI's list is a 400 naming `include`."""
    client = served["client"]
    ask: dict[str, Any] = dict(model="tiny", input=STORY, temperature=0, max_output_tokens=6)
    plain = client.responses.create(**ask)
    taken = client.responses.create(**ask, store=False, include=["reasoning.encrypted_content"])
    assert taken.output_text == plain.output_text and taken.output[0].content[0].logprobs == []
    chat = client.chat.completions.create(model="tiny", messages=STORY, temperature=0, max_tokens=6, logprobs=True,
                                          top_logprobs=3).choices[0].logprobs.content
    r = client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3)
    lps = r.output[0].content[0].logprobs
    assert [(x.token, x.logprob) for x in lps] == [(x.token, x.logprob) for x in chat] and len(lps) >= 2
    assert "".join(x.token for x in lps) == r.output_text
    assert [[(t.token, t.logprob) for t in x.top_logprobs] for x in lps] == [
        [(t.token, t.logprob) for t in x.top_logprobs] for x in chat]
    assert all(len(x.top_logprobs) == 3 for x in lps)
    events = list(client.responses.create(**ask, include=["message.output_text.logprobs"], top_logprobs=3,
                                          stream=True))
    streamed = [x for e in events if e.type == "response.output_text.delta" for x in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0].logprobs
    assert [x.logprob for x in streamed] == [x.logprob for x in done.logprobs] == [x.logprob for x in final] == [
        x.logprob for x in lps]
    for bad in (["file_search_call.resultz"], "reasoning.encrypted_content"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**ask, include=bad)  # pyright: ignore[reportArgumentType]
        assert "include" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**ask, top_logprobs=21)


def test_a_cut_response_s_message_is_incomplete(served):
    """A response cut by max_output_tokens marks its message item `incomplete` too (OpenAI's shape), streamed or not;
    one that ends by itself marks both `completed`."""
    client = served["client"]
    cut = client.responses.create(model="tiny", input=STORY, max_output_tokens=1, temperature=1.0)
    assert cut.status == "incomplete" and cut.output[0].status == "incomplete"
    events = list(client.responses.create(model="tiny", input=STORY, max_output_tokens=1, temperature=1.0,
                                          stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete" and [i.status for i in done] == ["incomplete"]
    assert events[-1].response.output[0].status == "incomplete"
    whole = client.responses.create(model="tiny", input=STORY, max_output_tokens=400, temperature=0)
    assert whole.status == "completed" and whole.output[0].status == "completed"


def test_chat_and_completions_stream_token_by_token(served):
    """A 10-token reply arrives in several chunks (one per token that adds text), the chunks add up to the reply the
    same request gets unstreamed, and the last choice chunk says why it ended."""
    client = served["client"]
    ask: dict[str, Any] = dict(model="tiny", messages=STORY, temperature=1.0, max_tokens=10)
    seed, whole = _seed_for(client, **ask)
    chunks = list(client.chat.completions.create(**ask, seed=seed, stream=True))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert 2 <= len(texts) <= whole.usage.completion_tokens and "".join(texts) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)

    # vLLM's ignore_eos: exactly 10 tokens (those after the end-of-text token are special ones, with no text).
    ask = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True})
    seed, plain = next((s, p) for s in range(20)
                       if len((p := client.completions.create(**ask, seed=s)).choices[0].text) >= 4)
    assert plain.usage.completion_tokens == 10 and plain.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(**ask, seed=seed, stream=True))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) >= 2 and "".join(texts) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_streams_interleave_by_index_and_usage_comes_last(served):
    """n = 3 streamed: the choices' chunks interleave (each sample's tokens leave as the batch samples them, not one
    choice after another), each index adds up to its unstreamed reply; with include_usage every chunk but the last
    has `usage: None` and the last has only the usage."""
    client = served["client"]
    ask: dict[str, Any] = dict(model="tiny", messages=STORY, temperature=1.0, n=3, max_tokens=8)
    seed, whole = _seed_for(client, **ask)
    chunks = list(client.chat.completions.create(**ask, seed=seed, stream=True,
                                                 stream_options={"include_usage": True}))
    order = [c.index for chunk in chunks for c in chunk.choices if c.delta.content]
    assert sorted(set(order)) == [0, 1, 2]
    assert order != sorted(order), f"the choices came one after another: {order}"
    parts = {i: "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices if c.index == i)
             for i in range(3)}
    assert parts == {c.index: c.message.content for c in whole.choices}
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_responses_stream_events(served):
    """`responses.create(stream=True)`: the API's events in order, the deltas adding up to the unstreamed output."""
    client = served["client"]
    ask = dict(model="tiny", input=STORY[0]["content"], temperature=0, max_output_tokens=10)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.status == whole.status


def test_responses_stream_token_by_token(served):
    client = served["client"]
    seed, whole = _seed_for(client, model="tiny", messages=STORY, temperature=1.0, max_tokens=10)
    events = list(client.responses.create(model="tiny", input=STORY, temperature=1.0, extra_body={"seed": seed},
                                          max_output_tokens=10, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.choices[0].message.content
    assert len(deltas) >= 2


def test_the_sdk_s_stream_helpers_and_async_client(served):
    """The SDK's higher-level helpers (`responses.stream`, `chat.completions.stream`: they rebuild the final object
    from the events and check them as they come) and `AsyncOpenAI` with 6 streams at once, each adding up to the reply
    the same seeded request gets unstreamed."""
    import asyncio

    client = served["client"]
    ask = dict(model="tiny", messages=STORY, temperature=0, max_tokens=10)
    whole = client.chat.completions.create(**ask).choices[0].message.content
    with client.chat.completions.stream(**ask) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content == whole and len(deltas) >= 2
    with client.responses.stream(model="tiny", input=STORY, temperature=0, max_output_tokens=10) as rstream:
        text = "".join(e.delta for e in rstream if e.type == "response.output_text.delta")
        response = rstream.get_final_response()
    assert text == response.output_text == whole

    async def streams() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{served['url']}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(seed: int) -> str:
            chunks = await aclient.chat.completions.create(**{**ask, "temperature": 1.0}, seed=seed, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

        try:
            return list(await asyncio.gather(*(one(seed) for seed in range(6))))
        finally:
            await aclient.close()

    unstreamed = [client.chat.completions.create(**{**ask, "temperature": 1.0}, seed=seed).choices[0].message.content
                  for seed in range(6)]
    assert asyncio.run(streams()) == unstreamed and len(set(unstreamed)) > 1


@pytest.mark.parametrize(("call", "error", "says"), [
    (lambda c: c.chat.completions.create(model="tiny", messages=STORY, n=129), "BadRequestError", "n must be"),
    (lambda c: c.chat.completions.create(model="tiny", messages=STORY, logprobs=True, top_logprobs=21),
     "BadRequestError", "top_logprobs"),
    (lambda c: c.chat.completions.create(model="tiny", messages=STORY, tool_choice="none"), "BadRequestError",
     "tool_choice"),
    (lambda c: c.completions.create(model="tiny", prompt="x", n=129), "BadRequestError", "n must be"),
    (lambda c: c.completions.create(model="tiny", prompt="x", logprobs=21), "BadRequestError", "logprobs"),
    (lambda c: c.responses.create(model="tiny", input="x", previous_response_id="resp_1"), "BadRequestError",
     "previous_response_id"),
    (lambda c: c.chat.completions.parse(model="tiny", messages=STORY, response_format=Answer), "BadRequestError",
     "response_format"),
    (lambda c: c.responses.parse(model="tiny", input="x", text_format=Answer), "BadRequestError", "text.format"),
    (lambda c: c.chat.completions.create(model="gpt-9", messages=STORY), "NotFoundError", "gpt-9"),
    (lambda c: c.responses.create(model="gpt-9", input="x"), "NotFoundError", "gpt-9"),
    (lambda c: c.models.retrieve("gpt-9"), "NotFoundError", "gpt-9"),
    (lambda c: c.embeddings.create(model="tiny", input="x"), "NotFoundError", "embeddings"),
], ids=["chat-n", "chat-top_logprobs", "chat-tool_choice", "completions-n", "completions-logprobs",
        "responses-previous_response_id", "chat-parse",
        "responses-parse", "chat-model", "responses-model", "models-retrieve", "embeddings"])
def test_errors_raise_the_client_s_exception_classes(served, call, error, says):
    """What a user's `except openai.BadRequestError` / `NotFoundError` catches, with the server's message."""
    with pytest.raises(getattr(openai, error)) as e:
        call(served["client"])
    assert says in e.value.message


def test_an_oversized_body_is_a_413_status_error(served):
    """A body over the server's 64 MiB cap (backends/serve/limits.py `max_body_bytes`) is refused with a 413, which
    the client raises as APIStatusError (OpenAI has no class of its own for 413), and the server samples on."""
    client = served["client"]
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * (64 << 20)}])
    assert e.value.status_code == 413 and type(e.value) is openai.APIStatusError
    assert client.chat.completions.create(model="tiny", messages=STORY, max_tokens=2).choices[0].message.content


def test_an_oversized_body_s_413_is_openai_shaped(served):
    """A body over the cap (64 MiB) is a 413 in OpenAI's shape: the client's exception carries its message."""
    with pytest.raises(openai.APIStatusError) as e:
        served["client"].chat.completions.create(model="tiny",
                                                 messages=[{"role": "user", "content": "x" * (64 << 20)}])
    assert isinstance(e.value.body, dict) and "bytes" in e.value.body.get("message", "")


def test_models_retrieve_a_tinker_checkpoint(served):
    """`models.retrieve("tinker://...")`: the client percent-encodes the id into the path, the server decodes it;
    the checkpoint is listed, and answers (an untrained LoRA: as the base model does)."""
    client, ckpt = served["client"], served["checkpoint"]
    assert ckpt.startswith("tinker://")
    assert client.models.retrieve(ckpt).id == ckpt
    encoded = httpx.get(f"{served['url']}/v1/models/{quote(ckpt, safe='')}")
    assert encoded.status_code == 200 and encoded.json()["id"] == ckpt
    assert ckpt in [m.id for m in client.models.list().data]
    ask = dict(messages=STORY, temperature=0, max_tokens=6)
    r = client.chat.completions.create(model=ckpt, **ask)
    assert r.model == ckpt
    assert r.choices[0].message.content == client.chat.completions.create(model="tiny", **ask).choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(ckpt + "-gone")


def test_greedy_logprobs_are_their_own_top_entry(served):
    """Greedy, each sampled token is its position's top alternative and its logprob is that entry's, to the bit (one
    pass): the check lm-eval's is_greedy makes. Sampled at temperature 1, a token found among its alternatives has
    that entry's logprob too."""
    client = served["client"]
    r = client.chat.completions.create(model="tiny", messages=STORY, temperature=0, max_tokens=8, logprobs=True,
                                       top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) >= 2
    for t in content:
        assert t.top_logprobs[0].bytes == t.bytes and t.top_logprobs[0].logprob == t.logprob
        assert t.logprob == max(x.logprob for x in t.top_logprobs)
    c = client.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=8,
                                  logprobs=5).choices[0]
    lp = c.logprobs
    assert len(lp.token_logprobs) >= 2
    for own, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert own == max(top.values())
    r = client.chat.completions.create(model="tiny", messages=STORY, temperature=1.0, seed=4, max_tokens=12,
                                       logprobs=True, top_logprobs=20)
    found = 0
    for t in r.choices[0].logprobs.content:
        same = [x.logprob for x in t.top_logprobs if x.bytes == t.bytes]
        if same:
            found += 1
            assert same == [t.logprob]
    assert found >= 1
