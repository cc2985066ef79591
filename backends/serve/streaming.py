"""Real streaming for `/v1/chat/completions` and `/v1/completions` with `stream = true` (docs/openai.md): each
sampled token reaches the client as the sampler makes it (the local sampler calls each row's `watch` hook,
backends/local/decoding.py Row.add), n > 1 choices interleaved by index, as OpenAI streams them.

What a chunk carries is text that can no longer change: the reply so far (chat: as the renderer reads it, so a
stop sequence or special token never shows; completions: decoded without special tokens), less its last
`holdback` characters (the longest stop string, which may still be completing) and a trailing partial UTF-8
character. When a choice ends, its last chunk holds the rest of the reply exactly as the non-streamed response has
it (chat_response / completion_response) and its finish_reason, so the chunks add up to that response.

A client that hangs up mid-stream (a write fails, or the connection reads as closed while waiting for a token)
ends its rows at their next token; the request's memory comes back when the sampler lets go of it.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from backends.serve.chat_api import ChatFormat, Plan
from backends.serve.replies import json_bytes
from backends.tokenizer import Tokenizer, decode_text
from backends.types import Json, SampleOutput

if TYPE_CHECKING:
    from backends.base import Future

POLL_S = 0.1
DONE = -1  # the sample index of a prompt's "its future is done" event


class ChoiceText:
    """One streamed choice: its tokens so far and the text sent."""

    def __init__(self, text_of: Callable[[list[int]], str], holdback: int, stops: list[str]):
        self.text_of = text_of
        self.holdback = holdback
        self.stops = stops
        self.tokens: list[int] = []
        self.sent = ""
        self.stalled = False  # the text stopped extending what was sent: the rest comes at the end

    def push(self, tok: int) -> str:
        self.tokens.append(tok)
        if self.stalled:
            return ""
        text = self.text_of(self.tokens)
        hits = [i for i in (text.find(x) for x in self.stops) if i >= 0]
        if hits:  # a stop string: the reply ends before it
            text, self.stalled = text[: min(hits)], True
            safe = text.rstrip("\ufffd")
            delta = safe[len(self.sent):] if safe.startswith(self.sent) else ""
            self.sent += delta
            return delta
        safe = text[: max(0, len(text) - self.holdback)].rstrip("\ufffd")
        if not safe.startswith(self.sent):
            self.stalled = True
            return ""
        delta = safe[len(self.sent):]
        self.sent = safe
        return delta

    def rest(self, final: str) -> str:
        return final[len(self.sent):] if final.startswith(self.sent) else ""


def chunks(first: tuple[int, int, int | None], events: queue.SimpleQueue[tuple[int, int, int | None]],
           futs: list[Future[SampleOutput]], plan: Plan, head: Json, chat: bool, text_of: Callable[[list[int]], str],
           holdback: int, finish: Callable[[int, SampleOutput], list[Json]],
           result: Callable[[Future[SampleOutput]], SampleOutput],
           gone: Callable[[], bool], cancelled: threading.Event, release: Callable[[], None]) -> Iterator[Json]:
    """The chunk objects of a streamed request (chat.completion.chunk or text_completion), then, with
    include_usage, the usage chunk; an {"error": ...} object ends it early. `first` is its first event (prompt,
    sample, token), read before the reply's headers were sent; `finish(p, output)` gives prompt p's finished choices
    as the non-streamed response has them (with their logprobs: a choice's come in its last chunk with text, the
    tokens' texts having left as they were sampled); `result(fut)` a prompt's output (ApiError for the request's own
    fault)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage = plan.include_usage
    texts: dict[tuple[int, int], ChoiceText] = {}
    started: set[int] = set()
    completion_tokens = 0

    def chunk(choice: Json) -> Json:
        body = {**head, "object": obj, "choices": [choice]}
        if usage:
            body["usage"] = None
        return body

    def piece(index: int, text: str, finish_reason: str | None = None, extra: Json | None = None,
              logprobs: Json | None = None) -> Json:
        if chat:
            delta: Json = {"content": text} if text or index not in started else {}
            if index not in started:
                delta = {"role": "assistant", **delta}
                started.add(index)
            return chunk({"index": index, "delta": {**delta, **(extra or {})}, "logprobs": logprobs,
                          "finish_reason": finish_reason})
        return chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

    try:
        left = len(futs)
        event: tuple[int, int, int | None] | None = first
        while left:
            if event is None:
                try:
                    event = events.get(timeout=POLL_S)
                except queue.Empty:
                    if gone():
                        return
                    continue
            assert event is not None
            p, k, tok = event
            event = None
            if k == DONE:
                left -= 1
                try:
                    out = result(futs[p])
                    finished = finish(p, out)
                except Exception as exc:  # noqa: BLE001 - the request's own fault, after the headers: an error event
                    yield {"error": {"message": str(getattr(exc, "detail", exc))[:300], "type": "invalid_request_error"}}
                    return
                for c in finished:
                    index = c["index"]
                    completion_tokens += c.pop("_tokens")
                    st = texts.get((p, index % plan.n)) or ChoiceText(text_of, holdback, plan.user_stop)
                    if chat:
                        msg = c["message"]
                        extra = {}
                        if msg.get("tool_calls"):
                            extra["tool_calls"] = [{"index": j, **call} for j, call in enumerate(msg["tool_calls"])]
                        if msg.get("reasoning_content"):
                            extra["reasoning_content"] = msg["reasoning_content"]
                        rest = st.rest(msg.get("content") or "")
                        if rest or extra or index not in started or c["logprobs"] is not None:
                            yield piece(index, rest, None, extra, c["logprobs"])
                        yield piece(index, "", c["finish_reason"])
                    else:
                        yield piece(index, st.rest(c["text"]), c["finish_reason"], logprobs=c["logprobs"])
                continue
            assert tok is not None
            st = texts.setdefault((p, k), ChoiceText(text_of, holdback, plan.user_stop))
            delta = st.push(tok)
            if delta:
                yield piece(p * plan.n + k, delta)
        if usage:
            prompt_tokens = sum(len(x) for x in plan.prompts) * plan.n
            yield {**head, "object": obj, "choices": [], "usage": {
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}}
    finally:
        cancelled.set()  # a client gone mid-stream: its rows end at their next token (done ones: no effect)
        release()


def sse(objects: Iterator[Json]) -> Iterator[bytes]:
    """Chunk objects as OpenAI's server-sent events: `data: {...}` each, then `data: [DONE]` (none after an error)."""
    try:
        for obj in objects:
            yield b"data: " + json_bytes(obj) + b"\n\n"
            if "error" in obj:
                return
        yield b"data: [DONE]\n\n"
    finally:
        close = getattr(objects, "close", None)
        if close is not None:
            close()  # its sampling stops and its memory comes back (chunks' finally)


def one_prompt(plan: Plan, p: int) -> Plan:
    return dataclasses.replace(plan, prompts=[plan.prompts[p]])


def chat_text(fmt: ChatFormat) -> Callable[[list[int]], str]:
    def text_of(tokens: list[int]) -> str:
        message, _ = fmt.reply(list(tokens))
        return message.get("content") or ""
    return text_of


def completion_text(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    def text_of(tokens: list[int]) -> str:
        return decode_text(tokenizer, tokens, skip_special_tokens=True)
    return text_of
