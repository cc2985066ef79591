"""role_colon: "User: ...\\n\\nAssistant: ...\\n\\n", for base models (no special tokens); stops on "\\n\\nUser:"."""

from __future__ import annotations

from backends.tokenizer import eos_token_id
from runner.renderers.base import Message, RenderContext, Rendered, Renderer, Termination, ensure_text, register

_PREFIX = " "
_SUFFIX = "\n\n"


@register("role_colon")
class RoleColonRenderer(Renderer):
    @property
    def has_extension_property(self) -> bool:
        return True

    @property
    def bos_tokens(self) -> list[int]:
        bos = self.tokenizer.bos_token
        return self.encode(bos) if isinstance(bos, str) else []

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        header = self.encode(message["role"].capitalize() + ":")
        output = self.encode(_PREFIX + ensure_text(message["content"]) + _SUFFIX)
        # The stop sequence "\n\nUser:" ends in the next header; after the last message its "User:" is trained.
        overlap = self.encode("User:" if message["role"] == "assistant" else "<UNUSED>")
        return Rendered(output=[output], header=header, stop_overlap=overlap)

    def get_stop_sequences(self) -> list[str]:
        return ["\n\nUser:"]

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        eos = eos_token_id(self.tokenizer)
        with_eos = eos is not None and bool(response) and response[-1] == eos
        if with_eos:
            response = response[:-1]
        text = self.decode(response)
        pieces = text.split("\n\nUser:")
        message = {"role": "assistant", "content": pieces[0].removeprefix(_PREFIX).removesuffix(_SUFFIX)}
        if len(pieces) == 1:
            return message, Termination.EOS if with_eos else Termination.MALFORMED
        if len(pieces) == 2 and not with_eos:
            return message, Termination.STOP_SEQUENCE
        # "\n\nUser:" then EOS (sampling should have stopped), or several delimiters.
        return message, Termination.MALFORMED
