"""hf: the tokenizer's own Hugging Face chat template (what a chat model's serving stack applies). Weights come
from the template's prefixes (runner/renderers/chat_template.py); stops are the eos and the usual turn-end tokens."""

from __future__ import annotations

from backends.errors import UserError
from backends.tokenizer import eos_token_id
from runner.renderers import chat_template
from runner.renderers.base import (
    Message,
    RenderContext,
    Rendered,
    Renderer,
    Termination,
    Tokenizer,
    parse_train_on_what,
    register,
)

# Turn terminators chat templates use besides the tokenizer's eos (Qwen's eos is <|endoftext|> for base
# models, while its chat turns end on <|im_end|>).
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


@register("hf")
class HFTemplateRenderer(Renderer):
    def __init__(self, tokenizer: Tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("the tokenizer has no chat template; set renderer = \"role_colon\" (a base model) or "
                            "the model family's renderer")
        super().__init__(tokenizer)
        stops: list[int] = []
        vocab = tokenizer.get_vocab()
        for tid in [eos_token_id(tokenizer)] + [vocab.get(t) for t in TURN_ENDS]:
            if tid is not None and tid not in stops:
                stops.append(tid)
        if not stops:
            raise UserError("the tokenizer has no eos token; renderer \"hf\" needs one to end replies")
        self.stop_tokens = stops

    @property
    def has_extension_property(self) -> bool:
        return True  # as far as the template allows: ChatRenderer.extend checks the text

    def render_message(self, message: Message, ctx: RenderContext) -> Rendered:
        raise NotImplementedError("the hf renderer renders whole conversations")

    def template_text(self, messages: list[Message], generation_prompt: bool = True) -> str:
        return chat_template.template(self.tokenizer, messages, generation_prompt)

    def build_generation_prompt(self, messages: list[Message], role: str = "assistant",
                                prefill: str | None = None) -> list[int]:
        if role != "assistant":
            raise UserError("renderer \"hf\" builds prompts for the assistant only")
        tokens = chat_template.encode(self.tokenizer, self.template_text(messages))
        return tokens + (self.encode(prefill) if prefill else [])

    def build_supervised_example(self, messages: list[Message],
                                 train_on_what: str = "last_assistant_message") -> tuple[list[int], list[float]]:
        what = parse_train_on_what(str(train_on_what))
        return chat_template.render(self.tokenizer, messages, what.value)

    def get_stop_sequences(self) -> list[int]:
        return list(self.stop_tokens)

    def parse_response(self, response: list[int]) -> tuple[Message, Termination]:
        """The reply text without its stop token; other special tokens are dropped from the text."""
        ended = bool(response) and response[-1] in self.stop_tokens
        body = response[:-1] if ended else response
        text = str(self.tokenizer.decode(body, skip_special_tokens=True))
        return {"role": "assistant", "content": text}, Termination.STOP_SEQUENCE if ended else Termination.MALFORMED
