"""The local backend's recipe table: `backend = {kind = "local", ...}` (the default)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from msgspec import Meta

from backends.config import BackendConfig

if TYPE_CHECKING:
    from backends.base import Backend


class Local(BackendConfig):
    """In-process torch trainer and sampler (backends/local)."""

    # "auto": cuda if available, else cpu. Chosen in one place: backends/local/device.py.
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
    # What a sampling client holds. "merged": its own copy of every adapted weight with the LoRA merged in (the
    # fastest decode; a copy of most of the model per client). "lora": the base's own tensors plus a copy of the
    # adapters, applied unmerged (two thin extra matmuls per adapted layer; an extra client costs its adapters).
    # "auto": merged on the CPU for a base under 1 GiB, else lora (a GPU's memory, or a large model's).
    sampler_weights: Literal["auto", "merged", "lora"] = "auto"
    # A hub id not in the Hugging Face cache is downloaded on first use (backends/hub.py); true keeps to the cache.
    local_files_only: bool = False

    def make(self, model: str, tokenizer: str | None, storage_dir: Path, seed: int) -> Backend:
        from backends.local.backend import LocalBackend  # torch loads here, not when a recipe is validated

        return LocalBackend(self, model, tokenizer, storage_dir, seed=seed)

    def sweep_parallel(self, cores: int) -> int:
        """On a machine with an NVIDIA GPU (unless device = "cpu"): 1, runs would share the one device. On the CPU:
        half the cores, so each run trains on 2 threads, but at least 2 on a machine with 2 or 3 cores
        (bench/bench_sweep.py, 2 cores: 4 tiny runs take 0.57x the time 2 at a time, 1 thread each, that they take
        one at a time on 2)."""
        if self.device != "cpu" and os.path.exists("/dev/nvidia0"):
            return 1
        return max(min(2, cores), cores // 2)
