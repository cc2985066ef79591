"""What live sessions hold, and the caps on it (`runner serve --max-models`, `--max-bytes`).

Bytes are estimated from a served model's shapes (its config, instantiated on torch's meta device: no
weights are read) before anything is allocated, and reserved in one `Memory` ledger:
- a base model: its parameters, once it is loaded (one copy per served model, shared by every client);
- a training run: its LoRA adapters, their gradients and AdamW's two moments, 4 x 4 bytes per adapter
  parameter (`lora_bytes`), held from create_model / load_weights until its session ends;
- a sampling request in flight: its KV cache (num_samples x (prompt + max_tokens) tokens, at most one decode
  chunk of the local sampler: backends/local/sampler.py `_chunks`) plus its logits (`sample_bytes`), held from
  when it starts until it ends, failed or cancelled.
A new run that does not fit is refused at once; a sampling request that does not fit waits in arrival order
for bytes to come back (limits.Budget), and fails once it waited `max_wait_s`. Not counted: the loaded sampling
models of the sampler pool (at most --max-live-samplers of them) and a training step's activations (transient,
one step of one run at a time per served model). docs/serve.md "Memory caps" has the figures.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from backends.serve.replies import ApiError

if TYPE_CHECKING:
    import torch

ADAPTER_COPIES = 4  # the adapter, its gradient, AdamW's exp_avg and exp_avg_sq
FLOAT_BYTES = 4  # adapters, gradients and moments are float32 (and logits are upcast to float32)
LOGIT_COPIES = 3  # the decode step's logits, their scaled/softmaxed copy and the top-p sort
# The sampler's own bookkeeping on top of its KV cache (rows, masks, positions, outputs): measured +15% on tiny
# (bench/bench_serve_memory.py), counted as +25%.
KV_OVERHEAD = 1.25
CPU_CHUNK_BYTES = 2 << 30  # the local sampler's KV cache per decode chunk on the CPU (backends/local/sampler.py)


@dataclass(frozen=True)
class Shapes:
    """A served model's sizes, read from its config."""

    base_params: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int
    # (in_features, out_features) of the Linear layers each LoRA target group adapts
    attn: tuple[tuple[int, int], ...]
    mlp: tuple[tuple[int, int], ...]
    unembed: tuple[tuple[int, int], ...]


@functools.cache
def shapes(path: str) -> Shapes:
    """`path` as `--model` names it ("tiny", a folder, a cached hub id). The model is built on the meta device."""
    import torch
    import transformers

    from backends.local import model as M

    folder = M.resolve_model_dir(path)
    cfg: transformers.PretrainedConfig = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model: torch.nn.Module = transformers.AutoModelForCausalLM.from_config(cfg)
    groups: dict[str, tuple[tuple[int, int], ...]] = {}
    for key, flags in (("attn", (True, False, False)), ("mlp", (False, True, False)), ("unembed", (False, False, True))):
        try:
            names = M.lora_targets(model, *flags)
        except Exception:  # noqa: BLE001 - a model with no such layers (lora_targets raises UserError)
            names = ()
        groups[key] = tuple(_in_out(model.get_submodule(n)) for n in names)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = int(text.num_attention_heads)
    return Shapes(
        base_params=sum(p.numel() for p in model.parameters()),
        layers=int(text.num_hidden_layers),
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        vocab=int(text.vocab_size),
        attn=groups["attn"], mlp=groups["mlp"], unembed=groups["unembed"])


def _in_out(layer: torch.nn.Module) -> tuple[int, int]:
    import torch

    assert isinstance(layer, torch.nn.Linear), type(layer)  # lora_targets names Linear layers only
    return layer.in_features, layer.out_features


def lora_params(s: Shapes, rank: int, attn: bool, mlp: bool, unembed: bool) -> int:
    layers = (s.attn if attn else ()) + (s.mlp if mlp else ()) + (s.unembed if unembed else ())
    return sum(rank * (i + o) for i, o in layers)


def lora_bytes(s: Shapes, rank: int, attn: bool, mlp: bool, unembed: bool) -> int:
    """What a training run holds: adapters + gradients + AdamW moments."""
    return ADAPTER_COPIES * FLOAT_BYTES * lora_params(s, rank, attn, mlp, unembed)


