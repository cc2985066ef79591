"""llama3: Llama 3 Instruct's format (without the stock template's "Cutting Knowledge Date" system preamble)."""

from __future__ import annotations

from runner.renderers.base import (
    Message,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    ensure_text,
    parse_for_stop_token,
    register,
)


@register("llama3")
class Llama3Renderer(Renderer):
    required_tokens = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    end_text = "<|eot_id|>"
    end_family = "a Llama 3 tokenizer"

    @property
    def has_extension_property(self) -> bool:
        return True

    @property
    def bos_tokens(self) -> list[int]:
        return self.encode("<|begin_of_text|>")

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        header = self.encode(f"<|start_header_id|>{message['role']}<|end_header_id|>\n\n")
        output = self.encode(ensure_text(message["content"]) + "<|eot_id|>")
        return Rendered(output=[output], header=header)

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        return parse_for_stop_token(response, self.tokenizer, self.end_token)
