"""Top-k logprobs (SampleRequest.topk_prompt_logprobs / topk_sample_logprobs): one forward pass over the
tokens, the k most likely next tokens at each asked position. Sampled positions use the request's
temperature, as the sampled tokens' own logprobs do; prompt positions use temperature 1, as prompt_logprobs."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch


def topk_logprobs(model, tokens: list[int], k: int, temperature: float, positions: Iterable[int]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 (P, k), logprobs float32 (P, k)) for each position p: the distribution of token p given tokens[:p]."""
    ids, vals, _ = topk_and_own(model, tokens, k, temperature, positions)
    return ids, vals


@torch.no_grad()
def topk_and_own(model, tokens: list[int], k: int, temperature: float, positions: Iterable[int]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """topk_logprobs, and each position's own token's logprob (float32 (P,); 0 for a position past the tokens)
    from the same log-softmax: where that token is among the top k, the two are the same float, bit for bit
    (lm-eval's is_greedy compares them)."""
    pos = [p for p in positions]
    if not pos:
        return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32), np.zeros((0,), np.float32)
    device = next(model.parameters()).device
    ids = torch.tensor([tokens[: max(pos)]], device=device)
    logits = model(input_ids=ids).logits[0].float()  # (L, V): row i predicts token i + 1
    rows = logits[torch.tensor([p - 1 for p in pos], device=device)]
    logp = torch.log_softmax(rows / max(temperature, 1e-6), dim=-1) if temperature > 0 else torch.log_softmax(rows, -1)
    k = min(k, logp.shape[-1])
    top = logp.topk(k, dim=-1)
    own_ids = torch.tensor([tokens[p] if p < len(tokens) else 0 for p in pos], device=device)
    own = logp.gather(1, own_ids[:, None])[:, 0]
    return top.indices.to(torch.int32).cpu().numpy(), top.values.cpu().numpy(), own.cpu().numpy()
