"""OpenAI's chat and completion requests and responses, independent of any transport (docs/openai.md): `chat_plan` /
`completion_plan` read a request into prompts and SamplingParams, `chat_response` / `completion_response` turn the
sampler's SampleOutput into OpenAI's response object, `sse` into a `stream = true` reply, `error_body` is OpenAI's error
shape. `runner serve` (backends/serve/openai_api.py) and runner's verifiers env (an in-process client, no socket) both
use them; this module imports nothing of the server.

Chat messages become tokens through a `ChatFormat` (the model's renderer, given by runner: backends never import
runner). A bad request is an ApiError: a 4xx in OpenAI's error shape, {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from backends.errors import UserError
from backends.serve.limits import Limits, to_float, to_int
from backends.serve.replies import ApiError, json_bytes
from backends.tokenizer import Tokenizer, decode_text
from backends.types import Json, SampledSequence, SampleOutput, SamplingParams

if TYPE_CHECKING:
    import numpy as np

MODEL_NOT_FOUND = "model_not_found"  # the code of a 404 about `model` (an unknown route has none)
MAX_N = 128  # OpenAI's own cap on `n`
MAX_STOP = 4  # OpenAI's: up to 4 stop sequences
MAX_TOP_LOGPROBS = 20
CHAT_MAX_TOKENS = 512  # when a chat request gives none (OpenAI: the context's rest)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
T = TypeVar("T")


class ChatFormat(Protocol):
    """Chat messages <-> tokens for one model (runner/rl/openai_chat.py: the model's renderer)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def stop(self) -> list[str] | list[int]:
        """The renderer's stop sequences."""
        ...

    def prompt(self, messages: list[Json], tools: list[Json] | None) -> list[int]:
        """The generation prompt (UserError for messages the format cannot render)."""
        ...

    def reply(self, tokens: list[int]) -> tuple[Json, bool]:
        """The sampled tokens as an assistant message {"content", optional "tool_calls", "reasoning_content"}, and
        whether it ended on the renderer's stop sequence."""
        ...


# backends/serve/topk.py topk_and_own: (top ids, their logprobs, each position's own token's logprob), one pass
TopK = Callable[[list[int], int, float, Sequence[int]], tuple["np.ndarray", "np.ndarray", "np.ndarray"]]


# ---------------------------------------------------------------- reading requests


@dataclass
class Plan:
    """What to sample for one request: each prompt n times with `params`."""

    model: str
    prompts: list[list[int]]
    n: int
    params: SamplingParams | None  # None: nothing to sample (a completion with max_tokens = 0 and echo)
    user_stop: list[str]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool
    echo: bool = False
    extra: Json = field(default_factory=dict)

    @property
    def cost(self) -> int:
        """Tokens of sampling work (limits.Limits.max_request_tokens)."""
        gen = self.params.max_tokens if self.params is not None else 0
        return sum(self.n * (len(p) + gen) for p in self.prompts)


# ---------------------------------------------------------------- request bodies, typed (msgspec)


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class Sampling(msgspec.Struct):
    """What chat and completion requests share. Unknown fields are ignored (clients send many); a wrong type is a 400
    naming the field (`read`)."""

    model: str
    n: int = 1
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # not OpenAI's; vLLM and others accept it
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # vLLM's extension
    # Refused unless they ask for what runner serve does anyway (_refuse_unsupported).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: Json | None = None
    best_of: int | None = None
    tool_choice: str | Json | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Json] | None = None
    function_call: str | Json | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[Json] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Json] | None = None


class ChatRequest(Sampling):
    messages: list[Message] = []
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Json] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[object] | None = None  # a string, or a list of strings, token ids or lists of ids (checked)
    echo: bool | None = None
    logprobs: bool | int | None = None  # an int: how many top_logprobs
    suffix: str | None = None
    ignore_eos: bool | None = None  # vLLM's extension: only max_tokens and `stop` end a sample


_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "object": "an object",
          "array": "a list", "null": "null"}


