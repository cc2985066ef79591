"""OpenAI's Responses API (`POST /v1/responses`, docs/openai.md) over the chat path: a request is read into a chat
completion request (`to_chat`), sampled as one, and its chat.completion written back as a `response` object
(`from_chat`), or streamed as the Responses API's events (`stream`), token by token.

Taken: `input` (a string, or a list of messages {role, content: a string or input_text parts} and of function_call /
function_call_output items), `instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`,
`tools` (function tools), `tool_choice` "auto", `stream`, `include` ["message.output_text.logprobs"] with
`top_logprobs` (the output text's logprobs, chat's logprobs.content), and fields that change nothing here (`store`,
`metadata`, `user`, `truncation` "disabled", `parallel_tool_calls` true, `text.format` text, `include` values for
items this server never makes, such as "reasoning.encrypted_content"). Anything else (built-in tools,
`previous_response_id`: this server keeps no responses, reasoning settings, images, an `include` value not in
OpenAI's list) is a 400 naming the field.
"""

from __future__ import annotations

import itertools
import json
import secrets
import time
from collections.abc import Iterator

from backends.serve.replies import ApiError, json_bytes
from backends.types import Json

RESPONSES_MAX_TOKENS = 512  # when max_output_tokens is not given (as chat's default)
IGNORED = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
                     "tool_choice", "stream", "store", "metadata", "user", "truncation", "parallel_tool_calls",
                     "text", "include", "seed", "service_tier", "stream_options", "safety_identifier",
                     "prompt_cache_key", "top_logprobs"})
# `include` values (OpenAI's list) asking for items this server never makes (no reasoning items, no built-in tool
# calls, no image inputs: each refused where it would come in): there is nothing of theirs to include.
INCLUDE_NOTHING = frozenset({"reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
                             "web_search_call.action.sources", "code_interpreter_call.outputs",
                             "computer_call_output.output.image_url", "message.input_image.image_url"})
