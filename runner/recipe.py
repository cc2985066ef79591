"""The whole recipe schema, and the only reader of recipe TOML.

A recipe file holds named recipes under `[recipes.<name>]`; `FILE#name` selects one. Each table is
decoded on its own with msgspec (unknown keys forbidden, tagged unions for every choice, limits in the
types), so an error names the file, the recipe and the key path. Overrides `a.b=value` are merged into
the raw table before decoding, so they get the same checks. Precedence: CLI > recipe > defaults.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
Frac = Annotated[float, Meta(ge=0, le=1)]


class Base(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


# ---------------------------------------------------------------- backends

class BackendBase(Base, tag_field="kind", tag=str.lower):
    pass


class Local(BackendBase):
    """In-process torch trainer and sampler (backends/local)."""

    # "auto": cuda if available, else cpu. Chosen in one place: backends/local/device.py.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # "auto": bfloat16 on cuda, float32 on cpu (bit-for-bit reproducible there).
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # LoRA scaling numerator (scale = alpha / rank); Tinker does not expose it.
    lora_alpha: PosFloat = 32.0
    # Train every weight instead of a LoRA adapter (local only; Tinker trains LoRA).
    full_finetune: bool = False


class Tinker(BackendBase):
    """The hosted Tinker service or any Tinker-compatible server (backends/tinker.py)."""

    # None: $TINKER_BASE_URL, else the SDK's default (hosted service). The API key comes from
    # $TINKER_API_KEY only and is never written anywhere.
    base_url: str | None = None
    # Lifetime of periodic checkpoints on the service; the final checkpoint never expires.
    ttl_seconds: Annotated[int, Meta(ge=3600)] | None = 7 * 24 * 3600


# ---------------------------------------------------------------- model, LoRA, optimizer, schedule

class LoRA(Base):
    rank: PosInt = 32
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    def __post_init__(self) -> None:
        if not (self.train_attn or self.train_mlp or self.train_unembed):
            raise ValueError("at least one of train_attn, train_mlp, train_unembed must be true")


class Optim(Base):
    """AdamW. Defaults are Tinker's (eps 1e-12; the cookbook uses 1e-8)."""

    beta1: Annotated[float, Meta(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Meta(ge=0, lt=1)] = 0.95
    eps: Annotated[float, Meta(ge=0)] = 1e-12
    weight_decay: Annotated[float, Meta(ge=0)] = 0.0
    # Global-norm clip; 0 = off.
    grad_clip_norm: Annotated[float, Meta(ge=0)] = 0.0


class ScheduleBase(Base, tag_field="kind", tag=str.lower):
    # Linear ramp from 0 to lr over the first warmup_steps steps.
    warmup_steps: NonNegInt = 0


class Constant(ScheduleBase):
    pass


class Linear(ScheduleBase):
    """Decays linearly to final_frac·lr at the last step (the cookbook's default, with final_frac 0)."""

    final_frac: Frac = 0.0


class Cosine(ScheduleBase):
    final_frac: Frac = 0.0


Schedule = Constant | Linear | Cosine


# ---------------------------------------------------------------- data sources

class DataBase(Base, tag_field="kind", tag=str.lower):
    pass


class Jsonl(DataBase):
    """A local JSONL file, one example per line; relative paths are relative to the working directory."""

    path: str


class HF(DataBase):
    """A Hugging Face dataset by hub name (needs the hub, or its offline cache) or a local dataset folder."""

    name: str
    split: str = "train"
    subset: str | None = None


class Python(DataBase):
    """User code: `target = "pkg.mod:fn"`, called as fn(**args); imported and checked by `runner check`."""

    target: Annotated[str, Meta(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]
    args: dict[str, Any] = {}


DataSource = Jsonl | HF | Python


# ---------------------------------------------------------------- algorithms

class AlgoBase(Base, tag_field="kind", tag=str.lower):
    pass


class SFT(AlgoBase):
    """Supervised fine-tuning on conversations: {"messages": [{"role", "content"}, ...]} per row."""

    data: DataSource
    # Conversations per step.
    batch_size: PosInt = 16
    epochs: PosInt = 1
    # Truncate rendered conversations (tokens) from the right.
    max_length: PosInt | None = 1024
    train_on_what: Literal["last_assistant_message", "all_assistant_messages", "all_messages"] = (
        "all_assistant_messages"
    )
    # "mean": each conversation's token weights sum to 1 (the cookbook's default); "none": 1 per token.
    reduction: Literal["mean", "none"] = "mean"
    # Rows held out (after the seeded shuffle) for the eval NLL; 0 = no eval.
    test_size: NonNegInt = 0


Algo = SFT


# ---------------------------------------------------------------- the recipe

class Recipe(Base):
    # ---- Core
    algo: Algo
    # Base model. Local: "tiny" (the embedded default), a Hugging Face model folder, or a cached hub id.
    # Tinker: the service's model name, e.g. "Qwen/Qwen3-8B".
    model: str = "tiny"
    # Tokenizer folder or name when it differs from the model's (e.g. offline use of a Tinker model).
    tokenizer: str | None = None
    backend: Local | Tinker = Local()
    seed: int = 0
    # Peak learning rate.
    lr: PosFloat = 1e-4
    # Cap on optimizer steps (default: every batch of every epoch).
    max_steps: PosInt | None = None
    # Run directory; default runs/<recipe name>.
    log_dir: str | None = None

    # ---- Advanced
    lora: LoRA = LoRA()
    optim: Optim = Optim()
    schedule: Schedule = Linear()
    # Steps submitted ahead of the one being finished; 0 = fully synchronous.
    depth: Annotated[int, Meta(ge=0, le=64)] = 1
    # Steps between evals / checkpoints; 0 = never (a final checkpoint is always written).
    eval_every: NonNegInt = 10
    save_every: NonNegInt = 20
    # An existing run dir: resume it (only if it holds this same recipe), move it aside, or stop.
    if_exists: Literal["resume", "overwrite", "error"] = "resume"
