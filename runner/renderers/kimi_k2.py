"""kimi_k2: Moonshot's Kimi K2 Thinking format. `<|im_user|>user<|im_middle|>...<|im_end|>`; a default system
message when none is given; reasoning kept only in the turn being produced (earlier turns get an empty block)."""

from __future__ import annotations

import json
import re

from backends.types import Json
from runner.renderers.base import (
    Message,
    Part,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    Tokenizer,
    ensure_text,
    make_tool_call,
    parse_for_stop_token,
    parse_think_blocks,
    register,
    tool_call_arguments,
    unterminated_block,
)

DEFAULT_SYSTEM_PROMPT = "You are Kimi, an AI assistant created by Moonshot AI."
_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>"
                      r"|<\|tool_call_section_begin\|>(.*?)<\|tool_call_section_end\|>", re.DOTALL)
_CALL = re.compile(r"<\|tool_call_begin\|>\s*([^<]+:\d+)\s*<\|tool_call_argument_begin\|>\s*(.*?)\s*"
                   r"<\|tool_call_end\|>", re.DOTALL)
_HEADERS = {"user": "<|im_user|>", "assistant": "<|im_assistant|>"}


@register("kimi_k2")
class KimiK2Renderer(Renderer):
    required_tokens = ("<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>")
    end_text = "<|im_end|>"
    end_family = "Kimi's"

    def __init__(self, tokenizer: Tokenizer, strip_thinking_from_history: bool = True):
        super().__init__(tokenizer)
        self.strip_thinking_from_history = strip_thinking_from_history

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))  # as Kimi's renderer does (its tokenizer adds nothing)

    def with_defaults(self, messages: list[Message]) -> list[Message]:
        system = {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
        if not messages:
            return [system]
        if messages[0]["role"] == "tool_declare":
            return messages if len(messages) >= 2 and messages[1]["role"] == "system" else \
                [messages[0], system, *messages[1:]]
        return messages if messages[0]["role"] == "system" else [system, *messages]

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        role = message["role"]
        if role == "tool":
            header = f"<|im_system|>{message.get('name') or role}<|im_middle|>"
            header += f"## Return of {message.get('tool_call_id', '')}\n"
        else:
            header = f"{_HEADERS.get(role, '<|im_system|>')}{role}<|im_middle|>"
        content = message["content"]
        if role == "assistant":
            parts: list[Part] = [{"type": "text", "text": content}] if isinstance(content, str) else content
            thinking = "".join(p["thinking"] for p in parts if p["type"] == "thinking")
            text = "".join(p["text"] for p in parts if p["type"] == "text")
            keep = ctx.in_last_assistant_turn or not self.strip_thinking_from_history
            out = (f"<think>{thinking}</think>" if keep and thinking else "<think></think>") + text
            if message.get("tool_calls"):
                out += "<|tool_calls_section_begin|>"
                for i, call in enumerate(message["tool_calls"]):
                    call_id = call.get("id") or f"functions.{call.get('function', call)['name']}:{i}"
                    out += (f"<|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{tool_call_arguments(call)}"
                            f"<|tool_call_end|>")
                out += "<|tool_calls_section_end|>"
            out += "<|im_end|>"
        else:
            out = ensure_text(content) + "<|im_end|>"
        return Rendered(header=self.encode(header), output=[self.encode(out)])

    def last_turn_start(self, messages: list[Message]) -> int:
        # The turn starts after the last assistant message that did not call a tool.
        for idx in range(len(messages) - 1, -1, -1):
            if messages[idx]["role"] == "assistant" and not messages[idx].get("tool_calls"):
                return idx + 1
        return 0

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        message, termination = parse_for_stop_token(response, self.tokenizer, self.end_token)
        if not termination.is_clean:
            return message, termination
        content: str = message["content"]
        text = content
        section = _SECTION.search(content)
        if section:
            text = content[: section.start()]
            calls: list[Json] = []
            unparsed: list[Json] = []
            for m in _CALL.finditer(section.group(1) if section.group(1) is not None else section.group(2)):
                call_id, args = m.group(1).strip(), m.group(2).strip()
                name = call_id.split(":", 1)[0]
                name = name.split(".", 1)[1] if "." in name else name
                try:
                    json.loads(args)
                    calls.append(make_tool_call(name, args, call_id or None))
                except json.JSONDecodeError as e:
                    unparsed.append({"raw_text": m.group(0), "error": f"Invalid JSON: {e}"})
            if calls:
                message["tool_calls"] = calls
            if unparsed:
                message["unparsed_tool_calls"] = unparsed
        for opener, closer in (("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
                               ("<|tool_call_section_begin|>", "<|tool_call_section_end|>"),
                               ("<|tool_call_begin|>", "<|tool_call_end|>")):
            dangling = unterminated_block(content, opener, closer)
            if dangling is not None:
                message["unparsed_tool_calls"] = [*message.get("unparsed_tool_calls", []), dangling]
                break
        parts = parse_think_blocks(text)
        message["content"] = parts if parts is not None else text
        return message, termination
