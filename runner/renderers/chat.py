"""Chat messages <-> tokens for environments, over the recipe's renderer (runner/renderers/).

Envs speak in messages; the sampler speaks in tokens. `ChatRenderer` builds the generation prompt with the
renderer (the tokenizer's own chat template for "hf", so a Tinker model gets its real format; the cookbook's
format for a named renderer), names the stop sequences, and parses a sampled reply. Multi-turn envs keep their
message list and re-render it every turn: when the new prompt starts with the old prompt plus the sampled reply
(ChatML-style templates, renderers with the extension property), the sampled tokens are kept, which lets
datums.py merge the turns into one sequence (and it falls back to one datum per turn when a format breaks that).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from backends.errors import UserError
from backends.tokenizer import decode_text
from backends.types import Json
from runner.models import model_context
from runner.renderers import Renderer, Termination, get_renderer, text_of
from runner.renderers.base import Tokenizer
from runner.renderers.hf import HFTemplateRenderer

Message = Json  # {"role": ..., "content": ...}

_RENDER_CACHE = 4096  # conversations whose rendering is kept
# A conversation as a cache key: each message's (key, value) pairs, sorted (TypeError when a value is unhashable).
_Key = tuple[tuple[tuple[str, object], ...], ...]


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    # The rendering's text for these tokens (what the next turn's rendering must start with).
    text: str


@dataclass(frozen=True)
class ParsedReply:
    text: str  # the reply's text, without reasoning or the stop sequence
    # The reply ended cleanly (its stop sequence, or EOS where the renderer accepts that): not cut off.
    ended_on_stop: bool
    termination: Termination = Termination.MALFORMED
    # The whole parsed message (reasoning parts, tool calls) as the renderer's parse_response gives it.
    message: Message = field(default_factory=dict)


class ChatRenderer:
    def __init__(self, renderer: Renderer | Tokenizer):
        """Over a Renderer, or a tokenizer (then its chat template: renderer "hf")."""
        if not isinstance(renderer, Renderer):
            if not getattr(renderer, "chat_template", None):
                raise UserError("the tokenizer has no chat template; set renderer = \"role_colon\" (a base model) "
                                "or the model family's renderer")
            renderer = get_renderer("hf", renderer)
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self._stop: list[str] | list[int] = renderer.get_stop_sequences().copy()
        if not self._stop:
            raise UserError("the renderer names no stop sequence; environments need one to end replies")
        self._template = isinstance(renderer, HFTemplateRenderer)
        # Recent renderings: every env of a group renders the same first prompt (8x per problem in rl_basic),
        # and rendering is ~0.3 ms of main-thread time each, on the path that feeds the sampler.
        self._renders: OrderedDict[_Key, tuple[tuple[int, ...], str]] = OrderedDict()

    @property
    def stop(self) -> list[str] | list[int]:
        """The renderer's stop sequences (a fresh list: SamplingParams.stop)."""
        return self._stop.copy()

    @property
    def stop_tokens(self) -> list[int]:
        """The stop token ids (renderers that stop on token ids: all but role_colon)."""
        if not all(isinstance(s, int) for s in self._stop):
            raise UserError(f"renderer {self.renderer.name!r} stops on strings {self._stop}, not token ids")
        return [int(s) for s in self._stop]

    def build_prompt(self, messages: list[Message]) -> list[int]:
        """Tokens of the conversation followed by the assistant header the model continues from."""
        return self.render(messages).tokens

    def render(self, messages: list[Message]) -> Prompt:
        try:
            key: _Key | None = tuple(tuple(sorted(m.items())) for m in messages)
            hit = self._renders.get(key)
        except TypeError:  # a message with unhashable content (e.g. a list of parts): not cached
            key, hit = None, None
        if hit is None:
            if isinstance(self.renderer, HFTemplateRenderer):
                text = self.renderer.template_text(messages)
                # The template already wrote any BOS/special tokens as text; don't let encode add them again.
                hit = (tuple(self.tokenizer.encode(text, add_special_tokens=False)), text)
            else:
                tokens = self.renderer.build_generation_prompt(messages)
                hit = (tuple(tokens), self.decode(tokens))
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
        every turn becomes its own datum. Falls back to a full re-render when the rendering's text does not
        continue prev's text with the reply (e.g. a format that drops earlier reasoning)."""
        full = self.render(messages)
        head = [*prev.tokens, *action_tokens]
        if full.tokens[: len(head)] == head:
            return full
        if self._template:
            head_text = prev.text + reply.text
        else:
            head_text = self.decode(head)
        if not full.text.startswith(head_text):
            return full
        rest = full.text[len(head_text):]
        if self._template and reply.ended_on_stop:
            # The sampled stop token stands for the template's end-of-turn text, if that is what follows.
            stop_text = decode_text(self.tokenizer, action_tokens[-1:])
            if not rest.startswith(stop_text):
                return full
            rest = rest[len(stop_text):]
        return Prompt([*head, *self.tokenizer.encode(rest, add_special_tokens=False)], full.text)

    def parse(self, tokens: list[int]) -> ParsedReply:
        """The reply's text without its stop sequence (and, for "hf", without other special tokens)."""
        message, termination = self.renderer.parse_response(list(tokens))
        return ParsedReply(text_of(message), termination.is_clean, termination, message)

    def decode(self, tokens: list[int]) -> str:
        """Everything, special tokens included (for transcripts)."""
        return decode_text(self.tokenizer, tokens)


def context_window(tokenizer: Tokenizer, model: str | None = None) -> int | None:
    """The model's context length: the shorter of what the tokenizer states (unset: transformers reports a huge
    sentinel) and the model table's `context` for `model` (runner/models.toml), so a model folder whose tokenizer
    states none still gets its overflow check; None when neither knows. The shorter, because a tokenizer may claim
    more than the model has (Qwen3-8B's 131072 against its 40960 positions), and a served stand-in less."""
    n = getattr(tokenizer, "model_max_length", None)
    stated = int(n) if isinstance(n, int) and 0 < n < 10**8 else None
    known = [c for c in (stated, model_context(model) if model else None) if c is not None]
    return min(known) if known else None
