"""OpenAI-compatible endpoints: `/v1/chat/completions`, `/v1/completions`, `/v1/models` (docs/openai.md).

Two layers:
- the request/response code, independent of any transport: `chat_plan` / `completion_plan` read an OpenAI request
  into prompts and SamplingParams, `chat_response` / `completion_response` turn the sampler's SampleOutput into
  OpenAI's response object, `sse` into a `stream = true` reply. runner's verifiers env (an in-process client, no
  socket) and `runner serve` both use them;
- `OpenAIRoutes`, `runner serve`'s routes: `model` names a served base model, a sampler checkpoint of this server
  (`tinker://<run>/sampler_weights/<name>`), or a local checkpoint (a run dir, `RUN_DIR:NAME`, or a checkpoint
  folder) that the `local_model` hook resolves.

Chat messages become tokens through a `ChatFormat` (the model's renderer, given by runner: backends never import
runner). A bad request is a 4xx in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hmac
import itertools
import json
import queue
import secrets
import shutil
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from backends.errors import UserError
from backends.serve import responses
from backends.serve.files import copy_folder
from backends.serve.limits import Fields, Limits, json_depth_ok, to_int
from backends.serve.memory import fmt_bytes
from backends.serve.replies import ApiError, Reply, json_bytes
from backends.tokenizer import Tokenizer
from backends.types import SampledSequence, SampleOutput, SamplingParams

if TYPE_CHECKING:
    from backends.serve.samplers import SamplerSession

MODEL_NOT_FOUND = "model_not_found"  # the code of a 404 about `model` (an unknown route has none)
MAX_N = 128  # OpenAI's own cap on `n`
MAX_STOP = 4  # OpenAI's: up to 4 stop sequences
MAX_TOP_LOGPROBS = 20
CHAT_MAX_TOKENS = 512  # when a chat request gives none (OpenAI: the context's rest)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ChatFormat(Protocol):
    """Chat messages <-> tokens for one model (runner/rl/openai_chat.py: the model's renderer)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def stop(self) -> list[str] | list[int]:
        """The renderer's stop sequences."""
        ...

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        """The generation prompt (UserError for messages the format cannot render)."""
        ...

    def reply(self, tokens: list[int]) -> tuple[dict[str, Any], bool]:
        """The sampled tokens as an assistant message {"content", optional "tool_calls", "reasoning_content"}, and
        whether it ended on the renderer's stop sequence."""
        ...


# backends/serve/topk.py topk_and_own: (top ids, their logprobs, each position's own token's logprob), one pass
TopK = Callable[[list[int], int, float, Sequence[int]], tuple[Any, Any, Any]]


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
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def cost(self) -> int:
        """Tokens of sampling work (limits.Limits.max_request_tokens)."""
        gen = self.params.max_tokens if self.params is not None else 0
        return sum(self.n * (len(p) + gen) for p in self.prompts)


def _refuse_unsupported(f: Fields) -> None:
    for key in ("presence_penalty", "frequency_penalty"):
        if f.float(key, 0.0) != 0.0:
            raise ApiError(400, f"{key} is not supported (only 0)")
    if f.dict("logit_bias", None):
        raise ApiError(400, "logit_bias is not supported")
    fmt = f.dict("response_format", None)
    if fmt is not None and fmt.get("type", "text") != "text":
        raise ApiError(400, f"response_format {str(fmt.get('type'))[:40]!r} is not supported (only text)")
    if f.int("best_of", 1, lo=1) != 1:
        raise ApiError(400, "best_of is not supported (only 1)")
    # Tool-use controls runner serve cannot honour: refused, not ignored. "auto" (the default) and parallel calls
    # allowed (the default) are what it does.
    choice = f.req.get("tool_choice")
    if choice is not None and choice != "auto":
        raise ApiError(400, f"tool_choice {str(choice)[:60]!r} is not supported (only 'auto')")
    if f.req.get("parallel_tool_calls") is False:
        raise ApiError(400, "parallel_tool_calls = false is not supported (the model may call several tools)")
    for legacy in ("functions", "function_call"):
        if f.req.get(legacy) is not None:
            raise ApiError(400, f"{legacy} (the legacy function-calling API) is not supported: use tools")


def _stops(f: Fields) -> list[str]:
    stop = f.req.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop has {len(stop)} strings; at most {MAX_STOP}")
    return list(stop)


def _params(f: Fields, default_max_tokens: int, stop: list[str] | list[int] | None, lo_tokens: int = 1
            ) -> SamplingParams | None:
    raw = f.req.get("max_completion_tokens", f.req.get("max_tokens"))
    key = "max_completion_tokens" if "max_completion_tokens" in f.req else "max_tokens"
    max_tokens = default_max_tokens if raw is None else to_int(key, raw, lo=lo_tokens)
    temperature = f.float("temperature", 1.0, lo=0.0, hi=2.0)
    top_p = f.float("top_p", 1.0, lo=0.0, hi=1.0)
    if top_p == 0.0:
        raise ApiError(400, "top_p must be in (0, 1]")
    top_k = f.int("top_k", -1, lo=-1)  # not OpenAI's; vLLM and others accept it
    seed = f.int("seed", None)
    if max_tokens == 0:
        return None
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          stop=stop, seed=seed)


