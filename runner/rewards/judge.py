"""A trained reward model (runner/algos/reward_model.py) as a pairwise judge: P(a is better than b).

The judge prompt (runner/data/comparisons.py `judge_messages`) shows the conversation and both completions and asks
"A or B?"; the model's answer is read from the logprobs of the two label tokens, not sampled:
P(slot A better) = σ(lp("A") − lp("B")). Both orders are asked (a shown as A, then as B) and averaged, which
removes the judge's position bias and makes the judge symmetric: judge_prob(a, b) + judge_prob(b, a) = 1.
"""

from __future__ import annotations

import asyncio
import math

from backends.base import SamplingClient
from runner.data.comparisons import render_judge
from runner.data.conversations import Conversation
from runner.renderers.base import Tokenizer


async def label_logprobs(client: SamplingClient, prefix: list[int], token_a: int, token_b: int) -> tuple[float, float]:
    """(logprob of label "A", of label "B") after the judge prompt `prefix`."""
    out_a, out_b = await asyncio.gather(client.compute_logprobs([*prefix, token_a]),
                                        client.compute_logprobs([*prefix, token_b]))
    lp_a, lp_b = out_a[-1], out_b[-1]
    assert lp_a is not None and lp_b is not None  # the last position of a sequence of >= 2 tokens is scored
    return float(lp_a), float(lp_b)


def p_first(lp_a: float, lp_b: float) -> float:
    """P(A) within the two labels: σ(lp_a − lp_b)."""
    z = lp_a - lp_b
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _messages(x: str | Conversation) -> Conversation:
    return [{"role": "assistant", "content": x}] if isinstance(x, str) else x


async def judge_prob(sampling_client: SamplingClient, tokenizer: Tokenizer, prompt_messages: str | Conversation,
                     a: str | Conversation, b: str | Conversation) -> float:
    """P(a is better than b) in [0, 1], averaged over both orders. `prompt_messages`: the conversation so far (a
    string is one user message); `a`, `b`: completions (a string is one assistant message)."""
    prompt = [{"role": "user", "content": prompt_messages}] if isinstance(prompt_messages, str) else prompt_messages
    ma, mb = _messages(a), _messages(b)
    orders = [render_judge(tokenizer, prompt, ma, mb), render_judge(tokenizer, prompt, mb, ma)]
    (a1, b1), (a2, b2) = await asyncio.gather(*(label_logprobs(sampling_client, *order) for order in orders))
    return 0.5 * (p_first(a1, b1) + (1.0 - p_first(a2, b2)))
