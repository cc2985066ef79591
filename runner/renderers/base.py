"""The renderer contract: chat messages <-> tokens and per-token training weights.

A `Renderer` turns a conversation into the tokens a model trains on (with a weight per token) or the prompt it
samples from, names the stop sequences, and parses a sampled reply back into a message. Each renderer writes one
model family's chat format; the assembly here (which message is trained, what the generation prompt already
supplies) is shared, and a renderer only says how one message looks (`render_message`).

Semantics follow tinker-cookbook 0.6.1's renderers of the same names, token for token and weight for weight
(tests/test_renderers.py compares them). Messages are plain dicts: {"role", "content"} where content is a string
or a list of parts ({"type": "text", "text"} / {"type": "thinking", "thinking"}), plus optional "tool_calls"
(OpenAI shape: {"type": "function", "id", "function": {"name", "arguments": <JSON string>}}), "tool_call_id",
"name", and "trainable" (only with train_on_what = "customized").
"""

from __future__ import annotations

import copy
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from backends.errors import UserError
from backends.tokenizer import Tokenizer, decode_text  # the protocol sits with the loader, so backends/ may name it too
from backends.types import Json

if TYPE_CHECKING:
    from tokenizers import Tokenizer as CoreTokenizer

logger = logging.getLogger(__name__)

Message = Json
Part = Json


class TrainOnWhat(StrEnum):
    """Which tokens of a conversation carry loss (the cookbook's TrainOnWhat)."""

    LAST_ASSISTANT_MESSAGE = "last_assistant_message"
    LAST_ASSISTANT_TURN = "last_assistant_turn"  # the assistant messages after the last user message
    ALL_ASSISTANT_MESSAGES = "all_assistant_messages"
    ALL_MESSAGES = "all_messages"  # every message's content, not the role headers
    ALL_TOKENS = "all_tokens"  # everything, headers included
    ALL_USER_AND_SYSTEM_MESSAGES = "all_user_and_system_messages"
    CUSTOMIZED = "customized"  # each message's own "trainable" flag


TRAIN_ON_WHAT = tuple(t.value for t in TrainOnWhat)


def parse_train_on_what(value: str) -> TrainOnWhat:
    try:
        return TrainOnWhat(value)
    except ValueError:
        raise UserError(f"unknown train_on_what {value!r}; choose one of: {', '.join(TRAIN_ON_WHAT)}") from None


class Termination(StrEnum):
    """How a sampled reply ended (the cookbook's ParseTermination)."""

    STOP_SEQUENCE = "stop_sequence"  # the renderer's own stop signal fired
    EOS = "eos"  # the tokenizer's EOS, accepted as a clean end by some renderers (role_colon)
    MALFORMED = "malformed"  # truncated, or more than one stop signal

    @property
    def is_clean(self) -> bool:
        return self != Termination.MALFORMED


@dataclass
class RenderContext:
    idx: int
    is_last: bool
    prev_message: Message | None = None
    next_message: Message | None = None
    last_user_index: int = -1
    in_last_assistant_turn: bool = False


@dataclass
class Rendered:
    """One message as token pieces: `header` (role markers, trained only by all_tokens), `output` (what the
    model writes, end-of-turn included), `stop_overlap` (appended after the last message only: the part of a
    stop sequence that is also the next header, e.g. role_colon's "User:")."""

    output: list[list[int]]
    header: list[int] = field(default_factory=list)
    stop_overlap: list[int] = field(default_factory=list)


