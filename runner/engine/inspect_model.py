"""An inspect_ai model provider ("runner/<model>") backed by a runner SamplingClient: inspect's chat messages are
rendered with the recipe's renderer (runner/renderers/chat.py:ChatRenderer, as the envs render them), sampled on the
weights of the moment (any backend), and the reply parsed back, at the pinned eval's fixed sampling params.

Imports inspect_ai at module level: runner/engine/inspect_eval.py imports this module only once it knows the extra is
installed. A provider instance finds its sampler through `bridge` (a key into BRIDGES), so the model args inspect
records in its log stay plain strings. (The inspect_ai imports carry a pyright ignore: pyright is clean without the
extra too.)
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from inspect_ai.model import (  # pyright: ignore[reportMissingImports]
    ChatMessage,
    GenerateConfig,
    Model,
    ModelAPI,
    ModelOutput,
    ModelUsage,
    get_model,
    modelapi,
)
from inspect_ai.solver._task_state import sample_state  # pyright: ignore[reportMissingImports]
from inspect_ai.tool import ToolChoice, ToolInfo  # pyright: ignore[reportMissingImports]

from backends.base import SamplingClient
from backends.types import Json, SamplingParams
from runner.renderers.chat import ChatRenderer

PROVIDER = "runner"


@dataclass(frozen=True)
class Bridge:
    sampler: SamplingClient
    chat: ChatRenderer
    temperature: float
    max_tokens: int
    seed: int
    max_connections: int


BRIDGES: dict[str, Bridge] = {}


class UnsupportedInput(ValueError):
    """What the provider cannot pass to the sampler (tools, images): the sample fails, and the eval with it."""


def to_messages(messages: list[ChatMessage]) -> list[Json]:
    """inspect's chat messages as runner's (text content, the cookbook's dict format)."""
    out: list[Json] = []
    for m in messages:
        if not isinstance(m.content, str) and any(c.type not in ("text", "reasoning") for c in m.content):
            kinds = sorted({c.type for c in m.content} - {"text", "reasoning"})
            raise UnsupportedInput(f"a {m.role} message holds {', '.join(kinds)} content; only text is rendered")
        if m.role == "assistant" and m.tool_calls:
            raise UnsupportedInput("an assistant message holds tool calls; tasks with tools are not supported")
        out.append({"role": m.role, "content": m.text})
    return out


def sample_seed(seed: int, prompt: list[int]) -> int:
    """A seed per sample, epoch and prompt (a sample's turns), the same whatever order inspect runs them in."""
    state = sample_state()  # the sample being generated for (None for a call outside one, e.g. a scorer's)
    where = (state.sample_id, state.epoch) if state is not None else None
    return (seed * 1_000_003 + zlib.crc32(repr((where, prompt)).encode())) % 2**31


class RunnerModelAPI(ModelAPI):
    def __init__(self, model_name: str, base_url: str | None = None, api_key: str | None = None,
                 config: GenerateConfig = GenerateConfig(), bridge: str = "", **model_args: object) -> None:  # noqa: B008
        super().__init__(model_name, base_url, api_key, [], config)
        self.bridge = BRIDGES[bridge]

    def max_connections(self) -> int:
        return self.bridge.max_connections

    async def generate(self, input: list[ChatMessage], tools: list[ToolInfo], tool_choice: ToolChoice,
                       config: GenerateConfig) -> ModelOutput:
        if tools:
            raise UnsupportedInput(f"the task offers tools ({', '.join(t.name for t in tools)}); the runner model "
                                   "provider renders text conversations only")
        b = self.bridge
        prompt = b.chat.build_prompt(to_messages(input))
        seed = None if b.temperature == 0 else sample_seed(b.seed, prompt)
        params = SamplingParams(max_tokens=b.max_tokens, temperature=b.temperature, stop=b.chat.stop, seed=seed)
        seq = (await b.sampler.sample(prompt, 1, params)).sequences[0]
        reply = b.chat.parse(list(seq.tokens))
        cut = not reply.ended_on_stop and len(seq.tokens) >= b.max_tokens
        output = ModelOutput.from_content(model=self.model_name, content=reply.text,
                                          stop_reason="max_tokens" if cut else "stop")
        output.usage = ModelUsage(input_tokens=len(prompt), output_tokens=len(seq.tokens),
                                  total_tokens=len(prompt) + len(seq.tokens))
        return output


@modelapi(name=PROVIDER)
def runner_provider() -> type[ModelAPI]:
    return RunnerModelAPI


def bridged_model(key: str, bridge: Bridge, model_name: str) -> Model:
    """An inspect Model over `bridge`, registered under `key` (the caller removes it from BRIDGES when done)."""
    BRIDGES[key] = bridge
    return get_model(f"{PROVIDER}/{model_name}", memoize=False, bridge=key)
