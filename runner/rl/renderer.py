"""Chat messages <-> tokens for environments, over any transformers tokenizer with a chat template.

Envs speak in messages; the sampler speaks in tokens. `ChatRenderer` builds the generation prompt with the
tokenizer's own chat template (so a Tinker model gets its real format), names the stop tokens, and parses
a sampled reply. Multi-turn envs keep their message list and re-render it every turn: with ChatML-style
templates the new prompt then starts with the old prompt plus the sampled reply, which lets datums.py merge
the turns into one sequence (and it falls back to one datum per turn when a template breaks that).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from backends.errors import UserError

Message = dict[str, str]  # {"role": ..., "content": ...}

_RENDER_CACHE = 4096  # conversations whose rendering is kept

# Turn terminators that chat templates use besides the tokenizer's eos (Qwen's eos is <|endoftext|>
# for base models, while its chat turns end on <|im_end|>).
_TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|end|>")


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    # The chat template's text for these tokens (what the next turn's rendering must start with).
    text: str


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
        # Recent renderings: every env of a group renders the same first prompt (8x per problem in rl_basic),
        # and template + encode is ~0.3 ms of main-thread time each, on the path that feeds the sampler.
        self._renders: OrderedDict[tuple[Any, ...], tuple[tuple[int, ...], str]] = OrderedDict()

    def build_prompt(self, messages: list[Message]) -> list[int]:
        """Tokens of the conversation followed by the assistant header the model continues from."""
        return self.render(messages).tokens

    def render(self, messages: list[Message]) -> Prompt:
        key = tuple(tuple(sorted(m.items())) for m in messages)
        try:
            hit = self._renders.get(key)
        except TypeError:  # a message with unhashable content (e.g. a list of parts): not cached
            key, hit = None, None
        if hit is None:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # The template already wrote any BOS/special tokens as text; don't let encode add them again.
            hit = (tuple(self.tokenizer.encode(text, add_special_tokens=False)), text)
            if key is not None:
                self._renders[key] = hit
                if len(self._renders) > _RENDER_CACHE:
                    self._renders.popitem(last=False)
        elif key is not None:
            self._renders.move_to_end(key)
        return Prompt(list(hit[0]), hit[1])

    def extend(self, prev: Prompt, action_tokens: list[int], reply: ParsedReply, messages: list[Message]) -> Prompt:
        """The prompt for `messages` (which continue prev's conversation with the reply and what came after)
        built as prev.tokens + the sampled tokens + the new text, so the model sees its own tokens again.

        Decoding and re-encoding a reply is not always the identity (a byte-level model can sample invalid
        UTF-8; BPE can merge differently), and when it isn't, the turns no longer extend each other and
        every turn becomes its own datum. Falls back to a full re-render when the template's text does not
        continue prev's text with the reply (e.g. a template that drops earlier reasoning)."""
        full = self.render(messages)
        head = prev.text + reply.text
        if not full.text.startswith(head):
            return full
        rest = full.text[len(head) :]
        if reply.ended_on_stop:
            # The sampled stop token stands for the template's end-of-turn text, if that is what follows.
            stop_text = self.tokenizer.decode(action_tokens[-1:], skip_special_tokens=False)
            if not rest.startswith(stop_text):
                return full
            rest = rest[len(stop_text) :]
        tokens = [*prev.tokens, *action_tokens, *self.tokenizer.encode(rest, add_special_tokens=False)]
        return Prompt(tokens, full.text)

    def parse(self, tokens: list[int]) -> ParsedReply:
        """The reply text without its stop token; other special tokens are dropped from the text."""
        ended = bool(tokens) and tokens[-1] in self.stop_tokens
        body = tokens[:-1] if ended else tokens
        return ParsedReply(self.tokenizer.decode(body, skip_special_tokens=True), ended)

    def decode(self, tokens: list[int]) -> str:
        """Everything, special tokens included (for transcripts)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=False)


def context_window(tokenizer: Any) -> int | None:
    """The model's context length as the tokenizer states it; None when unset (transformers then reports
    a huge sentinel)."""
    n = getattr(tokenizer, "model_max_length", None)
    return int(n) if isinstance(n, int) and 0 < n < 10**8 else None


def _token_id(tokenizer: Any, token: str) -> int | None:
    # convert_tokens_to_ids returns the unk id (or None) for a string that is not one token.
    if token not in tokenizer.get_vocab():
        return None
    return tokenizer.convert_tokens_to_ids(token)
