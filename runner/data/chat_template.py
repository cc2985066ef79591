"""Conversations -> tokens and per-token weights with the tokenizer's own (Hugging Face) chat template: what SFT,
DPO and the reward model train on."""

from __future__ import annotations

from typing import Any

from runner.data.conversations import Conversation


def render(tokenizer: Any, messages: Conversation, train_on_what: str) -> tuple[list[int], list[float]]:
    """Tokens of the whole conversation and a 0/1 weight per token (1 = trained); "all_messages"
    trains every token.

    A message's tokens are those the rendering of messages[:i+1] adds over messages[:i]; for an
    assistant message the prompt side is rendered with add_generation_prompt, so its header
    ("<|im_start|>assistant\\n") stays untrained and its end-of-turn token is trained. Boundaries are
    the common token prefix with the full rendering, which also covers templates that render a
    prefix differently (e.g. dropping an earlier turn's reasoning).
    """
    tokens = encode(tokenizer, template(tokenizer, messages, False))
    if train_on_what == "all_messages":
        return tokens, [1.0] * len(tokens)
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    match train_on_what:
        case "last_assistant_message":
            trained = assistants[-1:]
        case "all_assistant_messages":
            trained = assistants
        case _:
            raise ValueError(f"unknown train_on_what {train_on_what!r}")
    weights = [0.0] * len(tokens)
    for i in trained:
        start = prefix_len(tokenizer, messages[:i], tokens, True)
        end = prefix_len(tokenizer, messages[: i + 1], tokens, False) if i + 1 < len(messages) else len(tokens)
        weights[start:end] = [1.0] * (end - start)
    return tokens, weights


def template(tokenizer: Any, messages: Conversation, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode(tokenizer: Any, text: str) -> list[int]:
    # The template already wrote any BOS/special tokens as text.
    return list(tokenizer.encode(text, add_special_tokens=False))


def prefix_len(tokenizer: Any, prefix: Conversation, tokens: list[int], generation_prompt: bool) -> int:
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