LOGPROBS = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text_of(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not (isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                    and isinstance(p.get("text"), str)):
                raise ApiError(400, f"{where}[{j}]: only input_text / output_text parts are supported")
            parts.append(p["text"])
        return "".join(parts)
    raise ApiError(400, f"{where} must be a string or a list of input_text parts")


def _logprobs_asked(req: Json) -> bool:
    """Whether `req` asks for its output text's logprobs (`include` message.output_text.logprobs, or top_logprobs
    > 0); ApiError for an `include` value that is not OpenAI's or a top_logprobs out of 0-20."""
    include = req.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise ApiError(400, "include must be a list of strings", param="include")
    for x in include:
        if x != LOGPROBS and x not in INCLUDE_NOTHING:
            raise ApiError(400, f"include value {x[:60]!r} is not supported (OpenAI's values: "
                                f"{', '.join(sorted([LOGPROBS, *INCLUDE_NOTHING]))})", param="include")
    top = req.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise ApiError(400, f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
    return LOGPROBS in include or bool(top)


def to_chat(req: Json) -> Json:
    """The chat completion request that samples what `req` asks (ApiError for what is not supported)."""
    for key, value in req.items():
        if key not in IGNORED and value is not None:
            raise ApiError(400, f"{key} is not supported by runner serve's /v1/responses")
    if req.get("truncation") not in (None, "disabled"):
        raise ApiError(400, "truncation: only 'disabled' is supported")
    if req.get("parallel_tool_calls") is False:
        raise ApiError(400, "parallel_tool_calls = false is not supported (the model may call several tools)")
    fmt = (req.get("text") or {}).get("format") if isinstance(req.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise ApiError(400, f"text.format {str(fmt.get('type'))[:40]!r} is not supported (only text)")
    logprobs = _logprobs_asked(req)
    messages: list[Json] = []
    instructions = req.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": _text_of(instructions, "instructions")})
    inp = req.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise ApiError(400, f"{where} must be an object")
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise ApiError(400, f"{where}.role must be user, assistant, system or developer")
                messages.append({"role": role, "content": _text_of(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                    raise ApiError(400, f"{where}: a function_call needs name and arguments (a JSON string)")
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                out = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": out if isinstance(out, str) else json.dumps(out)})
            else:
                raise ApiError(400, f"{where}.type {str(kind)[:40]!r} is not supported (message, function_call, "
                                    "function_call_output)")
    else:
        raise ApiError(400, "input must be a string or a non-empty list of input items")
    chat: Json = {"model": req.get("model"), "messages": messages,
                            "max_tokens": req.get("max_output_tokens") or RESPONSES_MAX_TOKENS}
    for key in ("temperature", "top_p", "seed", "tool_choice"):
        if req.get(key) is not None:
            chat[key] = req[key]
    if logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = req.get("top_logprobs") or 0
    tools = req.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise ApiError(400, "tools must be a list")
        chat["tools"] = []
        for j, t in enumerate(tools):
            if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)):
                raise ApiError(400, f"tools[{j}]: only function tools {{type: 'function', name, parameters}} are "
                                    "supported")
            chat["tools"].append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
    return chat


def _output_logprobs(choice: Json) -> list[Json]:
    """The output_text's logprobs (one per token of the text, with its top_logprobs) from a chat choice's: the same
    objects, as OpenAI's Responses API writes them; [] when none were asked."""
    return list((choice.get("logprobs") or {}).get("content") or [])


def from_chat(req: Json, completion: Json) -> Json:
    """The `response` object of `req` from its chat.completion."""
    choice = completion["choices"][0]
    msg = choice["message"]
    cut = choice["finish_reason"] == "length"
    output: list[Json] = []
    if msg.get("content") or not msg.get("tool_calls"):
        # A reply cut by max_output_tokens: its message is `incomplete` as the response is (OpenAI's shape).
        output.append({"type": "message", "id": new_id("msg"), "status": "incomplete" if cut else "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": msg.get("content") or "", "annotations": [],
                                    "logprobs": _output_logprobs(choice)}]})
    for call in msg.get("tool_calls") or []:
        output.append({"type": "function_call", "id": new_id("fc"), "call_id": call.get("id") or new_id("call"),
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    usage = completion["usage"]
    tools = req.get("tools") or []
    return {
        "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
        "model": completion["model"], "output": output, "parallel_tool_calls": True,
        "temperature": req.get("temperature", 1.0), "top_p": req.get("top_p", 1.0),
        "tool_choice": req.get("tool_choice") or "auto", "tools": tools, "store": False,
        "top_logprobs": req.get("top_logprobs") or 0,
        "text": {"format": {"type": "text"}}, "truncation": "disabled", "metadata": req.get("metadata") or {},
        "previous_response_id": None, "reasoning": None, "user": req.get("user"),
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }


def stream(req: Json, chunks: Iterator[Json], model: str) -> Iterator[bytes]:
    """The Responses API's server-sent events for `req`, made from its chat completion's stream (`chunks`: the chunk
    objects of backends/serve/streaming.py, with the usage chunk last): response.created and in_progress at once,
    the message's output_item.added / content_part.added with its first text, an output_text.delta per text chunk as
    it is sampled, then the done events of each output item (function calls whole: they are parsed once the reply
    has ended) and response.completed (or response.incomplete) with the response `from_chat` writes. A chunk that is
    an error ends the stream with an `error` event."""
    numbers = itertools.count()

    def event(kind: str, data: Json) -> bytes:
        return (b"event: " + kind.encode() + b"\ndata: "
                + json_bytes({"type": kind, "sequence_number": next(numbers), **data}) + b"\n\n")

    rid, created, msg_id = new_id("resp"), int(time.time()), new_id("msg")
    empty = {"model": model, "choices": [{"message": {"content": ""}, "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
    pending = {**from_chat(req, empty), "id": rid, "created_at": created, "status": "in_progress", "output": [],
               "usage": None, "incomplete_details": None}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    opened = {"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant", "content": []}
    where = {"item_id": msg_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", {"response": pending})
        yield event("response.in_progress", {"response": pending})
        text, calls, finish, usage, is_open = "", [], "stop", None, False
        lps: list[Json] = []  # the text's logprobs, when asked: they come with a choice's last chunk with text
        for chunk in chunks:
            if "error" in chunk:
                yield event("error", {"code": None, "message": chunk["error"]["message"], "param": None})
                return
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                got = _output_logprobs(choice)
                lps += got
                # The text's logprobs come from one pass once the reply is complete (streaming.py): with the last
                # chunk's text, or, when all of it has left, in a delta of no text, so the deltas' logprobs add up.
                if delta.get("content") or got:
                    if not is_open:
                        yield event("response.output_item.added", {"output_index": 0, "item": opened})
                        yield event("response.content_part.added", {**where, "part": part})
                        is_open = True
                    text += delta.get("content") or ""
                    yield event("response.output_text.delta", {**where, "delta": delta.get("content") or "",
                                                               "logprobs": got})
                calls += [{k: v for k, v in c.items() if k != "index"} for c in delta.get("tool_calls") or []]
                finish = choice.get("finish_reason") or finish
        assert usage is not None
        message: Json = {"content": text, **({"tool_calls": calls} if calls else {})}
        resp = {**from_chat(req, {"model": model, "usage": usage, "choices": [
            {"message": message, "finish_reason": finish, "logprobs": {"content": lps}}]}), "id": rid,
                "created_at": created}
        for i, item in enumerate(resp["output"]):
            if item["type"] == "message":
                item["id"] = msg_id
                if not is_open:
                    yield event("response.output_item.added", {"output_index": 0, "item": opened})
                    yield event("response.content_part.added", {**where, "part": part})
                yield event("response.output_text.done", {**where, "text": text, "logprobs": lps})
                yield event("response.content_part.done", {**where, "part": item["content"][0]})
            else:
                yield event("response.output_item.added", {"output_index": i,
                                                           "item": {**item, "arguments": "", "status": "in_progress"}})
                yield event("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": i,
                                                                       "delta": item["arguments"]})
                yield event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": i,
                                                                      "name": item["name"], "arguments": item["arguments"]})
            yield event("response.output_item.done", {"output_index": i, "item": item})
        done = "response.completed" if resp["status"] == "completed" else "response.incomplete"
        yield event(done, {"response": resp})
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()  # a client gone mid-stream: its sampling stops (backends/serve/streaming.py)
