"""colorize: a rendered example as text, trained tokens in green and the rest dim (the cookbook's
colorize_example), or plain with [[...]] around trained spans when color is off."""

from __future__ import annotations

import sys
from typing import TextIO

from backends.tokenizer import decode_text
from runner.renderers.base import Tokenizer

_GREEN, _DIM, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[0m"


def colorize(tokens: list[int], weights: list[float], tokenizer: Tokenizer, color: bool | None = None,
             stream: TextIO | None = None) -> str:
    """Decode runs of equally-weighted tokens; color when `color` (default: when `stream`/stdout is a tty)."""
    if len(tokens) != len(weights):
        raise ValueError(f"{len(tokens)} tokens but {len(weights)} weights")
    if color is None:
        color = bool(getattr(stream or sys.stdout, "isatty", lambda: False)())
    out: list[str] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or (weights[i] > 0) != (weights[start] > 0):
            text = decode_text(tokenizer, tokens[start:i])
            trained = weights[start] > 0
            if color:
                out.append((_GREEN if trained else _DIM) + text + _RESET)
            else:
                out.append(f"[[{text}]]" if trained else text)
            start = i
    return "".join(out)