def _small_int(f: Fields, key: str, default: int, lo: int, hi: int) -> int:
    """An integer field with OpenAI's range: out of it a 400 (the client's BadRequestError), not a 413."""
    v = f.int(key, default)
    if not lo <= v <= hi:
        raise ApiError(400, f"{key} must be in [{lo}, {hi}], not {v}")
    return v


def _stream(f: Fields) -> tuple[bool, bool]:
    stream = f.bool("stream", False)
    if f.req.get("stream_options") is not None and not stream:
        raise ApiError(400, "stream_options is only allowed with stream = true")
    opts = f.sub("stream_options")
    return stream, stream and opts.bool("include_usage", False)


def _with_user_stops(stop: list[str] | list[int], user: list[str], tokenizer: Tokenizer) -> list[str] | list[int]:
    """The sampler's stop list: the format's own stops, plus the request's strings (stop token ids then stop as
    their text, as a stop list holds strings or ids, not both). The text is cut at the user's strings afterwards."""
    if not user:
        return stop
    own = [tokenizer.decode([s], skip_special_tokens=False) if isinstance(s, int) else s for s in stop]
    return [*dict.fromkeys([*own, *user])]


# The roles of OpenAI's chat API; any other was rendered as given (a "wizard" turn the model never saw in training).
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def chat_plan(req: dict[str, Any], fmt: ChatFormat, limits: Limits | None = None) -> Plan:
    """An OpenAI chat completion request as prompt tokens and sampling params (ApiError for a bad request)."""
    f = Fields(req, limits or Limits())
    model = f.str("model")
    messages = req.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a role")
        if m["role"] not in ROLES:
            raise ApiError(400, f"messages[{i}].role {m['role']!r}: expected one of {', '.join(sorted(ROLES))}")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        elif content is None:
            if not m.get("tool_calls"):
                raise ApiError(400, f"messages[{i}] has no content")
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts")
        msg = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id")}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
        for key in ("name", "tool_call_id"):
            if key in msg and not isinstance(msg[key], str):
                raise ApiError(400, f"messages[{i}].{key} must be a string")
        msg["content"] = content
        out.append(msg)
    tools = req.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ApiError(400, "tools must be a list of tool objects")
    _refuse_unsupported(f)
    n = _small_int(f, "n", 1, 1, MAX_N)
    user_stop = _stops(f)
    logprobs = f.bool("logprobs", False)
    top = _small_int(f, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs = true")
    stream, usage = _stream(f)
    params = _params(f, CHAT_MAX_TOKENS, _with_user_stops(fmt.stop, user_stop, fmt.tokenizer))
    try:
        prompt = fmt.prompt(out, [_tool_spec(t) for t in tools] if tools else None)
    except (UserError, ValueError, KeyError, TypeError) as exc:
        raise ApiError(400, f"cannot render these messages: {exc}") from None
    return Plan(model, [prompt], n, params, user_stop, logprobs, top, stream, usage,
                extra={"return_token_ids": f.bool("return_token_ids", False)})


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
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


def lone_surrogate(obj: Any, where: str = "") -> str | None:
    """The JSON path of the first string (key or value) in `obj` that is not valid Unicode (a lone surrogate,
    which JSON's \\u escapes can write and no tokenizer takes), else None."""
    stack: list[tuple[Any, str]] = [(obj, where)]
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


def _tool_spec(tool: dict[str, Any]) -> dict[str, Any]:
    """{"type": "function", "function": {...}} -> the function's JSON schema spec."""
    fn = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "tools: each must be {type: 'function', function: {name, description, parameters}}")
    return {"name": fn["name"], "description": fn.get("description", ""),
            "parameters": fn.get("parameters", {"type": "object", "properties": {}})}