class Renderer(ABC):
    """Subclass, implement `render_message`, `get_stop_sequences` and `parse_response`, and decorate with
    `@register("name")` (runner/renderers/registry.py)."""

    name: str = ""
    # Whether the generation prompt closes the think block (qwen3_disable_thinking): a trained turn that
    # reasoned anyway is then refused.
    disables_thinking: bool = False

    # Special tokens the format needs as single tokens: checked when the renderer is built, so a renderer and a
    # tokenizer of different families fail at once instead of training on special tokens spelled out in bytes.
    required_tokens: tuple[str, ...] = ()
    # The special token that ends a turn, for formats whose turns end on one (it is then the stop sequence), and
    # the tokenizer family that has it (named in the error when the tokenizer lacks it).
    end_text: str | None = None
    end_family: str = ""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._warned = False
        missing = [t for t in self.required_tokens if len(self.encode(t)) != 1]
        if missing:
            raise UserError(f"the tokenizer does not have {', '.join(missing)} as single tokens, which this format "
                            f"writes: pick the renderer of the model's family (or \"hf\": its chat template)")

    # --- what a renderer defines -------------------------------------------------------------------------
    @property
    def has_extension_property(self) -> bool:
        """Whether each turn's generation prompt is a prefix of the next turn's (nothing is dropped from
        history), so a multi-turn episode can be one training sequence."""
        return False

    @property
    def bos_tokens(self) -> list[int]:
        return []

    @abstractmethod
    def render_message(self, message: Message, ctx: RenderContext) -> Rendered: ...

    @property
    def end_token(self) -> int:
        """The id of `end_text`, the token that ends a turn."""
        if self.end_text is None:
            raise TypeError(f"renderer {self.name!r} declares no end_text")
        return self.single_token(self.end_text, self.end_family)

    def get_stop_sequences(self) -> list[str] | list[int]:
        """By default the end-of-turn token; formats that stop otherwise override this."""
        return [self.end_token]

    @abstractmethod
    def parse_response(self, response: list[int]) -> tuple[Message, Termination]: ...

    def generation_suffix(self, role: str, ctx: RenderContext) -> list[int]:
        """The header the model continues from: by default the header of an empty message of `role`."""
        return list(self.render_message({"role": role, "content": ""}, ctx).header)

    def last_turn_start(self, messages: list[Message]) -> int:
        """Index of the first message of the turn being produced: the message after the last user one."""
        return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1) + 1

    def output_is_trained(self, message: Message, ctx: RenderContext, what: TrainOnWhat) -> bool:
        is_assistant = message["role"] == "assistant"
        match what:
            case TrainOnWhat.LAST_ASSISTANT_MESSAGE:
                return ctx.is_last and is_assistant
            case TrainOnWhat.LAST_ASSISTANT_TURN:
                return is_assistant and ctx.in_last_assistant_turn
            case TrainOnWhat.ALL_ASSISTANT_MESSAGES:
                return is_assistant
            case TrainOnWhat.ALL_MESSAGES | TrainOnWhat.ALL_TOKENS:
                return True
            case TrainOnWhat.ALL_USER_AND_SYSTEM_MESSAGES:
                return message["role"] in ("user", "system")
            case TrainOnWhat.CUSTOMIZED:
                return bool(message.get("trainable", False))

    # --- shared assembly ---------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def single_token(self, text: str, family: str) -> int:
        """The id of special token `text`, which this renderer needs as one token (a `family` tokenizer has it)."""
        ids = self.encode(text)
        if len(ids) != 1:
            raise UserError(f"renderer {self.name!r} needs a tokenizer with {text} as one token ({family})")
        return ids[0]

    def with_defaults(self, messages: list[Message]) -> list[Message]:
        """The conversation as this renderer renders it: `messages`, with what the renderer adds by default (gpt-oss
        and Kimi K2 add their default system message) - both build_* methods render this."""
        return messages

    def build_generation_prompt(self, messages: list[Message], role: str = "assistant",
                                prefill: str | None = None) -> list[int]:
        """Tokens of `messages` followed by the header of a `role` message (and `prefill`) to sample from."""
        messages = self.with_defaults(messages)
        _check_messages(messages)
        tokens = list(self.bos_tokens)
        last_user = _last_user_index(messages)
        turn_start = self.last_turn_start(messages)
        for idx, message in enumerate(messages):
            rendered = self.render_message(message, self._ctx(messages, idx, last_user, turn_start))
            tokens += rendered.header
            for piece in rendered.output:
                tokens += piece
        suffix_ctx = RenderContext(idx=len(messages), is_last=True, prev_message=messages[-1] if messages else None,
                                   last_user_index=last_user, in_last_assistant_turn=True)
        tokens += self.generation_suffix(role, suffix_ctx)
        if prefill:
            tokens += self.encode(prefill)
        return tokens

    def build_supervised_example(self, messages: list[Message],
                                 train_on_what: str = TrainOnWhat.LAST_ASSISTANT_MESSAGE
                                 ) -> tuple[list[int], list[float]]:
        """Tokens of the conversation and a 0/1 weight per token (1 = trained)."""
        what = parse_train_on_what(str(train_on_what))
        messages = self.with_defaults(messages)
        _check_messages(messages)
        if what == TrainOnWhat.ALL_ASSISTANT_MESSAGES and not self.has_extension_property and not self._warned:
            self._warned = True
            logger.warning("train_on_what = all_assistant_messages with renderer %r, which drops content from "
                           "history (no extension property): earlier assistant messages are trained after a "
                           "prefix the model never sees when sampling them", self.name)
        tokens: list[int] = list(self.bos_tokens)
        weights: list[float] = [0.0] * len(tokens)
        last_user = _last_user_index(messages)
        turn_start = self.last_turn_start(messages[:-1])
        for idx, message in enumerate(messages):
            if what == TrainOnWhat.CUSTOMIZED and "trainable" not in message:
                raise UserError(f"train_on_what = \"customized\" needs a \"trainable\" flag on every message; "
                                f"message {idx} has none")
            if what != TrainOnWhat.CUSTOMIZED and "trainable" in message:
                raise UserError(f"message {idx} has a \"trainable\" flag, which only train_on_what = "
                                f"\"customized\" uses")
            ctx = self._ctx(messages, idx, last_user, turn_start)
            rendered = self.render_message(message, ctx)
            head_w = float(what == TrainOnWhat.ALL_TOKENS)
            tokens += rendered.header
            weights += [head_w] * len(rendered.header)
            out_w = float(self.output_is_trained(message, ctx, what))
            for piece in rendered.output:
                tokens += piece
                weights += [out_w] * len(piece)
            if ctx.is_last and rendered.stop_overlap:
                tokens += rendered.stop_overlap
                weights += [out_w] * len(rendered.stop_overlap)
        return tokens, self._untrain_generation_prompt(messages, what, tokens, weights)

    def _ctx(self, messages: list[Message], idx: int, last_user: int, turn_start: int) -> RenderContext:
        return RenderContext(idx=idx, is_last=idx == len(messages) - 1,
                             prev_message=messages[idx - 1] if idx > 0 else None,
                             next_message=messages[idx + 1] if idx + 1 < len(messages) else None,
                             last_user_index=last_user, in_last_assistant_turn=idx >= turn_start)

    def _untrain_generation_prompt(self, messages: list[Message], what: TrainOnWhat, tokens: list[int],
                                   weights: list[float]) -> list[float]:
        """Withhold loss from whatever the generation prompt would have supplied (a prefilled, closed think
        block): the model is never asked to produce it. A renderer whose prompt closes the think block refuses
        a trained turn that reasoned (the render then does not start with the prompt)."""
        match what:
            case TrainOnWhat.LAST_ASSISTANT_MESSAGE:
                boundary = len(messages) - 1
            case TrainOnWhat.LAST_ASSISTANT_TURN:
                boundary = _last_user_index(messages) + 1
            case _:
                return weights
        if not 0 <= boundary < len(messages) or messages[boundary]["role"] != "assistant":
            return weights
        prompt = self.build_generation_prompt(messages[:boundary])
        if tokens[: len(prompt)] != prompt:
            if self.disables_thinking:
                raise UserError(f"renderer {self.name!r} has thinking turned off (its prompt closes the think "
                                f"block) but the trained turn contains reasoning; use the thinking renderer or "
                                f"drop the reasoning from that turn")
            return weights
        return [0.0] * len(prompt) + weights[len(prompt):]

    def decode(self, tokens: list[int]) -> str:
        return decode_text(self.tokenizer, tokens)


