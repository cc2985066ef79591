"""llama3: Llama 3 Instruct's format (without the stock template's "Cutting Knowledge Date" system preamble)."""

from __future__ import annotations

from backends.errors import UserError
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

    @property
    def end_token(self) -> int:
        ids = self.encode("<|eot_id|>")
        if len(ids) != 1:
            raise UserError("renderer 'llama3' needs a tokenizer with <|eot_id|> as one token (a Llama 3 tokenizer)")
        return ids[0]

    def get_stop_sequences(self) -> list[int]:
        return [self.end_token]

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        return parse_for_stop_token(response, self.tokenizer, self.end_token)
