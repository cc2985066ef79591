"""Where the local backend runs and in which dtypes: the one place both are decided.

`place(cfg, model_dir)` gives a `Placement`, and every tensor a local client creates takes its device and dtype
from it (docs/local-backend.md, "Device and dtype"):
- `dtype`: the frozen base weights, every activation, the KV cache, and a merged sampling snapshot's weights;
- `adapter_dtype` (always float32): LoRA A/B as trained (and AdamW's moments of them), the copies an unmerged
  sampling snapshot keeps, and the arithmetic of their term, which is added to the base's output in float32 and
  cast back, as peft's own forward does, so the trainer (peft or backends/local/packed.py) and the sampler
  compute one thing;
- `logits_dtype` (float32): logits are cast to it before any logprob, loss or sampling distribution.
Merging a LoRA into a bfloat16 weight (`merged_weight`) computes W + s B A in float32 and rounds once.
A full fine-tune trains the base's own tensors, in `dtype`.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from backends.errors import UserError
from backends.local.options import LocalOptions

# device = "auto" keeps a model with fewer parameters than this on the CPU even where CUDA exists: for such a model
# a forward is a few hundred tiny kernels, and launching them costs more than the CPU takes to do the arithmetic
# (issue #28, one H200: the embedded 0.82M-parameter model's sl_basic took 1.7-2 s per step on cuda; all 60 steps
# take 18 s on 2 CPU cores, bench/results/recipes.md). Every real chat model (0.5B parameters and up) is far above
# it; where between the two the GPU starts to win is not measured yet (bench/gpu_check.py puts the recipes' cuda
# wall times next to the CPU ones).
CPU_MAX_PARAMS = 50_000_000
# Set to "cpu" or "cuda": what device = "auto" picks in this process, whatever the model (bench/gpu_check.py smokes
# every recipe on cuda with it, where "auto" would keep their small stand-in models on the CPU). A recipe's
# explicit device is never overridden.
DEVICE_ENV = "RUNNER_LOCAL_DEVICE"


class AutogradCtx(Protocol):
    """What the torch.autograd.Functions here (llama.py, logprobs.py, packed.py) use of the ctx their forward and
    backward get (torch types it Any). Each Function's own Protocol, extending this one, declares what its forward
    saves (`saved_tensors`, as the backward reads it back) and keeps on the ctx."""

    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None: ...

    def set_materialize_grads(self, value: bool) -> None: ...


# LoRA A/B as trained (and AdamW's moments of them), the copies an unmerged sampling snapshot keeps, and the
# arithmetic of their term: float32 whatever the base's dtype (peft's own choice too: autocast_adapter_dtype).
ADAPTER_DTYPE = torch.float32
# Logits are cast to this before any logprob, loss or sampling distribution is computed from them.
LOGITS_DTYPE = torch.float32


@dataclass(frozen=True)
class Placement:
    device: torch.device
    dtype: torch.dtype  # base weights, activations, KV cache, merged sampling weights
    reason: str  # why this device and dtype, one line (the run's first lines and --dry-run print it)
    adapter_dtype: torch.dtype = ADAPTER_DTYPE
    logits_dtype: torch.dtype = LOGITS_DTYPE

    def describe(self) -> str:
        return f"{self.device.type} {str(self.dtype).removeprefix('torch.')} ({self.reason})"


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, transposed: bool) -> torch.Tensor:
    """W + scale * B @ A as a new tensor of W's dtype. transposed=True: written as the contiguous (in, out) matrix
    and returned as its .t() view (the layout llama._transposed multiplies fastest). All float32: one addmm.
    Else the sum is taken in ADAPTER_DTYPE and rounded to W's dtype once."""
    if w.dtype == a.dtype == b.dtype:
        if transposed:  # (W + s B A)^T = W^T + s A^T B^T
            return torch.addmm(w.t(), a.t(), b.t(), alpha=scale).t()
        return torch.addmm(w, b, a, alpha=scale)
    hi = ADAPTER_DTYPE
    if transposed:
        return torch.addmm(w.t().to(hi), a.t().to(hi), b.t().to(hi), alpha=scale).to(w.dtype).t()
    return torch.addmm(w.to(hi), b.to(hi), a.to(hi), alpha=scale).to(w.dtype)