def completion_plan(req: dict[str, Any], tokenizer: Tokenizer, limits: Limits | None = None) -> Plan:
    """An OpenAI (legacy) completion request: prompt text (or token ids, one prompt or a list)."""
    f = Fields(req, limits or Limits())
    model = f.str("model")
    prompt = req.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists")
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
                raise ApiError(400, f"prompt token {bad[0]} is outside the model's vocabulary [0, {len(tokenizer)})")
        else:
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists")
        if not toks:
            raise ApiError(400, "a prompt has no tokens")
        prompts.append(toks)
    _refuse_unsupported(f)
    if f.str("suffix", ""):
        raise ApiError(400, "suffix is not supported")
    n = _small_int(f, "n", 1, 1, MAX_N)
    user_stop = _stops(f)
    echo = f.bool("echo", False)
    lp = req.get("logprobs")
    top = 0 if lp is None or lp is False else _small_int(f, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    stream, usage = _stream(f)
    eos = getattr(tokenizer, "eos_token", None)
    stop: list[str] | None = [*user_stop, eos] if user_stop and eos else (user_stop or None)
    if f.bool("ignore_eos", False):  # vLLM's extension: only max_tokens and `stop` end a sample
        stop = list(user_stop)
    params = _params(f, COMPLETION_MAX_TOKENS, stop, lo_tokens=0 if echo else 1)
    if params is None and stream:
        raise ApiError(400, "max_tokens = 0 cannot stream")
    return Plan(model, prompts, n, params, user_stop, lp is not None and lp is not False, top, stream, usage, echo,
                extra={"return_token_ids": f.bool("return_token_ids", False)})


# ---------------------------------------------------------------- writing responses


def _cut(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _token_texts(tokenizer: Tokenizer, tokens: Sequence[int]) -> list[str]:
    """Each token's text as the reply's text shows it: a special token's is empty, so the texts add up to it."""
    return [tokenizer.decode([t], skip_special_tokens=True) for t in tokens]


def _kept_tokens(tokenizer: Tokenizer, tokens: list[int], text_len: int) -> int:
    """How many leading tokens make up the first `text_len` characters of their decoded text."""
    for k in range(len(tokens) + 1):
        if len(tokenizer.decode(tokens[:k], skip_special_tokens=True)) >= text_len:
            return k
    return len(tokens)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _usage(prompts: list[list[int]], n: int, completion_tokens: int) -> dict[str, int]:
    p = sum(len(x) for x in prompts) * n
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def chat_response(plan: Plan, out: SampleOutput, fmt: ChatFormat, topk: TopK | None = None) -> dict[str, Any]:
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
        msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if message.get("reasoning_content"):
            msg["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls") and cut is None:
            msg["tool_calls"] = message["tool_calls"]
            finish = "tool_calls"
        logprobs = None
        if plan.logprobs:
            logprobs = {"content": _chat_logprobs(tok, plan.prompts[0], seq, len(tokens), plan, topk), "refusal": None}
        choice: dict[str, Any] = {"index": i, "message": msg, "logprobs": logprobs, "finish_reason": finish}
        if plan.extra.get("return_token_ids"):  # vLLM's extension: the sampled tokens, stop token included
            choice["token_ids"] = list(seq.tokens)
        choices.append(choice)
    resp: dict[str, Any] = {
        "id": _new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": plan.model,
        "choices": choices, "usage": _usage(plan.prompts, plan.n, completion_tokens), "system_fingerprint": None}
    if plan.extra.get("return_token_ids"):
        resp["prompt_token_ids"] = list(plan.prompts[0])
    return resp


def _chat_logprobs(tok: Tokenizer, prompt: list[int], seq: SampledSequence, keep: int, plan: Plan, topk: TopK | None
                   ) -> list[dict[str, Any]]:
    tokens = list(seq.tokens[:keep])
    # A special token's text as the reply's content shows it (none): the tokens' texts add up to the content.
    texts = [tok.decode([t], skip_special_tokens=True) for t in tokens]
    tops: list[list[dict[str, Any]]] = [[] for _ in tokens]
    own: list[float] = [float(x) for x in seq.logprobs[:keep]]
    if plan.top_logprobs and tokens:
        if topk is None:
            raise ApiError(400, "top_logprobs is not offered by this sampler")
        assert plan.params is not None
        ids, lps, mine = topk([*prompt, *tokens], plan.top_logprobs, plan.params.temperature,
                              range(len(prompt), len(prompt) + len(tokens)))
        own = [float(x) for x in mine]  # the same pass as the alternatives: one number where they meet
        for j in range(len(tokens)):
            alt = [tok.decode([int(x)], skip_special_tokens=True) for x in ids[j]]
            tops[j] = [{"token": t, "logprob": float(v), "bytes": list(t.encode())} for t, v in zip(alt, lps[j], strict=True)]
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": top}
            for t, lp, top in zip(texts, own, tops, strict=True)]


def completion_response(plan: Plan, outs: list[SampleOutput | None], tokenizer: Tokenizer, topk: TopK | None = None,
                        prompt_logprobs: list[list[float | None]] | None = None) -> dict[str, Any]:
    """The text_completion object: plan.prompts[p] sampled n times is outs[p] (None when nothing was sampled);
    choice index p * n + k. With echo, the prompt's text (and its logprobs: prompt_logprobs) come first."""
    choices = []
    completion_tokens = 0
    for p, (prompt, out) in enumerate(zip(plan.prompts, outs, strict=True)):
        seqs = out.sequences if out is not None else [SampledSequence([], [], "length")] * plan.n
        for k, seq in enumerate(seqs):
            completion_tokens += len(seq.tokens)
            tokens = list(seq.tokens)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            cut = _cut(text, plan.user_stop)
            if cut is not None:
                text = text[:cut]
                tokens = tokens[: _kept_tokens(tokenizer, tokens, cut)]
            elif (seq.stop_reason == "stop" and tokens and not plan.echo
                  and not tokenizer.decode(tokens[-1:], skip_special_tokens=True)):
                tokens = tokens[:-1]  # EOS (kept with echo: lm-eval drops the last scored token as the sampled one)
            finish = "stop" if seq.stop_reason == "stop" or cut is not None else "length"
            logprobs = None
            if plan.logprobs:
                logprobs = _completion_logprobs(tokenizer, prompt, seq, len(tokens), plan, topk,
                                                prompt_logprobs[p] if prompt_logprobs else None)
            if plan.echo:
                text = tokenizer.decode(prompt, skip_special_tokens=True) + text
            choice: dict[str, Any] = {"index": p * plan.n + k, "text": text, "logprobs": logprobs,
                                      "finish_reason": finish}
            if plan.extra.get("return_token_ids"):  # vLLM's extension
                choice["prompt_token_ids"], choice["token_ids"] = list(prompt), list(seq.tokens)
            choices.append(choice)
    return {"id": _new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": plan.model,
            "choices": choices, "usage": _usage(plan.prompts, plan.n, completion_tokens), "system_fingerprint": None}


def _completion_logprobs(tok: Tokenizer, prompt: list[int], seq: SampledSequence, keep: int, plan: Plan, topk: TopK | None,
                         prompt_lps: list[float | None] | None) -> dict[str, Any]:
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


def sse(response: dict[str, Any], include_usage: bool) -> bytes:
    """A finished response as OpenAI's server-sent event stream (one chunk per choice, then usage, then [DONE])."""
    chat = response["object"] == "chat.completion"
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {k: response[k] for k in ("id", "created", "model", "system_fingerprint")}
    events: list[dict[str, Any]] = []
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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")
    code = code or {401: "invalid_api_key"}.get(status)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------- runner serve's routes


@dataclass(frozen=True)
class LocalModel:
    """A local checkpoint the `local_model` hook found: its base model (as its run named it), its sampler folder,
    and its run's renderer (None: the served model's)."""

    base_model: str
    path: Path
    renderer: str | None = None


@dataclass
class OpenAIHooks:
    """What runner gives `runner serve` (backends never import runner): the chat format of a model (its name as
    served, its tokenizer, a renderer name or None for the model's own) and the resolver of local checkpoints
    (a run dir, `RUN_DIR:NAME`, a checkpoint folder; None when `spec` names none)."""

    chat: Callable[[str, Any, str | None], ChatFormat]
    local_model: Callable[[str], LocalModel | None] = lambda _: None


class OpenAIRoutes:
    """`/v1/...` on runner serve. Each distinct `model` gets one sampling session in the service's sampler pool
    (loaded on demand, freed when idle like the SDK's), so the pool's caps hold for these requests too."""

    def __init__(self, service: Any, hooks: OpenAIHooks | None = None):
        # service: backends.serve.service.Service (not imported: it imports this module)
        self.service = service
        self.hooks = hooks
        self._lock = threading.Lock()
        self._sessions: dict[str, tuple[SamplerSession, str | None]] = {}  # model spec -> (session, renderer)
        self._formats: dict[tuple[str, str | None], ChatFormat] = {}
        self._ids = itertools.count()
        self._started = int(time.time())

    def handle(self, method: str, route: str, headers: dict[str, str], body: bytes,
               gone: Callable[[], bool] | None = None) -> Reply:
        try:
            return self._handle(method, route, headers, body, gone or _never)
        except ClientGone:
            return Reply(Reply.GONE)
        except ApiError as exc:
            return Reply.json(error_body(exc.status, exc.detail, code=exc.code), exc.status)
        except (UserError, ValueError) as exc:
            return Reply.json(error_body(400, str(exc)[:300]), 400)

    def _authorized(self, headers: dict[str, str]) -> bool:
        key = self.service.api_key
        if key is None:
            return True
        given = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    def _handle(self, method: str, route: str, headers: dict[str, str], body: bytes, gone: Callable[[], bool]) -> Reply:
        if not self._authorized(headers):
            raise ApiError(401, "invalid API key (send it as Authorization: Bearer <key>)")
        if route == "v1/models" or route.startswith("v1/models/"):
            if method != "GET":
                raise ApiError(405, f"{route} takes GET, not {method}")
            return self._models(urllib.parse.unquote(route.removeprefix("v1/models").strip("/")))
        if route not in ("v1/chat/completions", "v1/completions", "v1/responses"):
            raise ApiError(404, f"no route {method} /{route[:100]}")
        if method != "POST":
            raise ApiError(405, f"/{route} takes POST, not {method}")
        limits = self.service.limits
        if body and not json_depth_ok(body, limits.max_json_depth):
            raise ApiError(400, f"JSON nested deeper than {limits.max_json_depth} levels")
        try:
            req = json.loads(body) if body else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the body is not valid JSON") from None
        if not isinstance(req, dict):
            raise ApiError(400, "the request body must be a JSON object")
        if (bad := lone_surrogate(req)) is not None:
            raise ApiError(400, f"{bad}: a string with a lone surrogate (\\ud800-\\udfff) is not valid Unicode")
        asked = req
        if route == "v1/responses":  # OpenAI's Responses API, sampled as the chat completion it amounts to
            req = responses.to_chat(req)
        model = req.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, "model is required (a served model's name or a checkpoint)")
        sess, renderer = self._session(model)
        engine = sess.model.engine()
        tokenizer = engine.get_tokenizer()
        fmt: ChatFormat | None = None
        if route in ("v1/chat/completions", "v1/responses"):
            fmt = self._format(sess.model.name, tokenizer, renderer)
            plan = chat_plan(req, fmt, limits)
        else:
            plan = completion_plan(req, tokenizer, limits)
        if plan.cost > limits.max_request_tokens:
            raise ApiError(413, f"n x (prompt + max_tokens) = {plan.cost} tokens; runner serve takes at most "
                                f"{limits.max_request_tokens} per request")
        if plan.stream and not plan.logprobs and not plan.echo and plan.params is not None:
            return self._stream(sess, plan, fmt, tokenizer, gone)
        result = self._run(sess, plan, fmt, tokenizer, gone)
        if route == "v1/responses":
            resp = responses.from_chat(asked, result)
            if asked.get("stream"):
                return Reply(200, responses.events(resp), {"content-type": "text/event-stream"})
            return Reply.json(resp)
        if plan.stream:
            return Reply(200, sse(result, plan.include_usage), {"content-type": "text/event-stream"})
        return Reply.json(result)

    def _format(self, name: str, tokenizer: Tokenizer, renderer: str | None) -> ChatFormat:
        if self.hooks is None:
            raise ApiError(400, "this server was started without chat formats: use /v1/completions")
        key = (name, renderer)
        with self._lock:
            fmt = self._formats.get(key)
        if fmt is None:
            fmt = self.hooks.chat(name, tokenizer, renderer)
            with self._lock:
                self._formats[key] = fmt
        return fmt

    def _reserve(self, sess: SamplerSession, plan: Plan, gone: Callable[[], bool]) -> _Share:
        """The request's share of the sampling budget, once it is its turn (ClientGone if its client left first)."""
        svc = self.service
        gen = plan.params.max_tokens if plan.params is not None else 0
        # The request's memory (backends/serve/memory.py), as the Tinker API's sample requests reserve it: over
        # --max-bytes a 413 now; otherwise it waits, in arrival order, with them for tokens and bytes (and after
        # Limits.max_sample_wait_s of waiting on memory only ending sessions free, a 429).
        nbytes = sum(svc._sample_bytes(sess.model, plan.n, len(p), max(gen, 1), plan.echo and plan.logprobs)
                     for p in plan.prompts)
        cap = svc.memory.max_bytes
        if nbytes > cap:
            raise ApiError(413, f"this request needs {fmt_bytes(nbytes)} of sampling memory ({len(plan.prompts)} "
                                f"prompt(s) x n {plan.n}), over runner serve's --max-bytes {fmt_bytes(cap)}: send "
                                "fewer prompts, samples or tokens per request")
        ready, refused = threading.Event(), []

        def fail(why: str) -> None:
            refused.append(why)
            ready.set()

        start = ready.set
        svc.budget.acquire(plan.cost, start, nbytes, fail)
        while not ready.wait(POLL_S):
            if gone() and svc.budget.withdraw(start):
                raise ClientGone
        if refused:
            raise ApiError(429, refused[0])
        return _Share(svc.budget, plan.cost, nbytes)

    def _run(self, sess: SamplerSession, plan: Plan, fmt: ChatFormat | None, tokenizer: Tokenizer,
             gone: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        svc = self.service
        held = self._reserve(sess, plan, gone)
        try:
            try:
                sc = svc.pool.client(sess).result()
            except Exception as exc:  # the checkpoint is gone or does not load
                raise ApiError(404, f"model {plan.model!r} does not load: {str(exc)[:200]}") from None
            topk = _topk_of(sc)
            cancelled = threading.Event()
            outs: list[SampleOutput | None] = [None] * len(plan.prompts)
            if plan.params is not None:
                # Every row checks `cancelled` at each token (backends/local/decoding.py Row.add): a client that
                # hangs up ends its rows at their next token, queued or decoding.
                params = Watched(**_fields(plan.params), watch=lambda i, t, r: not cancelled.is_set())
                futs = [sc.sample(p, plan.n, params) for p in plan.prompts]
                held.after(futs)  # its memory is in use until the sampler is done with every prompt
                _wait(futs, gone, cancelled)
                outs = [_user_result(f) for f in futs]
            try:
                if fmt is not None:
                    out = outs[0]
                    assert out is not None
                    return chat_response(plan, out, fmt, topk)
                prompt_lps = None
                if plan.echo and plan.logprobs:
                    lps = [sc.compute_logprobs(p) for p in plan.prompts]
                    _wait(lps, gone, cancelled)
                    prompt_lps = [_user_result(f) for f in lps]
                return completion_response(plan, outs, tokenizer, topk, prompt_lps)
            finally:
                sess.last_used = time.monotonic()
        finally:
            held.release()

    def _stream(self, sess: SamplerSession, plan: Plan, fmt: ChatFormat | None, tokenizer: Tokenizer,
                gone: Callable[[], bool]) -> Reply:
        """A `stream = true` request whose tokens leave as they are sampled (backends/serve/streaming.py). Whatever
        fails before its first token (a prompt over the context, a checkpoint that does not load) is still an
        error reply; the headers go out with the first token."""
        from backends.serve import streaming

        assert plan.params is not None
        held = self._reserve(sess, plan, gone)
        cancelled = threading.Event()
        try:
            try:
                sc = self.service.pool.client(sess).result()
            except Exception as exc:  # the checkpoint is gone or does not load
                raise ApiError(404, f"model {plan.model!r} does not load: {str(exc)[:200]}") from None
            events: queue.SimpleQueue[tuple[int, int, int | None]] = queue.SimpleQueue()

            def watcher(p: int) -> Callable[[int, int, str | None], bool]:
                def watch(k: int, tok: int, reason: str | None) -> bool:
                    events.put((p, k, tok))
                    return not cancelled.is_set()
                return watch

            futs = [sc.sample(prompt, plan.n, Watched(**_fields(plan.params), watch=watcher(p)))
                    for p, prompt in enumerate(plan.prompts)]
            held.after(futs)
            for p, f in enumerate(futs):
                f.future().add_done_callback(lambda _, p=p: events.put((p, streaming.DONE, None)))
            while True:  # the first event, before any header is sent
                try:
                    first = events.get(timeout=POLL_S)
                    break
                except queue.Empty:
                    if gone():
                        raise ClientGone from None
            if first[1] == streaming.DONE:
                _user_result(futs[first[0]])  # a request refused at once: its 4xx, not a stream
        except BaseException:
            cancelled.set()
            held.release()
            raise
        chat = fmt is not None
        if fmt is not None:
            text_of = streaming.chat_text(fmt)
            own = [len(x) for x in fmt.stop if isinstance(x, str)]
        else:
            text_of, own = streaming.completion_text(tokenizer), []
        holdback = max([0, *(len(x) - 1 for x in plan.user_stop), *(n - 1 for n in own)])
        head = {"id": _new_id("chatcmpl" if chat else "cmpl"), "created": int(time.time()), "model": plan.model,
                "system_fingerprint": None}

        def finish(p: int, out: SampleOutput) -> list[dict[str, Any]]:
            one = streaming.one_prompt(plan, p)
            if fmt is not None:
                choices = chat_response(one, out, fmt)["choices"]
            else:
                choices = completion_response(one, [out], tokenizer)["choices"]
            for c, seq in zip(choices, out.sequences, strict=True):
                c["index"] = p * plan.n + c["index"]
                c["_tokens"] = len(seq.tokens)
            return choices

        def done() -> None:
            sess.last_used = time.monotonic()
            held.release()

        body = streaming.chunks(first, events, futs, plan, head, chat, text_of, holdback, finish, _user_result, gone,
                                cancelled, done)
        return Reply(200, headers={"content-type": "text/event-stream", "cache-control": "no-cache"}, stream=body)

    def _session(self, spec: str) -> tuple[SamplerSession, str | None]:
        from backends.serve.samplers import SamplerSession

        svc = self.service
        run_id = kind = name = ""
        if spec.startswith("tinker://"):
            try:
                run_id, kind, name = svc._parse_path(spec)  # 404 once expired or deleted
            except ApiError as exc:
                raise ApiError(exc.status, exc.detail, exc.code or (MODEL_NOT_FOUND if exc.status == 404 else None)) from None
            if kind == "weights":
                raise ApiError(400, f"{spec} is a training state; sample from its sampler_weights checkpoint")
        with self._lock:
            hit = self._sessions.get(spec)
        if hit is not None:
            return hit
        renderer = None
        if spec in svc.models:
            sess = SamplerSession(f"openai:{next(self._ids)}", svc.models[spec], "openai", None)
        elif spec.startswith("tinker://"):
            meta = svc.store.read_run(run_id)
            if meta is None:
                raise ApiError(404, f"no training run {run_id}", code=MODEL_NOT_FOUND)
            sess = SamplerSession(f"openai:{next(self._ids)}", svc._served(meta["base_model"]), "openai", spec,
                                  source=svc.store.checkpoint_dir(run_id, kind, name))
        else:
            if any(len(part.encode("utf-8", "replace")) > 255 for part in spec.split("/")):
                raise ApiError(400, f"model {spec[:60]!r}... ({len(spec.encode('utf-8', 'replace'))} bytes) is no "
                                    "served model, and a path's parts are at most 255 bytes")
            try:
                local = self.hooks.local_model(spec) if self.hooks is not None else None
            except OSError as exc:  # a name too long for the file system, say
                raise ApiError(400, f"model {spec[:100]!r}: {exc.strerror or type(exc).__name__}") from None
            if local is None:
                raise ApiError(404, f"model {spec[:200]!r} is neither a served model ({', '.join(svc.models)}), "
                                    "a tinker:// sampler checkpoint, nor a run under a folder runner serve was "
                                    "given with --runs", code=MODEL_NOT_FOUND)
            served = self._served_for(local.base_model)
            sid = f"openai:{next(self._ids)}"
            # The checkpoint's files, copied into the server's storage as regular files (backends/serve/files.py):
            # the sampler then reads only what the server owns, and a FIFO or link there is refused now.
            copy = svc.store.ephemeral_dir / sid.replace(":", "-")
            copy_folder(local.path, copy, skip=frozenset({"optimizer.pt"}))
            sess = SamplerSession(sid, served, "openai", spec, source=copy)
            renderer = local.renderer
        with self._lock:
            hit = self._sessions.setdefault(spec, (sess, renderer))
        if hit[0] is sess:
            svc.pool.add(sess)
        elif sess.source is not None and sess.source.is_relative_to(svc.store.ephemeral_dir):
            shutil.rmtree(sess.source, ignore_errors=True)  # a concurrent request's copy won
        return hit

    def _served_for(self, base: str) -> Any:
        svc = self.service
        for m in svc.models.values():
            if base in (m.name, m.path) or _same_dir(base, m.path):
                return m
        raise ApiError(404, f"that checkpoint was trained on {base!r}, which this server does not serve "
                            f"(it serves {', '.join(svc.models)})", code=MODEL_NOT_FOUND)

    def _models(self, one: str) -> Reply:
        svc = self.service
        # `created`: when this server started serving a base model, when a checkpoint was saved (stable across calls).
        names = [(name, self._started) for name in svc.models]
        for run in svc.store.list_runs():
            names += [(c["tinker_path"], _epoch(c.get("time"), self._started))
                      for c in svc.store.list_checkpoints(run["training_run_id"])
                      if c.get("checkpoint_type") == "sampler"]
        rows = [{"id": n, "object": "model", "created": t, "owned_by": "runner"} for n, t in names]
        if one:
            row = next((r for r in rows if r["id"] == one), None)
            if row is None:
                raise ApiError(404, f"no model {one[:200]!r}", code=MODEL_NOT_FOUND)
            return Reply.json(row)
        return Reply.json({"object": "list", "data": rows})


POLL_S = 0.1  # how often a waiting /v1 request looks whether its client hung up


class ClientGone(Exception):
    """The client of a /v1 request hung up: its work was stopped, and no reply is sent."""


def _never() -> bool:
    return False


@dataclass(frozen=True)
class Watched(SamplingParams):
    """SamplingParams with a per-token hook the local sampler calls for each row (backends/local/decoding.py
    Row.add): watch(sample index, token, stop reason or None); False ends the row there."""

    watch: Callable[[int, int, str | None], bool] | None = field(default=None, compare=False)


def _fields(p: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(SamplingParams)}


def _wait(futs: list[Any], gone: Callable[[], bool], cancelled: threading.Event) -> None:
    """Wait for the futures; when the client hangs up meanwhile, end their rows (`cancelled`) and raise ClientGone."""
    inner = [f.future() for f in futs]
    while True:
        _, pending = concurrent.futures.wait(inner, timeout=POLL_S)
        if not pending:
            return
        if gone():
            cancelled.set()
            raise ClientGone


class _Share:
    """A /v1 request's share of the sampling budget: given back once, when the request is done with it and the
    sampler is done with every prompt it was sent (a request whose client left still decodes up to a token)."""

    def __init__(self, budget: Any, cost: int, nbytes: int):
        self.budget, self.cost, self.nbytes = budget, cost, nbytes
        self._lock = threading.Lock()
        self._left = 1  # the request itself, plus each future handed to the sampler
        self._done = False

    def after(self, futs: list[Any]) -> None:
        with self._lock:
            self._left += len(futs)
        for f in futs:
            f.future().add_done_callback(lambda _: self.release())

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left > 0 or self._done:
                return
            self._done = True
        self.budget.release(self.cost, self.nbytes)


def _epoch(iso: Any, default: int) -> int:
    try:
        return int(datetime.datetime.fromisoformat(str(iso).replace("Z", "+00:00")).timestamp())
    except ValueError:
        return default


def _same_dir(a: str, b: str) -> bool:
    try:
        pa, pb = Path(a), Path(b)
        return pa.is_dir() and pb.is_dir() and pa.resolve() == pb.resolve()
    except OSError:
        return False


def _user_result(fut: Any) -> Any:
    """A sampling future's result; a refusal that is the request's own (a prompt that fills the model's context:
    BackendError.user_error, as the Tinker API's futures fail with category `user`) is a 400, not a 500."""
    from backends.base import BackendError

    try:
        return fut.result()
    except BackendError as exc:
        if not exc.user_error:
            raise
        raise ApiError(400, exc.detail) from None


def _topk_of(sc: Any) -> TopK | None:
    model = getattr(sc, "model", None)
    if model is None:
        return None
    from backends.serve.topk import topk_and_own

    def topk(tokens: list[int], k: int, temperature: float, positions: Sequence[int]) -> tuple[Any, Any, Any]:
        return topk_and_own(model, tokens, k, temperature, positions)

    return topk