def read(req: Json, kind: type[T]) -> T:
    """`req` as the struct `kind`; a wrong type or a missing field is a 400 naming it (its `param`)."""
    try:
        return msgspec.convert(req, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if m := re.fullmatch(r"Expected `(.+?)`, got `(.+?)` - at `\$\.?(.*)`", text):
            want = " or ".join(_KINDS.get(k.strip(), k.strip()) for k in m[1].split("|"))
            raise ApiError(400, f"{m[3]} must be {want}, not {m[2]}", param=m[3]) from None
        if m := re.fullmatch(r"Object missing required field `(.+?)`(?: - at `\$\.?(.*)`)?", text):
            field = f"{m[2]}.{m[1]}" if m[2] else m[1]
            raise ApiError(400, f"{field} is required", param=field) from None
        raise ApiError(400, text) from None


def _refuse_unsupported(r: Sampling) -> None:
    for key, v in (("presence_penalty", r.presence_penalty), ("frequency_penalty", r.frequency_penalty)):
        if v:
            raise ApiError(400, f"{key} is not supported (only 0)", param=key)
    if r.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    fmt = r.response_format
    if fmt is not None and fmt.get("type", "text") != "text":
        raise ApiError(400, f"response_format {str(fmt.get('type'))[:40]!r} is not supported (only text)",
                       param="response_format")
    if r.best_of not in (None, 1):
        raise ApiError(400, "best_of is not supported (only 1)", param="best_of")
    # Tool-use controls runner serve cannot honour: refused, not ignored. "auto" (the default) and parallel calls
    # allowed (the default) are what it does.
    if r.tool_choice is not None and r.tool_choice != "auto":
        raise ApiError(400, f"tool_choice {str(r.tool_choice)[:60]!r} is not supported (only 'auto')",
                       param="tool_choice")
    if r.parallel_tool_calls is False:
        raise ApiError(400, "parallel_tool_calls = false is not supported (the model may call several tools)",
                       param="parallel_tool_calls")
    for legacy, v in (("functions", r.functions), ("function_call", r.function_call)):
        if v is not None:
            raise ApiError(400, f"{legacy} (the legacy function-calling API) is not supported: use tools", param=legacy)


def _stops(r: Sampling) -> list[str]:
    stop = [r.stop] if isinstance(r.stop, str) else r.stop or []
    if not all(stop):
        raise ApiError(400, "stop must be a non-empty string or a list of non-empty strings", param="stop")
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop has {len(stop)} strings; at most {MAX_STOP}", param="stop")
    return stop


def _params(r: Sampling, default_max_tokens: int, stop: list[str] | list[int] | None, lo_tokens: int = 1
            ) -> SamplingParams | None:
    key = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
    raw = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    max_tokens = default_max_tokens if raw is None else to_int(key, raw, lo=lo_tokens)
    temperature = 1.0 if r.temperature is None else to_float("temperature", r.temperature, lo=0.0, hi=2.0)
    top_p = 1.0 if r.top_p is None else to_float("top_p", r.top_p, lo=0.0, hi=1.0)
    if top_p == 0.0:
        raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
    top_k = -1 if r.top_k is None else to_int("top_k", r.top_k, lo=-1)
    if max_tokens == 0:
        return None
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          stop=stop, seed=r.seed)


def _small_int(key: str, v: int | None, default: int, lo: int, hi: int) -> int:
    """An integer field with OpenAI's range: out of it a 400 (the client's BadRequestError), not a 413."""
    if v is None:
        return default
    if not lo <= v <= hi:
        raise ApiError(400, f"{key} must be in [{lo}, {hi}], not {v}", param=key)
    return v


def _stream(r: Sampling) -> tuple[bool, bool]:
    stream = bool(r.stream)
    if r.stream_options is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream = true", param="stream_options")
    return stream, stream and r.stream_options is not None and r.stream_options.include_usage


def _with_user_stops(stop: list[str] | list[int], user: list[str], tokenizer: Tokenizer) -> list[str] | list[int]:
    """The sampler's stop list: the format's own stops, plus the request's strings (stop token ids then stop as
    their text, as a stop list holds strings or ids, not both). The text is cut at the user's strings afterwards."""
    if not user:
        return stop
    own = [decode_text(tokenizer, [s], skip_special_tokens=False) if isinstance(s, int) else s for s in stop]
    return [*dict.fromkeys([*own, *user])]


