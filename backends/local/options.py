"""The local backend's settings: the fields of its recipe table (local_config.Local), defined once.

local_config.py makes the backend (`Local.make` imports backend.py lazily); the backend and device.py type their
settings with this struct instead of importing local_config.py back, so the modules form no circle (tests/
test_import_graph.py). `Local` is this struct plus the backend's table methods (a msgspec struct of two bases: its
tag from BackendConfig, its fields from here). Light: no torch, so a recipe validates without it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class LocalOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # "auto": cuda if available and the model has 50M parameters or more, else cpu (the embedded tiny model runs
    # faster on the CPU). Chosen in one place, with every tensor's dtype: backends/local/device.py.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": bfloat16 on cuda, float32 on cpu (bit-for-bit reproducible there).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # LoRA scaling numerator (scale = alpha / rank); Tinker does not expose it.
    lora_alpha: Annotated[float, Meta(gt=0)] = 32.0
    # Train every weight instead of a LoRA adapter (local only; Tinker trains LoRA).
    full_finetune: bool = False
    # Padding-free training: a batch's sequences packed into one token matrix, attention per sequence
    # (backends/local/packed.py; Llama/Mistral/Qwen2/Qwen3 LoRA models). false, or any other model: each
    # batch runs as padded chunks (backends/local/batching.py). Both compute the same numbers to float rounding.
    packed: bool = True
    # Attention over a packed chunk (backends/local/packed.py). "auto": the C tree kernel where it is built (float32
    # on the CPU), else torch's SDPA per block: on CUDA that is the path measured working on an H200, and it stays
    # "auto"'s until bench/bench_gpu.py measures "flex" faster (docs/gpu.md). "sdpa": SDPA per block everywhere.
    # "flex": one compiled FlexAttention call per layer over the whole chunk (backends/local/attention.py; CUDA
    # only: it has no CPU backward).
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    # What a sampling client holds. "merged": its own copy of every adapted weight with the LoRA merged in (the
    # fastest decode; a copy of most of the model per client). "lora": the base's own tensors plus a copy of the
    # adapters, applied unmerged (two thin extra matmuls per adapted layer; an extra client costs its adapters).
    # "auto": merged on the CPU in float32 for a base under 1 GiB, else lora (a GPU's memory, a large model's, or
    # bfloat16, where merging rounds away most of a small update).
    sampler_weights: Literal["auto", "merged", "lora"] = "auto"
    # A hub id not in the Hugging Face cache is downloaded on first use (backends/hub.py); true keeps to the cache.
    local_files_only: bool = False

    def __post_init__(self) -> None:
        # FlexAttention is the packed path's (packed.py); the padded chunks never call it, so the option would be
        # silently ignored: say so at `runner check` instead.
        if self.attention == "flex" and not self.packed:
            raise ValueError('attention = "flex" runs on the packed path (backends/local/packed.py) and packed = '
                             'false turns it off: set packed = true, or attention = "auto"')
        if self.attention == "flex" and self.full_finetune:
            raise ValueError('attention = "flex" runs on the packed path (backends/local/packed.py), which trains LoRA '
                             'adapters only: a full fine-tune runs padded chunks; use attention = "auto"')