def render_row(renderer: Renderer, messages: list[Message], train_on_what: str, where: str
               ) -> tuple[list[int], list[float]]:
    """A conversation's tokens and weights, with any renderer or chat-template failure as one line naming the row."""
    try:
        return renderer.build_supervised_example(messages, train_on_what)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a chat template's own errors, e.g. roles that must alternate
        raise UserError(f"{where}: renderer {renderer.name!r} cannot render this conversation: {e}") from None


# --- the table of renderers by name (runner/renderers/registry.py builds from it) -------------------------------
Factory = Callable[[Tokenizer], Renderer]
REGISTRY: dict[str, Factory] = {}
AUTO = "auto"  # the name the recipe accepts besides the registered ones (runner/renderers/auto.py resolves it)
_R = TypeVar("_R", bound=Renderer)


def register(name: str) -> Callable[[type[_R]], type[_R]]:
    """Class decorator: `name` builds this Renderer subclass from a tokenizer."""

    def add(cls: type[_R]) -> type[_R]:
        add_renderer(name, cls)
        return cls

    return add


def add_renderer(name: str, factory: Factory) -> None:
    """`name` builds `factory(tokenizer)` (a variant of a class with other arguments). Names are unique."""
    if name in REGISTRY or name == AUTO:
        raise ValueError(f"renderer {name!r} is registered twice")
    REGISTRY[name] = factory


def _last_user_index(messages: list[Message]) -> int:
    return max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)


def _check_messages(messages: list[Message]) -> None:
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise UserError(f"message {i} is not a {{\"role\": ..., \"content\": ...}} object: {str(m)[:80]}")
        content = m["content"]
        if not isinstance(content, str | list):
            raise UserError(f"message {i}'s content is a {type(content).__name__}; expected text or a list of parts")


# --- content helpers ---------------------------------------------------------------------------------------
def ensure_text(content: str | list[Part]) -> str:
    if isinstance(content, str):
        return content
    if len(content) == 1 and content[0].get("type") == "text":
        return content[0]["text"]
    raise UserError(f"this renderer takes text content only; got a list of {len(content)} parts")


def has_thinking(content: str | list[Part]) -> bool:
    if isinstance(content, list):
        return any(p.get("type") == "thinking" for p in content)
    return "<think>" in content


