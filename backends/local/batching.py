"""Target logprobs for a list of datums of different lengths, in padded chunks of bounded size.

Datums are sorted longest first and packed greedily into chunks of at most `chunk_tokens(vocab)` padded
tokens, so a big batch never materialises one huge logits tensor; on the CPU a chunk also stays dense
(see PAD_FILL). Padding goes on the right and needs no attention mask: in a causal LM a real position
never attends to a later one, so trailing pad tokens cannot change it (and the unmasked causal path is
the fast one).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from backends.local.device import LOGITS_DTYPE
from backends.local.transfer import to_device
from backends.types import Datum

# Upper bound on padded tokens per chunk, and on the chunk's float32 logits (2**27 floats = 512 MiB).
MAX_CHUNK_TOKENS = 16384
LOGITS_BUDGET = 2**27
# A chunk is padded to its longest row and CPU time grows with padded tokens (attention with the width
# squared). bench/bench_train.py, batches of 16 chat rows of 60-330 tokens: one chunk pads 2x; splitting at
# fill 0.7 doubles train tokens/s (tiny 0.8M and 25M models, fp32). Chunks under SPLIT_TOKENS padded tokens are
# not split: a forward/backward has a fixed cost too. On CUDA the extra launches were not measured, so the
# plan is unchanged there (fill 0).
PAD_FILL = 0.7
SPLIT_TOKENS = 1024


def chunk_tokens(vocab: int) -> int:
    return max(256, min(MAX_CHUNK_TOKENS, LOGITS_BUDGET // vocab))


def check_tokens(data: list[Datum], vocab: int) -> None:
    """ValueError naming the first datum whose input or target ids fall outside [0, vocab)."""
    for i, d in enumerate(data):
        for what, ids in (("model_input", np.asarray(d.model_input)), ("target_tokens", d.target_tokens)):
            bad = ids[(ids < 0) | (ids >= vocab)]
            if bad.size:
                raise ValueError(f"datum {i}: {what} holds token id {bad.flat[0]}, outside the model's vocab [0, {vocab})")


def plan_chunks(lengths: list[int], budget: int, fill: float = 0.0) -> list[list[int]]:
    """Indices grouped into chunks (longest first) with len(chunk) * longest <= budget, at least one each.
    fill > 0: a row shorter than fill * the chunk's longest starts a new chunk, unless the chunk with it
    would still hold at most SPLIT_TOKENS padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    for i in order:
        if chunks:
            padded = (len(chunks[-1]) + 1) * lengths[chunks[-1][0]]
            dense = lengths[i] >= fill * lengths[chunks[-1][0]] or padded <= SPLIT_TOKENS
            if padded <= budget and dense:
                chunks[-1].append(i)
                continue
        chunks.append([i])
    return chunks


def chunk_logprobs(
    model: torch.nn.Module, data: list[Datum], device: torch.device, budget: int
) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
    """Yield (datum indices, their float32 target logprobs shaped like target_tokens), one chunk at a time.
    Autograd follows torch's grad mode, so a caller can backward each chunk before the next is built."""
    fill = PAD_FILL if device.type == "cpu" else 0.0
    for idx in plan_chunks([d.length for d in data], budget, fill):
        width = data[idx[0]].length
        ids = torch.zeros((len(idx), width), dtype=torch.long)  # pad id 0: any valid id works (see above)
        for row, i in enumerate(idx):
            ids[row, : data[i].length] = torch.as_tensor(data[i].model_input, dtype=torch.long)
        ids_d, *targets_d = to_device([ids.numpy()] + [data[i].target_tokens for i in idx], device, np.int64)
        logits = model(input_ids=ids_d, use_cache=False).logits.to(LOGITS_DTYPE)
        # log p(target) = logit[target] - logsumexp(logits): no full log_softmax tensor is built.
        lse = torch.logsumexp(logits, dim=-1)
        out = []
        for row, i in enumerate(idx):
            n = data[i].length
            targets = targets_d[row].view(n, -1)  # moved with the ids in one copy: no host sync per datum
            lp = logits[row, :n].gather(-1, targets) - lse[row, :n, None]
            out.append(lp.view(data[i].target_tokens.shape))
        yield idx, out
