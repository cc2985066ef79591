"""OpenAI chat messages over runner's renderers: the `ChatFormat` that backends/serve/chat_api.py renders chat
completions with (`runner serve`'s /v1/chat/completions, and the verifiers env's in-process client). `runner serve`'s
hooks are runner/tools/openai_serve.py.

Tools (`tools` in a request) are declared the way the tool_use env declares them (runner/rl/envs/tool_use.py): in
the renderer's own format where it has one (Qwen3, DeepSeek V3, Kimi K2), else the plain `CALL name {json}` line
convention, whose calls come back as OpenAI `tool_calls` and whose `tool` results go in as `RESULT name: ...` user
messages.
"""

from __future__ import annotations

import json

from backends.tokenizer import Tokenizer
from backends.types import Json
from runner.renderers import get_renderer
from runner.renderers.base import make_tool_call
from runner.renderers.chat import ChatRenderer
from runner.rl.envs.tool_use import TOOL_FORMATS, parse_plain_calls, plain_text_prefix


class RendererChat:
    """backends.serve.chat_api.ChatFormat over a ChatRenderer."""

    def __init__(self, chat: ChatRenderer):
        self.chat = chat
        self.native = chat.renderer.name in TOOL_FORMATS

    @property
    def tokenizer(self) -> Tokenizer:
        return self.chat.tokenizer

    @property
    def stop(self) -> list[str] | list[int]:
        return self.chat.stop

    def prompt(self, messages: list[Json], tools: list[Json] | None) -> list[int]:
        names = {c.get("id"): c.get("function", {}).get("name") for m in messages for c in m.get("tool_calls") or []}
        msgs = [self._message({**m, "name": m.get("name") or names.get(m.get("tool_call_id"))}
                              if m["role"] == "tool" else m) for m in messages]
        if tools:
            system = ""
            if msgs and msgs[0]["role"] == "system":
                system = str(msgs.pop(0)["content"])
            declare = TOOL_FORMATS.get(self.chat.renderer.name) or plain_text_prefix
            msgs = [*declare(tools, system), *msgs]
        return self.chat.build_prompt(msgs)

    def _message(self, m: Json) -> Json:
        if self.native:
            return m
        if m["role"] == "tool":
            return {"role": "user", "content": f"RESULT {m.get('name') or 'tool'}: {m['content']}"}
        if m.get("tool_calls"):
            lines = [f"CALL {c['function']['name']} {c['function'].get('arguments') or '{}'}" for c in m["tool_calls"]]
            return {"role": m["role"], "content": "\n".join([m["content"], *lines]).strip()}
        return {k: v for k, v in m.items() if k in ("role", "content")}

    def reply(self, tokens: list[int]) -> tuple[Json, bool]:
        r = self.chat.parse(tokens)
        msg: Json = {"content": r.text}
        content = r.message.get("content")
        if isinstance(content, list):
            thinking = "".join(p.get("thinking", "") for p in content if p.get("type") == "thinking")
            if thinking:
                msg["reasoning_content"] = thinking
        if self.native:
            calls = [{**c, "id": c.get("id") or f"call_{i}"} for i, c in enumerate(r.message.get("tool_calls", []))]
        else:
            found, _ = parse_plain_calls(r.text)
            calls = [make_tool_call(c.name, json.dumps(c.arguments), c.call_id) for c in found]
        if calls:
            msg["tool_calls"] = calls
        return msg, r.ended_on_stop


def chat_format(model_name: str, tokenizer: Tokenizer, renderer: str = "auto") -> RendererChat:
    return RendererChat(ChatRenderer(get_renderer(renderer, tokenizer, model_name=model_name)))
