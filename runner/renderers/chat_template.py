"""Conversations -> tokens and per-token weights with the tokenizer's own (Hugging Face) chat template: the `hf`
renderer (runner/renderers/hf.py) and the helpers runner/data/comparisons.py shares."""

from __future__ import annotations

from backends.types import Json
from runner.renderers.base import Tokenizer

Conversation = list[Json]


def render(tokenizer: Tokenizer, messages: Conversation, train_on_what: str) -> tuple[list[int], list[float]]:
    """Tokens of the whole conversation and a 0/1 weight per token (1 = trained).

    A message's tokens are those the rendering of messages[:i+1] adds over messages[:i]; for an assistant
    message the prompt side is rendered with add_generation_prompt, so its header ("<|im_start|>assistant\\n")
    stays untrained and its end-of-turn token is trained. Boundaries are the common token prefix with the full
    rendering, which also covers templates that render a prefix differently (e.g. dropping an earlier turn's
    reasoning). "all_messages" and "all_tokens" train every token (a template does not say where a user
    message's header ends); "customized" trains the messages flagged "trainable".
    """
    clean = [{k: v for k, v in m.items() if k != "trainable"} for m in messages]
    tokens = encode(tokenizer, template(tokenizer, clean, False))
    if train_on_what in ("all_messages", "all_tokens"):
        return tokens, [1.0] * len(tokens)
    roles = [m["role"] for m in messages]
    assistants = [i for i, r in enumerate(roles) if r == "assistant"]
    last_user = max((i for i, r in enumerate(roles) if r == "user"), default=-1)
    match train_on_what:
        case "last_assistant_message":
            trained = [len(messages) - 1] if roles and roles[-1] == "assistant" else []
        case "last_assistant_turn":
            trained = [i for i in assistants if i > last_user]
        case "all_assistant_messages":
            trained = assistants
        case "all_user_and_system_messages":
            trained = [i for i, r in enumerate(roles) if r in ("user", "system")]
        case "customized":
            trained = [i for i, m in enumerate(messages) if m.get("trainable")]
        case _:
            raise ValueError(f"unknown train_on_what {train_on_what!r}")
    weights = [0.0] * len(tokens)
    for i in trained:
        start = prefix_len(tokenizer, clean[:i], tokens, roles[i] == "assistant")
        end = prefix_len(tokenizer, clean[: i + 1], tokens, False) if i + 1 < len(messages) else len(tokens)
        weights[start:end] = [1.0] * (end - start)
    return tokens, weights


def template(tokenizer: Tokenizer, messages: Conversation, generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(text, str):
        raise TypeError(f"{type(tokenizer).__name__}.apply_chat_template(tokenize=False) gave a {type(text).__name__}")
    return text


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    # The template already wrote any BOS/special tokens as text.
    return list(tokenizer.encode(text, add_special_tokens=False))


def prefix_len(tokenizer: Tokenizer, prefix: Conversation, tokens: list[int], generation_prompt: bool) -> int:
    if not prefix and not generation_prompt:
        return 0
    try:
        ids = encode(tokenizer, template(tokenizer, prefix, generation_prompt))
    except Exception:  # noqa: BLE001 - some templates reject an empty or assistant-first prefix
        return 0
    n = 0
    for a, b in zip(ids, tokens, strict=False):  # the prefix is usually shorter
        if a != b:
            break
        n += 1
    return n