def remove_thinking(parts: list[Part]) -> list[Part]:
    return [p for p in parts if p.get("type") != "thinking"]


def text_of(message: Message) -> str:
    """The message's text without its reasoning (the cookbook's get_text_content)."""
    content = message["content"]
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p.get("type") == "text")


def content_tokenizer(tokenizer: Tokenizer) -> CoreTokenizer | None:
    """A private copy of the tokenizer's backend that encodes special-token text inside content literally (as
    the chat templates of Qwen's family do); None for a tokenizer without a `tokenizers` backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    own = copy.deepcopy(backend)
    own.encode_special_tokens = True
    return own


def tool_call_payload(call: Json) -> Json:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        raise UserError(f"tool call {fn.get('name')!r} has arguments that are not JSON: {str(args)[:80]}") from None
    return {"name": fn["name"], "arguments": parsed}


def tool_call_arguments(call: Json) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    return args if isinstance(args, str) else json.dumps(args)


def make_tool_call(name: str, arguments: str, call_id: str | None = None) -> Json:
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}


def parse_for_stop_token(response: list[int], tokenizer: Tokenizer, stop_token: int) -> tuple[Message, Termination]:
    """Split a reply on its single stop token: none = truncated (malformed), two or more = a sampler that was not
    told the stop token."""
    count = response.count(stop_token)
    if count == 0:
        return {"role": "assistant", "content": decode_text(tokenizer, response)}, Termination.MALFORMED
    if count == 1:
        text = decode_text(tokenizer, response[: response.index(stop_token)])
        return {"role": "assistant", "content": text}, Termination.STOP_SEQUENCE
    raise UserError(f"a sampled reply holds its stop token {count} times; sample with the renderer's stop "
                    f"sequences")


_THINK_OR_TOOL = re.compile(r"<think>(.*?)</think>|<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def parse_content_blocks(content: str) -> tuple[list[Part], list[Json]] | None:
    """<think>...</think> and <tool_call>{json}</tool_call> blocks in order: (parts, tool calls); None when the
    text has neither. A tool call that does not parse is {"raw_text", "error"}."""
    if "<think>" not in content and "<tool_call>" not in content:
        return None
    parts: list[Part] = []
    calls: list[Json] = []
    pos = 0
    for m in _THINK_OR_TOOL.finditer(content):
        if content[pos : m.start()]:
            parts.append({"type": "text", "text": content[pos : m.start()]})
        if m.group(1) is not None:
            if m.group(1):
                parts.append({"type": "thinking", "thinking": m.group(1)})
        else:
            calls.append(_parse_tool_json(m.group(2), m.group(0)))
        pos = m.end()
    if content[pos:]:
        parts.append({"type": "text", "text": content[pos:]})
    return parts, calls


def parse_think_blocks(content: str) -> list[Part] | None:
    if "<think>" not in content:
        return None
    parts: list[Part] = []
    pos = 0
    for m in _THINK.finditer(content):
        if content[pos : m.start()]:
            parts.append({"type": "text", "text": content[pos : m.start()]})
        if m.group(1):
            parts.append({"type": "thinking", "thinking": m.group(1)})
        pos = m.end()
    if content[pos:]:
        parts.append({"type": "text", "text": content[pos:]})
    return parts


def _parse_tool_json(body: str, raw: str) -> Json:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return {"raw_text": raw, "error": f"Invalid JSON: {e}"}
    if not isinstance(obj, dict):
        return {"raw_text": raw, "error": "Tool call is not a JSON object"}
    name, args, call_id = obj.get("name"), obj.get("arguments"), obj.get("id")
    if not isinstance(name, str):
        return {"raw_text": raw, "error": "Missing or invalid 'name' field"}
    if not isinstance(args, dict):
        return {"raw_text": raw, "error": "Missing or invalid 'arguments' field"}
    return make_tool_call(name, json.dumps(args), call_id if isinstance(call_id, str) else None)


def unterminated_block(content: str, open_marker: str, close_marker: str) -> Json | None:
    """A tool block opened and never closed, as an unparsed tool call."""
    opens = content.count(open_marker)
    if opens == 0 or opens <= content.count(close_marker):
        return None
    return {"raw_text": content[content.rfind(open_marker):][:500],
            "error": f"unterminated tool block: {open_marker!r} opened without a matching {close_marker!r}"}


def split_tool_results(message: Message, results: list[Json]) -> None:
    parsed = [r for r in results if "function" in r]
    unparsed = [r for r in results if "raw_text" in r]
    if parsed:
        message["tool_calls"] = parsed
    if unparsed:
        message["unparsed_tool_calls"] = [*message.get("unparsed_tool_calls", []), *unparsed]