def base_bytes(s: Shapes, dtype_bytes: int) -> int:
    return s.base_params * dtype_bytes


def sample_bytes(s: Shapes, dtype_bytes: int, num_samples: int, prompt: int, max_tokens: int,
                 prompt_logprobs: bool = False, chunk_bytes: int = CPU_CHUNK_BYTES) -> int:
    """A sampling request's peak: the KV cache of its rows (as many as one decode chunk holds, the sampler runs
    the rest after) and their logits; a prompt-logprobs pass holds the prompt's logits."""
    per_token = s.layers * 2 * s.kv_heads * s.head_dim * dtype_bytes
    width = prompt + max_tokens
    rows = max(1, min(num_samples, chunk_bytes // max(1, per_token * width)))
    kv = int(rows * width * per_token * KV_OVERHEAD)
    logits = rows * s.vocab * FLOAT_BYTES * LOGIT_COPIES
    if prompt_logprobs:
        logits = max(logits, prompt * s.vocab * FLOAT_BYTES * LOGIT_COPIES)
    return kv + logits


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def default_max_bytes(device: torch.device | None = None) -> int:
    """On the CPU, half the machine's memory (the rest is the interpreter, torch, the sampler pool and the OS);
    on a CUDA device, 90% of its memory (what the runs' tensors and KV caches live in)."""
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory * 0.9)
    return physical_memory() // 2


def parse_bytes(text: str) -> int:
    """`--max-bytes`: a number of bytes, or with a unit: 512M, 8G, 1.5GiB, 2T (powers of 1024)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if m is None:
        raise ValueError(f"{text!r} is not a size (e.g. 8G, 512M, 1.5GiB or a number of bytes)")
    n = float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2) or " ")))
    if n < 1:
        raise ValueError(f"{text!r}: a size must be at least 1 byte")
    return int(n)


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class Memory:
    """The ledger of live models and bytes held. Keys: "base:<model>", "run:<run_id>"; sampling requests hold
    bytes through limits.Budget, which asks `fits` and calls `take` / `give`."""

    def __init__(self, max_models: int, max_bytes: int):
        self.max_models = max_models
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._held: dict[str, int] = {}
        self.sampling = 0  # bytes of sampling requests in flight

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._held.values()) + self.sampling

    def runs(self) -> int:
        with self._lock:
            return sum(k.startswith("run:") for k in self._held)

    def hold(self, key: str, n: int) -> None:
        """Held whatever the cap (a base model the runs need)."""
        with self._lock:
            self._held[key] = n

    def reserve_run(self, run_id: str, n: int, what: str) -> None:
        """Reserve a new training run's bytes, or refuse it (a 4xx naming the cap and how to raise it)."""
        with self._lock:
            runs = sum(k.startswith("run:") for k in self._held)
            if runs >= self.max_models:
                raise ApiError(400, f"runner serve holds {runs} live training runs, its cap (--max-models "
                                    f"{self.max_models}): end a session (or let it time out) first, or restart "
                                    f"runner serve with a higher --max-models")
            used = sum(self._held.values()) + self.sampling
            if used + n > self.max_bytes:
                raise ApiError(400, f"{what} needs {fmt_bytes(n)} and runner serve holds {fmt_bytes(used)} of its cap "
                                    f"(--max-bytes {fmt_bytes(self.max_bytes)}): use a lower rank, end other sessions, "
                                    f"or restart runner serve with a higher --max-bytes")
            self._held[f"run:{run_id}"] = n

    def resize_run(self, run_id: str, n: int) -> None:
        with self._lock:
            if f"run:{run_id}" in self._held:
                self._held[f"run:{run_id}"] = n

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def take_sampling(self, n: int) -> bool:
        """Reserve n sampling bytes if they fit now."""
        with self._lock:
            if sum(self._held.values()) + self.sampling + n > self.max_bytes:
                return False
            self.sampling += n
            return True

    def give_sampling(self, n: int) -> None:
        with self._lock:
            self.sampling -= n
