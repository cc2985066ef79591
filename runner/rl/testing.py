"""A scripted SamplingClient for tests of envs, rollouts and loops: no model, exact control over replies.

`policy(prompt_text, params)` returns the reply as text (encoded, then the first stop token is appended,
as a model that ends its turn would) or as a token list (returned as is). Replies longer than
params.max_tokens are cut, with stop_reason "length". Logprobs are a deterministic function of the
token and its position, so tests can check where they land.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.base import Future
from backends.tokenizer import Tokenizer, decode_text, eos_token_id
from backends.types import SampledSequence, SampleOutput, SamplingParams

Policy = Callable[[str, SamplingParams], "str | list[int]"]


def fake_logprob(token: int, position: int) -> float:
    return -0.01 * (token % 97) - 0.001 * position - 0.001


class ScriptedSampler:
    def __init__(self, tokenizer: Tokenizer, policy: Policy):
        self.tokenizer = tokenizer
        self.policy = policy
        # (prompt tokens, params) of every sample call, in call order.
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self.num_samples: list[int] = []  # of every call, in call order

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        self.calls.append((list(prompt), params))
        self.num_samples.append(num_samples)
        text = decode_text(self.tokenizer, prompt)
        seqs = [self._one(text, params) for _ in range(num_samples)]
        return Future.completed(SampleOutput(seqs))

    def _one(self, prompt_text: str, params: SamplingParams) -> SampledSequence:
        reply = self.policy(prompt_text, params)
        if isinstance(reply, str):
            tokens = list(self.tokenizer.encode(reply, add_special_tokens=False))
            stop = next((s for s in (params.stop or []) if isinstance(s, int)), None)
            if stop is None:
                stop = eos_token_id(self.tokenizer)
            if stop is None:
                raise ValueError("the reply needs a stop token: params.stop holds no token id and the tokenizer no eos")
            tokens.append(stop)
        else:
            tokens = list(reply)
        stop_reason = "stop"
        if len(tokens) > params.max_tokens:
            tokens, stop_reason = tokens[: params.max_tokens], "length"
        return SampledSequence(tokens, [fake_logprob(t, i) for i, t in enumerate(tokens)], stop_reason)

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        return Future.completed([None] + [fake_logprob(t, i) for i, t in enumerate(tokens[1:])])