# The roles of OpenAI's chat API; any other was rendered as given (a "wizard" turn the model never saw in training).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def chat_plan(req: Json, fmt: ChatFormat, limits: Limits | None = None) -> Plan:
    """An OpenAI chat completion request as prompt tokens and sampling params (ApiError for a bad request)."""
    r = read(req, ChatRequest)
    if not r.messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(r.messages):
        if m.role not in ROLES:
            raise ApiError(400, f"messages[{i}].role {m.role!r}: expected one of {', '.join(sorted(ROLES))}",
                           param=f"messages[{i}].role")
        content = m.content
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(str(p["text"]) for p in content)
        elif content is None:
            if not m.tool_calls:
                raise ApiError(400, f"messages[{i}] has no content", param=f"messages[{i}].content")
            content = ""
        msg: Json = {"role": m.role, "content": content}
        msg.update({k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None})
        if m.tool_calls is not None:
            msg["tool_calls"] = _tool_calls(m.tool_calls, f"messages[{i}].tool_calls")
        out.append(msg)
    _refuse_unsupported(r)
    n = _small_int("n", r.n, 1, 1, MAX_N)
    user_stop = _stops(r)
    logprobs = bool(r.logprobs)
    top = _small_int("top_logprobs", r.top_logprobs, 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs = true", param="top_logprobs")
    stream, usage = _stream(r)
    params = _params(r, CHAT_MAX_TOKENS, _with_user_stops(fmt.stop, user_stop, fmt.tokenizer))
    try:
        prompt = fmt.prompt(out, [_tool_spec(t) for t in r.tools] if r.tools else None)
    except (UserError, ValueError, KeyError, TypeError) as exc:
        raise ApiError(400, f"cannot render these messages: {exc}") from None
    return Plan(r.model, [prompt], n, params, user_stop, logprobs, top, stream, usage,
                extra={"return_token_ids": bool(r.return_token_ids)})


def _tool_calls(calls: object, where: str) -> list[Json]:
    """An assistant message's tool_calls: [{id, type: "function", function: {name, arguments (a JSON string)}}]."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where} must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}[{j}] must be {{id, type: 'function', function: {{name, arguments}}}}")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args)
        if not isinstance(args, str):
            raise ApiError(400, f"{where}[{j}].function.arguments must be a JSON string")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise ApiError(400, f"{where}[{j}].id must be a string")
        if c.get("type", "function") != "function":
            raise ApiError(400, f"{where}[{j}].type must be 'function'")
        out.append({"type": "function", "id": c.get("id"), "function": {"name": fn["name"], "arguments": args}})
    return out


def lone_surrogate(obj: object, where: str = "") -> str | None:
    """The JSON path of the first string (key or value) in `obj` that is not valid Unicode (a lone surrogate,
    which JSON's \\u escapes can write and no tokenizer takes), else None."""
    stack: list[tuple[object, str]] = [(obj, where)]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "the body"
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = f"{path}.{k}" if path else str(k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return sub.encode("utf-8", "replace").decode()
                stack.append((x, sub))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v))
    return None


def _tool_spec(tool: Json) -> Json:
    """{"type": "function", "function": {...}} -> the function's JSON schema spec."""
    fn = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "tools: each must be {type: 'function', function: {name, description, parameters}}")
    return {"name": fn["name"], "description": fn.get("description", ""),
            "parameters": fn.get("parameters", {"type": "object", "properties": {}})}


def completion_plan(req: Json, tokenizer: Tokenizer, limits: Limits | None = None) -> Plan:
    """An OpenAI (legacy) completion request: prompt text (or token ids, one prompt or a list)."""
    r = read(req, CompletionRequest)
    prompt = r.prompt
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                       param="prompt")
    cap = (limits or Limits()).max_prompts
    if len(prompt) > cap:  # before any is tokenized or sized
        raise ApiError(413, f"prompt has {len(prompt)} prompts; runner serve takes at most {cap} per request")
    prompts: list[list[int]] = []
    for p in prompt:
        if isinstance(p, str):
            toks = list(tokenizer.encode(p))
        elif isinstance(p, list) and all(type(t) is int for t in p):
            toks = [to_int("prompt token", t, lo=0) for t in p]
            if bad := [t for t in toks if t >= len(tokenizer)]:  # not a size over a cap (to_int's 413): a wrong id
                raise ApiError(400, f"prompt token {bad[0]} is outside the model's vocabulary [0, {len(tokenizer)})",
                               param="prompt")
        else:
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such "
                                "lists", param="prompt")
        if not toks:
            raise ApiError(400, "a prompt has no tokens", param="prompt")
        prompts.append(toks)
    _refuse_unsupported(r)
    if r.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    n = _small_int("n", r.n, 1, 1, MAX_N)
    user_stop = _stops(r)
    echo = bool(r.echo)
    lp = r.logprobs
    top = 0 if lp is None or lp is False else _small_int("logprobs", int(lp), 0, 0, MAX_TOP_LOGPROBS)
    stream, usage = _stream(r)
    eos = getattr(tokenizer, "eos_token", None)
    stop: list[str] | None = [*user_stop, eos] if user_stop and eos else (user_stop or None)
    if r.ignore_eos:  # vLLM's extension: only max_tokens and `stop` end a sample
        stop = list(user_stop)
    params = _params(r, COMPLETION_MAX_TOKENS, stop, lo_tokens=0 if echo else 1)
    if params is None and stream:
        raise ApiError(400, "max_tokens = 0 cannot stream", param="max_tokens")
    return Plan(r.model, prompts, n, params, user_stop, lp is not None and lp is not False, top, stream, usage, echo,
                extra={"return_token_ids": bool(r.return_token_ids)})


