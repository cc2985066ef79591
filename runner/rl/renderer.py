"""Chat messages <-> tokens for environments, over any transformers tokenizer with a chat template.

Envs speak in messages; the sampler speaks in tokens. `ChatRenderer` builds the generation prompt with the
tokenizer's own chat template (so a Tinker model gets its real format), names the stop tokens, and parses
a sampled reply. Multi-turn envs keep their message list and re-render it every turn: with ChatML-style
templates the new prompt then starts with the old prompt plus the sampled reply, which lets datums.py merge
the turns into one sequence (and it falls back to one datum per turn when a template breaks that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from runner.errors import UserError

Message = dict[str, str]  # {"role": ..., "content": ...}

# Turn terminators that chat templates use besides the tokenizer's eos (Qwen's eos is <|endoftext|>
# for base models, while its chat turns end on <|im_end|>).
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


@dataclass(frozen=True)
class ParsedReply:
    text: str
    # The reply ended on a stop token (not cut off by max_tokens).
    ended_on_stop: bool


class ChatRenderer:
    def __init__(self, tokenizer: Any):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("the tokenizer has no chat template; RL environments need one to build prompts")
        self.tokenizer = tokenizer
        stops: list[int] = []
        candidates = [tokenizer.eos_token_id] + [_token_id(tokenizer, t) for t in _TURN_ENDS]
        for tid in candidates:
            if tid is not None and tid not in stops:
                stops.append(tid)
        if not stops:
            raise UserError("the tokenizer has no eos token; RL environments need one to end replies")
        self.stop_tokens: list[int] = stops

    def build_prompt(self, messages: list[Message]) -> list[int]:
        """Tokens of the conversation followed by the assistant header the model continues from."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        # The template already wrote any BOS/special tokens as text; don't let encode add them again.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def parse(self, tokens: list[int]) -> ParsedReply:
        """The reply text without its stop token; other special tokens are dropped from the text."""
        ended = bool(tokens) and tokens[-1] in self.stop_tokens
        body = tokens[:-1] if ended else tokens
        return ParsedReply(self.tokenizer.decode(body, skip_special_tokens=True), ended)

    def decode(self, tokens: list[int]) -> str:
        """Everything, special tokens included (for transcripts)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def _token_id(tokenizer: Any, token: str) -> int | None:
    # convert_tokens_to_ids returns the unk id (or None) for a string that is not one token.
    if token not in tokenizer.get_vocab():
        return None
    return tokenizer.convert_tokens_to_ids(token)
