"""Where the local backend runs: the one place a device and a dtype are chosen (style.md #16)."""

from __future__ import annotations

import torch

from backends.errors import UserError
from backends.local.options import LocalOptions


def pick_device(cfg: LocalOptions) -> tuple[torch.device, torch.dtype]:
    """cfg.device "auto": cuda if available, else cpu. cfg.dtype "auto": bfloat16 on cuda (fast, and what
    Tinker serves), float32 on cpu (bit-for-bit reproducible runs and exact resume)."""
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    elif cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError('backend.device = "cuda" but torch sees no CUDA device; use "auto" or "cpu"')
    else:
        device = torch.device(cfg.device)
    if cfg.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, cfg.dtype)
    return device, dtype