# ---------------------------------------------------------------- writing responses


def _cut(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _token_texts(tokenizer: Tokenizer, tokens: Sequence[int]) -> list[str]:
    """Each token's text as the reply's text shows it: a special token's is empty, so the texts add up to it."""
    return [decode_text(tokenizer, [t], skip_special_tokens=True) for t in tokens]


def _kept_tokens(tokenizer: Tokenizer, tokens: list[int], text_len: int) -> int:
    """How many leading tokens make up the first `text_len` characters of their decoded text."""
    for k in range(len(tokens) + 1):
        if len(decode_text(tokenizer, tokens[:k], skip_special_tokens=True)) >= text_len:
            return k
    return len(tokens)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _usage(prompts: list[list[int]], n: int, completion_tokens: int) -> dict[str, int]:
    p = sum(len(x) for x in prompts) * n
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def chat_response(plan: Plan, out: SampleOutput, fmt: ChatFormat, topk: TopK | None = None) -> Json:
    """The chat.completion object for plan's one prompt sampled n times (`out`)."""
    tok = fmt.tokenizer
    choices = []
    completion_tokens = 0
    for i, seq in enumerate(out.sequences):
        completion_tokens += len(seq.tokens)
        message, clean = fmt.reply(list(seq.tokens))
        content = message.get("content") or ""
        cut = _cut(content, plan.user_stop)
        tokens = list(seq.tokens)
        if clean and tokens and seq.stop_reason == "stop":
            tokens = tokens[:-1]  # the stop token: not part of the reply
        if cut is not None:
            content = content[:cut]
            tokens = tokens[: _kept_tokens(tok, tokens, cut)]
        finish = "stop" if clean or cut is not None else "length"
        msg: Json = {"role": "assistant", "content": content, "refusal": None}
        if message.get("reasoning_content"):
            msg["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls") and cut is None:
            msg["tool_calls"] = message["tool_calls"]
            finish = "tool_calls"
        logprobs = None
        if plan.logprobs:
            logprobs = {"content": _chat_logprobs(tok, plan.prompts[0], seq, len(tokens), plan, topk), "refusal": None}
        choice: Json = {"index": i, "message": msg, "logprobs": logprobs, "finish_reason": finish}
        if plan.extra.get("return_token_ids"):  # vLLM's extension: the sampled tokens, stop token included
            choice["token_ids"] = list(seq.tokens)
        choices.append(choice)
    resp: Json = {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": plan.model,
        "choices": choices, "usage": _usage(plan.prompts, plan.n, completion_tokens), "system_fingerprint": None}
    if plan.extra.get("return_token_ids"):
        resp["prompt_token_ids"] = list(plan.prompts[0])
    return resp


def _chat_logprobs(tok: Tokenizer, prompt: list[int], seq: SampledSequence, keep: int, plan: Plan, topk: TopK | None
                   ) -> list[Json]:
    tokens = list(seq.tokens[:keep])
    # A special token's text as the reply's content shows it (none): the tokens' texts add up to the content.
    texts = [decode_text(tok, [t], skip_special_tokens=True) for t in tokens]
    tops: list[list[Json]] = [[] for _ in tokens]
    own: list[float] = [float(x) for x in seq.logprobs[:keep]]
    if plan.top_logprobs and tokens:
        if topk is None:
            raise ApiError(400, "top_logprobs is not offered by this sampler")
        assert plan.params is not None
        ids, lps, mine = topk([*prompt, *tokens], plan.top_logprobs, plan.params.temperature,
                              range(len(prompt), len(prompt) + len(tokens)))
        own = [float(x) for x in mine]  # the same pass as the alternatives: one number where they meet
        for j in range(len(tokens)):
            alt = [decode_text(tok, [int(x)], skip_special_tokens=True) for x in ids[j]]
            tops[j] = [{"token": t, "logprob": float(v), "bytes": list(t.encode())} for t, v in zip(alt, lps[j], strict=True)]
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": top}
            for t, lp, top in zip(texts, own, tops, strict=True)]


