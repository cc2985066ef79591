"""Qwen3's ChatML format: qwen3 (thinking; reasoning dropped from history as the HF template does),
qwen3_disable_thinking (the prompt closes an empty think block), qwen3_instruct (2507 models: no think block)."""

from __future__ import annotations

import json

from backends.errors import UserError
from runner.renderers.base import (
    Message,
    Part,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    Tokenizer,
    content_tokenizer,
    has_thinking,
    parse_content_blocks,
    parse_for_stop_token,
    register,
    remove_thinking,
    split_tool_results,
    tool_call_payload,
    unterminated_block,
)


def _frame(reasoning: str) -> str:
    # The template writes "<think>\n{reasoning}\n</think>\n\n" around the produced turn, even when empty.
    return "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"


def _unframe(parts: list[Part]) -> list[Part]:
    """Undo `_frame` so render -> parse is the identity (an empty block is a turn that did not reason)."""
    out: list[Part] = []
    after_block = False
    for p in parts:
        if p["type"] == "thinking":
            reasoning = p["thinking"].strip("\n")
            if reasoning:
                out.append({"type": "thinking", "thinking": reasoning})
            after_block = True
        elif p["type"] == "text":
            out.append({"type": "text", "text": p["text"].lstrip("\n") if after_block else p["text"]})
            after_block = False
        else:
            out.append(p)
            after_block = False
    return out


@register("qwen3")
class Qwen3Renderer(Renderer):
    required_tokens = ("<|im_start|>", "<|im_end|>")
    end_text = "<|im_end|>"
    end_family = "ChatML"

    frames_thinking = True  # the 2507 instruct models use no think tag at all

    def __init__(self, tokenizer: Tokenizer, strip_thinking_from_history: bool = True):
        super().__init__(tokenizer)
        self.strip_thinking_from_history = strip_thinking_from_history
        self._content = content_tokenizer(tokenizer)

    @property
    def has_extension_property(self) -> bool:
        return not self.strip_thinking_from_history

    def _frames_produced_turn(self, message: Message, ctx: RenderContext) -> bool:
        # The template frames only turns after the last user message (none when there is no user message).
        if not self.frames_thinking or message["role"] != "assistant" or ctx.last_user_index < 0:
            return False
        return ctx.is_last or not self.strip_thinking_from_history

    def _encode_content(self, text: str) -> list[int]:
        if self._content is None:
            return self.encode(text)
        return list(self._content.encode(text, add_special_tokens=False).ids)

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        role = "user" if message["role"] == "tool" else message["role"]
        header = self.encode(("\n" if ctx.idx > 0 else "") + f"<|im_start|>{role}\n")
        content = message["content"]
        frames = self._frames_produced_turn(message, ctx)
        reasoned = has_thinking(content)
        if isinstance(content, list):
            parts = content
            if self.strip_thinking_from_history and message["role"] == "assistant" and not ctx.is_last:
                parts = remove_thinking(parts)
            pieces: list[str] = []
            after_block = False
            for p in parts:
                if p["type"] == "thinking":
                    pieces.append(_frame(p["thinking"]) if frames else f"<think>{p['thinking']}</think>")
                    after_block = frames
                elif p["type"] == "text":
                    pieces.append(p["text"].lstrip("\n") if after_block else p["text"])
                    after_block = False
                else:
                    raise UserError(f"renderer {self.name!r} takes text and thinking parts; got {p['type']!r}")
            text = "".join(pieces)
        elif frames and "</think>" in content:
            reasoning, _, rest = content.partition("</think>")
            text = _frame(reasoning.rpartition("<think>")[2]) + rest.lstrip("\n")
        else:
            text = content
        has_text = bool(text)
        if frames and not reasoned:
            text = _frame("") + text.lstrip("\n")
        if message["role"] == "tool":
            text = f"<tool_response>\n{text}\n</tool_response>"
        if "tool_calls" in message:
            calls = "\n".join(f"<tool_call>\n{json.dumps(tool_call_payload(c))}\n</tool_call>"
                              for c in message["tool_calls"])
            text += ("\n" if has_text else "") + calls
        return Rendered(output=[self._encode_content(text), [self.end_token]], header=header)

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        message, termination = parse_for_stop_token(response, self.tokenizer, self.end_token)
        if not termination.is_clean:
            return message, termination
        content = message["content"]
        found = parse_content_blocks(content)
        if found is not None:
            parts, calls = found
            message["content"] = _unframe(parts) if self.frames_thinking else parts
            split_tool_results(message, calls)
        dangling = unterminated_block(content, "<tool_call>", "</tool_call>")
        if dangling is not None:
            message["unparsed_tool_calls"] = [*message.get("unparsed_tool_calls", []), dangling]
        return message, termination


@register("qwen3_disable_thinking")
class Qwen3DisableThinkingRenderer(Qwen3Renderer):
    disables_thinking = True

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        if message["role"] == "assistant" and ctx.is_last and message.get("content") and ctx.last_user_index < 0:
            raise UserError("a conversation without a user message gets no empty think block from Qwen3's "
                            "template, but the qwen3_disable_thinking prompt always closes one; add a user "
                            "message or use renderer = \"qwen3\"")
        return super().render_message(message, ctx)

    def generation_suffix(self, role: str, ctx: RenderContext) -> list[int]:
        return self.encode(("\n" if ctx.idx > 0 else "") + f"<|im_start|>{role}\n<think>\n\n</think>\n\n")


@register("qwen3_instruct")
class Qwen3InstructRenderer(Qwen3Renderer):
    frames_thinking = False

    @property
    def has_extension_property(self) -> bool:
        return True