def add_adapter_term(y: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """y + scale * (x @ A^T) @ B^T with A^T, B^T given as a_t (in, r) and b_t (r, out): the LoRA term of an
    adapted Linear whose base output is y. Adapters in another dtype than y: x is cast to theirs, the sum taken
    in it and cast back to y's dtype, which is what peft's LoRA forward computes (so a sampler applying
    adapters unmerged gives the trainer's numbers)."""
    if a_t.dtype == y.dtype:
        return y + torch.mm(torch.mm(x, a_t), b_t) * scale if x.dim() == 2 else y + (x @ a_t @ b_t) * scale
    hi = a_t.dtype
    xh = x.to(hi)
    term = torch.mm(torch.mm(xh, a_t), b_t) if x.dim() == 2 else xh @ a_t @ b_t
    return (y.to(hi) + term * scale).to(y.dtype)


def model_parameters(model_dir: Path) -> int | None:
    """The parameter count of a Hugging Face model folder, read from its safetensors headers (nothing is loaded);
    None when it has no safetensors weights or they cannot be read."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for f in files:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
            for name, info in header.items():
                if name != "__metadata__":
                    count = 1
                    for d in info["shape"]:
                        count *= int(d)
                    total += count
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n < 1e9 else f"{n / 1e9:.1f}B"


def place(cfg: LocalOptions, model_dir: Path | None = None, cuda: bool | None = None) -> Placement:
    """cfg.device "auto": cuda when available, unless the model (model_dir) has under CPU_MAX_PARAMS parameters;
    else cpu. cfg.dtype "auto": bfloat16 on cuda (fast, and what Tinker serves), float32 on cpu (bit-for-bit
    reproducible runs and exact resume). `cuda`: whether CUDA is available (None: ask torch; tests pass it)."""
    has_cuda = torch.cuda.is_available() if cuda is None else cuda
    forced = os.environ.get(DEVICE_ENV, "")
    if cfg.device == "auto" and forced:
        if forced not in ("cpu", "cuda"):
            raise UserError(f"{DEVICE_ENV}={forced!r}: expected cpu or cuda")
        if forced == "cuda" and not has_cuda:
            raise UserError(f"{DEVICE_ENV}=cuda but torch sees no CUDA device")
        device, why = forced, f"auto, set by {DEVICE_ENV}={forced}"
    elif cfg.device == "auto":
        params = model_parameters(model_dir) if model_dir is not None else None
        if not has_cuda:
            device, why = "cpu", "auto: no CUDA device"
        elif params is not None and params < CPU_MAX_PARAMS:
            device, why = "cpu", (f"auto: {_millions(params)} parameters, under {_millions(CPU_MAX_PARAMS)}: the CPU "
                                  "runs a model this small faster than launching its GPU kernels")
        else:
            size = f"{_millions(params)} parameters" if params is not None else "a model of unknown size"
            device, why = "cuda", f"auto: {size} on a CUDA device"
    elif cfg.device == "cuda" and not has_cuda:
        raise UserError('backend.device = "cuda" but torch sees no CUDA device; use "auto" or "cpu"')
    else:
        device, why = cfg.device, f"device = {cfg.device!r}"
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        why += "; dtype auto: " + ("bfloat16 on cuda" if device == "cuda" else "float32 on cpu, exactly reproducible")
    else:
        dtype = getattr(torch, cfg.dtype)
        why += f"; dtype = {cfg.dtype!r}"
    return Placement(torch.device(device), dtype, why)


def pick_device(cfg: LocalOptions, model_dir: Path | None = None) -> tuple[torch.device, torch.dtype]:
    p = place(cfg, model_dir)
    return p.device, p.dtype