def completion_response(plan: Plan, outs: list[SampleOutput | None], tokenizer: Tokenizer, topk: TopK | None = None,
                        prompt_logprobs: list[list[float | None]] | None = None) -> Json:
    """The text_completion object: plan.prompts[p] sampled n times is outs[p] (None when nothing was sampled);
    choice index p * n + k. With echo, the prompt's text (and its logprobs: prompt_logprobs) come first."""
    choices = []
    completion_tokens = 0
    for p, (prompt, out) in enumerate(zip(plan.prompts, outs, strict=True)):
        seqs = out.sequences if out is not None else [SampledSequence([], [], "length")] * plan.n
        for k, seq in enumerate(seqs):
            completion_tokens += len(seq.tokens)
            tokens = list(seq.tokens)
            text = decode_text(tokenizer, tokens, skip_special_tokens=True)
            cut = _cut(text, plan.user_stop)
            if cut is not None:
                text = text[:cut]
                tokens = tokens[: _kept_tokens(tokenizer, tokens, cut)]
            elif (seq.stop_reason == "stop" and tokens and not plan.echo
                  and not decode_text(tokenizer, tokens[-1:], skip_special_tokens=True)):
                tokens = tokens[:-1]  # EOS (kept with echo: lm-eval drops the last scored token as the sampled one)
            finish = "stop" if seq.stop_reason == "stop" or cut is not None else "length"
            logprobs = None
            if plan.logprobs:
                logprobs = _completion_logprobs(tokenizer, prompt, seq, len(tokens), plan, topk,
                                                prompt_logprobs[p] if prompt_logprobs else None)
            if plan.echo:
                text = decode_text(tokenizer, prompt, skip_special_tokens=True) + text
            choice: Json = {"index": p * plan.n + k, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish}
            if plan.extra.get("return_token_ids"):  # vLLM's extension
                choice["prompt_token_ids"], choice["token_ids"] = list(prompt), list(seq.tokens)
            choices.append(choice)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": plan.model,
            "choices": choices, "usage": _usage(plan.prompts, plan.n, completion_tokens), "system_fingerprint": None}


def _completion_logprobs(tok: Tokenizer, prompt: list[int], seq: SampledSequence, keep: int, plan: Plan, topk: TopK | None,
                         prompt_lps: list[float | None] | None) -> Json:
    tokens = list(seq.tokens[:keep])
    lps: list[float | None] = [float(x) for x in seq.logprobs[:keep]]
    start = 0
    if plan.echo:
        assert prompt_lps is not None
        tokens, lps, start = [*prompt, *tokens], [*prompt_lps, *lps], 0
    else:
        start = len(prompt)
    full = [*prompt, *seq.tokens[:keep]]
    texts = _token_texts(tok, tokens)
    tops: list[dict[str, float] | None] = [None] * len(tokens)
    if plan.top_logprobs:
        if topk is None:
            raise ApiError(400, "logprobs > 0 is not offered by this sampler")
        positions = [q for q in range(start, len(full)) if q > 0]
        temperature = plan.params.temperature if plan.params is not None else 1.0
        # Prompt positions (echo) at temperature 1, as their logprobs are; sampled ones at the request's.
        n_prompt = [q for q in positions if q < len(prompt)]
        n_gen = [q for q in positions if q >= len(prompt)]
        for group, temp in ((n_prompt, 1.0), (n_gen, temperature)):
            if not group:
                continue
            ids, vals, mine = topk(full, plan.top_logprobs, temp, group)
            for j, q in enumerate(group):
                alt = _token_texts(tok, [int(x) for x in ids[j]])
                tops[q - start] = {t: float(v) for t, v in zip(alt, vals[j], strict=True)}
                lps[q - start] = float(mine[j])  # one pass: equal to its own entry among the alternatives
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def sse(response: Json, include_usage: bool) -> bytes:
    """A finished response as OpenAI's server-sent event stream (one chunk per choice, then usage, then [DONE])."""
    chat = response["object"] == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {k: response[k] for k in ("id", "created", "model", "system_fingerprint")}
    events: list[Json] = []
    for c in response["choices"]:
        if chat:
            delta = {k: v for k, v in c["message"].items() if k != "tool_calls"}
            if "tool_calls" in c["message"]:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(c["message"]["tool_calls"])]
            events.append({**head, "object": obj, "choices": [{"index": c["index"], "delta": delta,
                                                                "logprobs": c["logprobs"], "finish_reason": None}]})
            events.append({**head, "object": obj, "choices": [{"index": c["index"], "delta": {},
                                                                "logprobs": None, "finish_reason": c["finish_reason"]}]})
        else:
            events.append({**head, "object": obj, "choices": [c]})
    if include_usage:  # every chunk has `usage`: null but the last, which has only it
        events = [{**e, "usage": None} for e in events]
        events.append({**head, "object": obj, "choices": [], "usage": response["usage"]})
    return b"".join(b"data: " + json_bytes(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> Json:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = code or {401: "invalid_api_key"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


