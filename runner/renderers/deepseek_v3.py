"""DeepSeek V3.1: deepseekv3 (= deepseekv3_disable_thinking: "</think>" closes the header) and
deepseekv3_thinking (the prompt opens "<think>"; reasoning dropped from history as the HF template does)."""

from __future__ import annotations

import json
import re

from backends.errors import UserError
from backends.types import Json
from runner.renderers.base import (
    Message,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    Tokenizer,
    add_renderer,
    ensure_text,
    has_thinking,
    make_tool_call,
    parse_for_stop_token,
    parse_think_blocks,
    register,
    tool_call_arguments,
    unterminated_block,
)

_BAR = chr(65372)  # "｜", DeepSeek's fullwidth bar
_CALLS = re.compile(r"<｜tool▁calls▁begin｜>(.*?)<｜tool▁calls▁end｜>", re.DOTALL)
_CALL = re.compile(r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)


class _DeepSeekV3Base(Renderer):
    required_tokens = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
    end_text = "<｜end▁of▁sentence｜>"
    end_family = "a DeepSeek V3 tokenizer"

    def __init__(self, tokenizer: Tokenizer, system_role_as_user: bool = False, strip_thinking_from_history: bool = True):
        super().__init__(tokenizer)
        self.system_role_as_user = system_role_as_user
        self.strip_thinking_from_history = strip_thinking_from_history

    @property
    def has_extension_property(self) -> bool:
        return not self.strip_thinking_from_history

    def special(self, name: str) -> int:
        return self.single_token(f"<{_BAR}{name}{_BAR}>", "a DeepSeek V3 tokenizer")

    @property
    def bos_tokens(self) -> list[int]:
        return [self.special("begin▁of▁sentence")]

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        follows_tool = ctx.prev_message is not None and ctx.prev_message["role"] == "tool"
        content = message["content"]
        role = message["role"]
        header: list[int]
        if role == "system":
            text = ensure_text(content)
            if ctx.idx == 0:
                header = []
            elif self.system_role_as_user:
                header = [self.special("User")]
            else:
                raise UserError("DeepSeek's format takes a system message only as the first message")
        elif role == "user":
            header, text = [self.special("User")], ensure_text(content)
        elif role == "assistant":
            strip = self.strip_thinking_from_history and not message.get("tool_calls") and not ctx.is_last
            if isinstance(content, list):
                text = "".join("" if p["type"] == "thinking" and strip else
                               f"<think>{p['thinking']}</think>" if p["type"] == "thinking" else p["text"]
                               for p in content if p["type"] in ("thinking", "text"))
            else:
                text = content
            header = [] if follows_tool else [self.special("Assistant")]
        elif role == "tool":
            header = self.encode("<｜tool▁output▁begin｜>")
            text = ensure_text(content) + "<｜tool▁output▁end｜>"
        else:
            raise UserError(f"DeepSeek's format has no role {role!r}")
        if message.get("tool_calls"):
            text += "<｜tool▁calls▁begin｜>"
            for call in message["tool_calls"]:
                fn = call.get("function", call)
                text += f"<｜tool▁call▁begin｜>{fn['name']}<｜tool▁sep｜>{tool_call_arguments(call)}<｜tool▁call▁end｜>"
            text += "<｜tool▁calls▁end｜>"
        output = self.encode(text)
        if role == "assistant" and message["content"]:
            output.append(self.end_token)
        return Rendered(output=[output], header=header)

    def normalize_response(self, response: list[int]) -> list[int]:
        return response

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        message, termination = parse_for_stop_token(self.normalize_response(response), self.tokenizer,
                                                    self.end_token)
        if not termination.is_clean:
            return message, termination
        content: str = message["content"]
        calls: list[Json] = []
        unparsed: list[Json] = []
        block = _CALLS.search(content)
        if block:
            for m in _CALL.finditer(block.group(1)):
                args = m.group(2).strip()
                try:
                    json.loads(args)
                    calls.append(make_tool_call(m.group(1), args))
                except json.JSONDecodeError as e:
                    unparsed.append({"raw_text": m.group(0), "error": f"Invalid JSON: {e}"})
        for opener, closer in (("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
                               ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")):
            dangling = unterminated_block(content, opener, closer)
            if dangling is not None:
                unparsed.append(dangling)
                break
        if calls:
            message["tool_calls"] = calls
        if unparsed:
            message["unparsed_tool_calls"] = unparsed
        if calls or unparsed:
            content = re.sub(r"\s*<｜tool▁calls▁begin｜>.*?<｜tool▁calls▁end｜>", "", content, flags=re.DOTALL).strip()
        parts = parse_think_blocks(content)
        message["content"] = parts if parts is not None else content
        return message, termination


@register("deepseekv3_thinking")
class DeepSeekV3ThinkingRenderer(_DeepSeekV3Base):
    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        rendered = super().render_message(message, ctx)
        follows_tool = ctx.prev_message is not None and ctx.prev_message["role"] == "tool"
        content = message.get("content", "")
        assistant_turn = message["role"] == "assistant" and not follows_tool
        if assistant_turn and self.strip_thinking_from_history and not ctx.is_last:
            return Rendered(output=rendered.output, header=rendered.header + self.encode("</think>"))
        if assistant_turn and ctx.is_last and content and not has_thinking(content):
            first, *rest = rendered.output
            return Rendered(output=[self.encode("<think></think>") + first, *rest], header=rendered.header)
        return rendered

    def build_generation_prompt(self, messages: list[Message], role: str = "assistant",
                                prefill: str | None = None) -> list[int]:
        if messages and messages[-1]["role"] == "tool":  # tool use stays in non-thinking mode
            return super().build_generation_prompt(messages, role, prefill)
        return super().build_generation_prompt(messages, role, "<think>" + (prefill or ""))

    def normalize_response(self, response: list[int]) -> list[int]:
        # The prompt prefilled "<think>": put it back when the reply closes a block.
        think, end_think = (self.tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
        if isinstance(think, int) and not (response and response[0] == think) and end_think in response:
            return [think, *response]
        return response


@register("deepseekv3")
class DeepSeekV3DisableThinkingRenderer(_DeepSeekV3Base):
    @property
    def has_extension_property(self) -> bool:
        return True

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        follows_tool = ctx.prev_message is not None and ctx.prev_message["role"] == "tool"
        if message["role"] == "assistant" and not follows_tool:
            content = message["content"]
            if isinstance(content, list):
                text = "".join(p["text"] for p in content if p["type"] == "text")
            else:
                text = re.sub(r"<think>.*?</think>", "", content, flags=re.DOTALL)
            message = {**message, "content": text}
        rendered = super().render_message(message, ctx)
        if message["role"] == "assistant" and not follows_tool:
            return Rendered(output=rendered.output, header=rendered.header + self.encode("</think>"))
        return rendered


add_renderer("deepseekv3_disable_thinking", DeepSeekV3DisableThinkingRenderer)
