"""The `tool_use` env's recipe table (`algo.env = {kind = "tool_use", ...}`), implemented by runner/rl/envs/tool_use.py."""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
from msgspec import Meta

from runner.recipe.common import TARGET_PATTERN, DataSource, EnvBase, NonNegFloat, PosFloat, PosInt

BUILTIN_TOOLS = ("calculator", "search")


class ToolUse(EnvBase, tag="tool_use", kw_only=True):
    """Multi-turn tool calling (cookbook search_tool): the model may call `tools` (in the renderer's tool format, or
    `CALL name {json}` lines where it has none) up to max_turns, then answers; reward = correct + format_coef·(format
    − 1), format = an answer after `answer_prefix` and no malformed call (runner/rl/envs/tool_use.py)."""

    # Rows {question, answer}: answer a string, a number or a list of accepted answers.
    data: DataSource
    test_data: DataSource | None = None
    # Built-ins ("calculator", "search") and "pkg.mod:fn" functions (docstring + typed args -> a JSON-schema spec).
    tools: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["calculator"])
    # The `search` tool's collection: rows {id, title, text}.
    docs: DataSource | None = None
    top_k: PosInt = 3
    # Assistant turns per episode (tool-calling turns plus the answer).
    max_turns: PosInt = 4
    # The final answer is the text after the last `answer_prefix` (case-insensitive); "": the whole final reply.
    answer_prefix: str = "Answer:"
    # Prepended as the system prompt (with the tool declarations); None: a short default.
    system_prompt: str | None = None
    format_coef: NonNegFloat = 0.1
    # Characters of a tool result shown to the model.
    max_result_chars: PosInt = 1000
    tool_timeout_s: PosFloat = 10.0

    def __post_init__(self) -> None:
        for tool in self.tools:
            if tool not in BUILTIN_TOOLS and re.fullmatch(TARGET_PATTERN, tool) is None:
                raise ValueError(f"tool {tool!r} is neither a built-in {list(BUILTIN_TOOLS)} nor 'pkg.mod:fn'")
        if "search" in self.tools and self.docs is None:
            raise ValueError("the search tool needs `docs`, a data source of {id, title, text} rows")
