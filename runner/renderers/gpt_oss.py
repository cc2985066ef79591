"""gpt_oss_*: OpenAI's Harmony format for gpt-oss. `<|start|>role<|channel|>...<|message|>content<|end|>`;
reasoning goes to the analysis channel, the answer to final, tool calls to commentary. The *_reasoning variants
prepend OpenAI's system prompt with the date and reasoning effort; gpt_oss_no_sysprompt does not."""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime

from backends.errors import UserError
from backends.types import Json
from runner.renderers.base import (
    Message,
    Part,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    Tokenizer,
    add_renderer,
    ensure_text,
    make_tool_call,
    tool_call_arguments,
)

_SYSTEM_PROMPT = ("You are ChatGPT, a large language model trained by OpenAI.\n"
                  "Knowledge cutoff: 2024-06\n"
                  "Current date: {current_date}\n\n"
                  "Reasoning: {reasoning_effort}\n\n"
                  "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
_INTERNAL_SYSTEM = "_gptoss_internal_system"  # rendered as "system" (a user's system message is "developer")
_END_TOKENS = ("<|end|>", "<|call|>", "<|return|>")


class GptOssRenderer(Renderer):
    required_tokens = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>")

    def __init__(self, tokenizer: Tokenizer, use_system_prompt: bool = False, reasoning_effort: str | None = None,
                 current_date: str | None = None):
        super().__init__(tokenizer)
        if use_system_prompt != (reasoning_effort is not None):
            raise ValueError("reasoning effort is set exactly when the system prompt is used")
        self.use_system_prompt = use_system_prompt
        self.reasoning_effort = reasoning_effort
        self.current_date = current_date  # None: today's date (fix it for reproducible tokens)

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        role = message["role"]
        if role == "tool":
            name = message.get("name") or "unknown"
            if not name.startswith("functions."):
                name = f"functions.{name}"
            return Rendered(header=self.encode(f"<|start|>{name} to=assistant"),
                            output=[self.encode(f"<|channel|>commentary<|message|>"
                                                f"{ensure_text(message['content'])}<|end|>")])
        wire_role = "system" if role == _INTERNAL_SYSTEM else "developer" if role == "system" else role
        out = ""
        calls: list[Json] = []
        if role == "assistant":
            content = message["content"]
            parts: list[Part] = [{"type": "text", "text": content}] if isinstance(content, str) else content
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            thinking = "".join(p["thinking"] for p in parts if p["type"] == "thinking")
            calls = message.get("tool_calls") or []
            if thinking:
                out += f"<|channel|>analysis<|message|>{thinking}<|end|><|start|>assistant"
            if calls:
                if text:
                    out += f"<|channel|>commentary<|message|>{text}<|end|><|start|>assistant"
                out += "<|start|>assistant".join(
                    f" to=functions.{c.get('function', c)['name']}<|channel|>commentary <|constrain|>json"
                    f"<|message|>{tool_call_arguments(c)}<|call|>" for c in calls)
            else:
                out += f"<|channel|>final<|message|>{text}"
                out += "<|return|>" if ctx.is_last else "<|end|>"
        elif role == "system":
            out += f"<|message|># Instructions\n\n{ensure_text(message['content'])}\n\n<|end|>"
        else:
            out += f"<|message|>{ensure_text(message['content'])}<|end|>"
        return Rendered(header=self.encode(f"<|start|>{wire_role}"), output=[self.encode(out)])

    def with_defaults(self, messages: list[Message]) -> list[Message]:
        if not self.use_system_prompt:
            return messages
        date = self.current_date if self.current_date is not None else datetime.now().strftime("%Y-%m-%d")
        system = {"role": _INTERNAL_SYSTEM,
                  "content": _SYSTEM_PROMPT.format(current_date=date, reasoning_effort=self.reasoning_effort)}
        return [system, *messages]

    def _single(self, text: str) -> int:
        return self.single_token(text, "gpt-oss's")

    def get_stop_sequences(self) -> list[int]:
        return [self._single("<|return|>"), self._single("<|call|>")]

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        ret, call = self.get_stop_sequences()
        n_call, n_ret = response.count(call), response.count(ret)
        if n_call == 0 and n_ret == 0:
            return {"role": "assistant", "content": self.decode(response)}, Termination.MALFORMED
        if n_call > 1 or n_ret > 1:
            raise UserError("a sampled reply holds several stop tokens; sample with the renderer's stop sequences")
        stop = response.index(ret) if n_ret else len(response)
        if n_call:
            stop = min(stop, response.index(call))
        text = self.decode(response[:stop])
        parts, calls, unparsed = _parse_harmony(text)
        if text.count("to=functions.") > len(calls) + len(unparsed):
            start = text.rfind("<|start|>")
            unparsed.append({"raw_text": text[start:] if start != -1 else text,
                             "error": "unterminated tool block: a 'to=functions.' header without arguments"})
        message: Message = {"role": "assistant", "content": parts if parts else text}
        if calls:
            message["tool_calls"] = calls
        if unparsed:
            message["unparsed_tool_calls"] = unparsed
        return message, Termination.STOP_SEQUENCE


def _parse_harmony(content: str) -> tuple[list[Part], list[Json], list[Json]]:
    parts: list[Part] = []
    calls: list[Json] = []
    unparsed: list[Json] = []
    for msg in _harmony_messages(content):
        body = msg["content"] or ""
        if not body.strip():
            continue
        recipient = msg["recipient"]
        if recipient and recipient.startswith("functions."):
            try:
                json.loads(body)
                calls.append(make_tool_call(recipient.split("functions.", 1)[1], body.strip()))
            except json.JSONDecodeError as e:
                unparsed.append({"raw_text": msg["raw_text"] or "", "error": f"Invalid JSON: {e}"})
            continue
        if msg["channel"] == "analysis":
            parts.append({"type": "thinking", "thinking": body})
        elif msg["channel"] in ("final", "commentary"):
            parts.append({"type": "text", "text": body})
    return parts, calls, unparsed


def _harmony_messages(content: str) -> list[dict[str, str | None]]:
    out: list[dict[str, str | None]] = []
    idx = 0
    while (at := content.find("<|message|>", idx)) != -1:
        head_start = content.rfind("<|start|>", idx, at)
        if head_start == -1:
            head_start = idx
        header = content[head_start:at]
        body_start = at + len("<|message|>")
        end, end_token = len(content), ""
        for token in _END_TOKENS:
            found = content.find(token, body_start)
            if found != -1 and found < end:
                end, end_token = found, token
        channel = re.search(r"<\|channel\|>([^<\s]+)", header)
        recipient = re.search(r"to=([^\s<]+)", header)
        out.append({"channel": channel.group(1) if channel else None,
                    "recipient": recipient.group(1) if recipient else None,
                    "content": content[body_start:end],
                    "raw_text": content[head_start : end + len(end_token)] if end_token else content[head_start:]})
        idx = end + len(end_token)
    return out


# Registered as the class (partials of it): `runner check` reads required_tokens off the factory.
add_renderer("gpt_oss_no_sysprompt", GptOssRenderer)
for _effort in ("low", "medium", "high"):
    add_renderer(f"gpt_oss_{_effort}_reasoning",
                 functools.partial(GptOssRenderer, use_system_prompt=True, reasoning_effort=_effort))
