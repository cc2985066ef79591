"""Models for the local backend: find and load the base, wrap it for training, snapshot it for sampling,
and read/write the checkpoint folders.

Training copies never share modules with the base model, so the base stays pristine: it serves as the
reference model (create_sampling_client(base_model=...)) and as the template for every new client.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from backends.errors import UserError
from backends.local.device import ADAPTER_DTYPE, merged_weight

ATTN_KEYS = ("attn", "attention")
MLP_KEYS = ("mlp", "feed_forward", "ffn", "experts")


# ---------------------------------------------------------------- finding models


# A transformers PreTrainedModel (or a peft wrapper of one). Typed Any: its methods (get_input_embeddings,
# save_pretrained, ...) come through nn.Module's dynamic attributes, which type checkers cannot follow.
HFModel = Any


def vocab_size(model: HFModel) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def resolve_model_dir(model: str, local_files_only: bool = False) -> Path:
    """"tiny" -> the embedded model; an existing folder; else a hub id: its folder in the Hugging Face cache,
    downloaded there on first use unless HF_HUB_OFFLINE=1 (backends/hub.py)."""
    if model == "tiny":
        from backends.local.tiny import TINY_DIR

        return TINY_DIR
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model folder {model!r} has no config.json (expected a Hugging Face model folder)")
        return path.resolve()
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise UserError(f"model folder {model!r} does not exist")
    return _cached_snapshot(model, "model", "config.json", local_files_only)


def resolve_tokenizer_dir(tokenizer: str, local_files_only: bool = False) -> Path:
    if tokenizer == "tiny":
        return resolve_model_dir("tiny")
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path.resolve()
    if tokenizer.startswith((".", "/", "~")) or tokenizer.count("/") > 1:
        raise UserError(f"tokenizer folder {tokenizer!r} does not exist")
    return _cached_snapshot(tokenizer, "tokenizer", "tokenizer_config.json", local_files_only)


def _cached_snapshot(repo_id: str, what: str, must_have: str, local_files_only: bool = False) -> Path:
    """A hub id's folder in the Hugging Face cache, downloaded there on first use (backends/hub.py)."""
    from backends.hub import snapshot

    path = snapshot(repo_id, what, local_files_only)
    if not (path / must_have).is_file():
        raise UserError(f"{what} {repo_id!r} in the Hugging Face cache has no {must_have}")
    return path


def load_base(path: Path, device: torch.device, dtype: torch.dtype) -> HFModel:
    """The frozen base model, in eval mode (no dropout: training here is deterministic, as on Tinker)."""
    import transformers

    # transformers draws a "Loading weights" bar on stderr; our own progress line is the one to read.
    transformers.utils.logging.disable_progress_bar()
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def lora_linear_parts(layer: object) -> tuple[nn.Linear, torch.Tensor, torch.Tensor, float] | str:
    """(frozen base Linear, A, B, scale) of a plain peft LoRA Linear with one active adapter, or why it is not
    one (several adapters, merged or disabled, DoRA, LoRA bias, fan_in_fan_out, non-Linear parts)."""
    from peft.tuners.lora import Linear as LoraLinear

    m = layer
    if type(m) is not LoraLinear:
        return f"{type(m).__name__} is not a plain LoRA Linear"
    names = list(m.active_adapters)
    if len(names) != 1:
        return "more than one active LoRA adapter"
    ad = names[0]
    if m.merged or m.disable_adapters or m.fan_in_fan_out:
        return "merged, disabled or fan_in_fan_out adapter"
    if m.use_dora.get(ad) or getattr(m, "lora_bias", {}).get(ad):
        return "DoRA / LoRA bias"
    base, a, b = m.get_base_layer(), m.lora_A[ad], m.lora_B[ad]
    if type(base) is not nn.Linear or type(a) is not nn.Linear or type(b) is not nn.Linear:
        return "LoRA over or made of something else than Linear layers"
    return base, a.weight, b.weight, float(m.scaling[ad])


# ---------------------------------------------------------------- what gets trained


@dataclass(frozen=True)
class TrainSetup:
    """Everything that fixes the trainable parameter set; stored in checkpoints to rebuild it exactly."""

    rank: int  # 0 = full fine-tune
    lora_alpha: float
    targets: tuple[str, ...]  # module names that get a LoRA adapter (empty for full fine-tune)


def lora_targets(model: HFModel, attn: bool, mlp: bool, unembed: bool) -> tuple[str, ...]:
    """Names of the Linear layers to adapt. Attention / MLP layers are recognised by a path component
    (self_attn, mlp, ...), the unembedding as the model's output embedding (lm_head). With tied
    embeddings the lm_head adapter acts on the output side only; the input embedding stays frozen.
    Weights that are not nn.Linear modules (e.g. fused MoE expert tensors) get no adapter."""
    out_emb = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        parts = name.lower().split(".")
        if module is out_emb:
            take = unembed
        elif any(k in p for p in parts for k in ATTN_KEYS):
            take = attn
        elif any(k in p for p in parts for k in MLP_KEYS):
            take = mlp
        else:
            take = False
        if take:
            names.append(name)
    if not names:
        raise UserError(
            f"no Linear layer of {type(model).__name__} matches the LoRA targets "
            f"(train_attn={attn}, train_mlp={mlp}, train_unembed={unembed})"
        )
    return tuple(names)


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """peft warns when lm_head is adapted while tied to the input embeddings. Here the adapter acts on the
    output side only and sampling_copy unties before merging, so the warning does not apply. The other
    one is peft calling a transformers 5 deprecated name."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def shared_copy(base: nn.Module) -> nn.Module:
    """A new module tree over the same frozen weight tensors, so a LoRA client costs only its adapters.
    Nothing writes to those tensors: training touches adapters only and sampling_copy merges into a
    deep copy."""
    return copy.deepcopy(base, memo={id(t): t for t in (*base.parameters(), *base.buffers())})


def make_trainable(base: nn.Module, setup: TrainSetup, seed: int) -> nn.Module:
    """A private copy of `base` with its trainable parameters switched on: a peft LoRA model (A seeded by
    `seed` without touching the global RNG; B = 0, so it starts equal to the base), or every weight."""
    if setup.rank == 0:
        model = copy.deepcopy(base)
        model.requires_grad_(True)
        return model
    import peft

    model = shared_copy(base)

    config = peft.LoraConfig(
        r=setup.rank,
        lora_alpha=cast(Any, setup.lora_alpha),  # a float; peft's annotation says int
        target_modules=list(setup.targets),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # peft creates adapter weights on the CPU and moves them to the base layer's device, so forking the
    # CPU generator is enough; the cuda one is forked too in case a version initialises in place.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices), _quiet_peft():
        torch.manual_seed(seed)
        model = peft.get_peft_model(model, config)
    _adapters_to(model, ADAPTER_DTYPE)
    model.eval()
    return model


def _adapters_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Every LoRA A/B tensor of `model` in `dtype` (backends/local/device.py ADAPTER_DTYPE: float32 under any
    base). peft upcasts them itself by default (autocast_adapter_dtype); this makes it this backend's rule, not
    a peft default a version could change."""
    for name, p in model.named_parameters():
        if ("lora_A" in name or "lora_B" in name) and p.dtype != dtype:
            p.data = p.data.to(dtype)


def load_adapter(base: nn.Module, path: Path) -> HFModel:
    """A copy of `base` with the PEFT adapter folder `path` applied (not merged). A full copy unless it is a plain
    LoRA adapter: a folder that also carries base weights (modules_to_save) must not leak them into `base`."""
    import peft

    config = peft.PeftConfig.from_pretrained(str(path))
    # A plain LoRA adapter only wraps layers: the copy may share base's frozen tensors (shared_copy), which lets
    # sampling_snapshot build its sampler as for a training client's snapshot. Anything that may write base
    # weights or bring its own (modules_to_save, trainable tokens, PiSSA/OLoRA-style inits) gets a full copy.
    plain = (isinstance(config, peft.LoraConfig) and not config.modules_to_save
             and not getattr(config, "trainable_token_indices", None)
             and getattr(config, "init_lora_weights", True) in (True, False, "gaussian"))
    own = shared_copy(base) if plain else copy.deepcopy(base)
    with _quiet_peft():
        model = peft.PeftModel.from_pretrained(own, path)
    _adapters_to(model, ADAPTER_DTYPE)
    model.eval()
    return model


def trainable_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of everything trained, in a fixed order (the optimizer's and the checkpoint's)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def sampling_copy(model: HFModel, private: bool = False) -> HFModel:
    """An immutable plain HF model with the current weights: LoRA merged in, eval mode, no grads.
    private=True: `model` is a throwaway copy already, merge into it instead of copying again."""
    snap = model if private else copy.deepcopy(model)
    import peft

    if isinstance(snap, peft.PeftModel):
        inner: HFModel = snap.get_base_model()
        out = inner.get_output_embeddings()
        base_layer = getattr(out, "base_layer", None)
        if base_layer is not None and base_layer.weight is inner.get_input_embeddings().weight:
            # Tied embeddings with an adapted lm_head: merging into the shared tensor would also change
            # the input embeddings. Give lm_head its own copy first.
            base_layer.weight = nn.Parameter(base_layer.weight.detach().clone(), requires_grad=False)
            inner.config.tie_word_embeddings = False
        with _quiet_peft():
            snap = snap.merge_and_unload()
    snap.eval()
    for p in snap.parameters():
        p.requires_grad_(False)
        p.grad = None
    return snap


def sampling_snapshot(model: HFModel, base: HFModel, merge: bool = True, private: bool = False) -> HFModel:
    """sampling_copy of a LoRA model that make_trainable built on `base`, without copying the model: a new
    module tree over base's frozen tensors (shared_copy), in which each adapted Linear layer gets its merged
    weight W + scale * B @ A as a new tensor. Nothing is deep-copied and peft's merge_and_unload (which
    needs a private copy to merge into) is not run; untouched weights stay shared with the frozen base,
    which nothing writes. One addmm makes each merged tensor, in the layout the sampler's fast path wants
    for it (llama.packs_for_onednn): as stored by default for the large weights it packs for oneDNN, else
    transposed (a contiguous (in, out) matrix, the parameter being its .t() view; llama._transposed), so
    it needs no further transposing copy. A tied lm_head with an adapter gets
    its own merged tensor; the input embeddings stay the base's. Anything this does not recognise exactly
    (not a peft LoRA model, DoRA, fan_in_fan_out, several adapters, weights that are no longer the base's)
    takes sampling_copy (private: `model` is a throwaway copy, see sampling_copy).

    merge=False: no merged tensors either: each adapted layer becomes a LoraDelta over the base's own Linear, so
    the snapshot holds the base's tensors plus a copy of the adapters (what an extra sampling client costs; a
    merged one costs every adapted weight again). A decode step then does two thin extra matmuls per adapted
    layer (backends/local/local_config.py `sampler_weights` says when which is chosen)."""
    import peft
    from peft.tuners.lora import LoraLayer

    from backends.local.llama import LoraDelta, packs_for_onednn

    if not isinstance(model, peft.PeftModel):
        return sampling_copy(model, private)
    inner: HFModel = model.get_base_model()
    adapted: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = {}
    for name, m in inner.named_modules():
        if not isinstance(m, LoraLayer):
            continue
        parts = lora_linear_parts(m)
        if isinstance(parts, str):
            return sampling_copy(model, private)
        base_layer, a, b, scale = parts
        adapted[name] = (base_layer.weight, a, b, scale)
    # Every weight must still be the base's own tensor (an adapted layer's through its base_layer).
    for name, p in base.named_parameters():
        module, _, attr = name.rpartition(".")
        if module in adapted:
            ok = attr == "weight" and adapted[module][0] is p
        else:
            try:
                ok = inner.get_parameter(name) is p
            except AttributeError:
                ok = False
        if not ok:
            return sampling_copy(model, private)
    snap: HFModel = shared_copy(base)
    if not merge:
        for name, (_w, a, b, scale) in adapted.items():
            parent, _, attr = name.rpartition(".")
            holder = snap.get_submodule(parent) if parent else snap
            setattr(holder, attr, LoraDelta(snap.get_submodule(name), a, b, scale))  # type: ignore[arg-type]
        snap.eval()
        return snap
    out_emb = snap.get_output_embeddings()
    with torch.no_grad():
        for name, (w, a, b, scale) in adapted.items():
            module = snap.get_submodule(name)
            if module is out_emb:
                snap.config.tie_word_embeddings = False  # lm_head gets its own tensor below
            # In W's dtype (a bfloat16 base: the float32 sum rounded once), in the layout its use wants.
            merged = merged_weight(w, a, b, scale, transposed=not packs_for_onednn(w))
            module.weight = nn.Parameter(merged, requires_grad=False)
    snap.eval()
    return snap


# ---------------------------------------------------------------- checkpoint folders

STATE_FILE, WEIGHTS_FILE, OPTIMIZER_FILE = "state.json", "weights.safetensors", "optimizer.pt"


def write_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, setup: TrainSetup,
                base_model: str, step: int) -> None:
    """Trainable weights + AdamW state (moments and per-parameter step) + our step count: with the frozen
    base, that is all an exact resume needs (training draws no random numbers)."""
    from safetensors.torch import save_file

    params = trainable_params(model)
    save_file({n: p.detach().contiguous().cpu() for n, p in params}, str(path / WEIGHTS_FILE))
    torch.save(optimizer.state_dict(), path / OPTIMIZER_FILE)
    meta = {"base_model": base_model, "step": step, "setup": asdict(setup), "params": [n for n, _ in params]}
    (path / STATE_FILE).write_text(json.dumps(meta, indent=1))


def write_weights_only(path: Path, weights: dict[str, torch.Tensor], setup: TrainSetup, base_model: str,
                       step: int) -> None:
    """A state folder without optimizer state (from LocalTrainingClient.trained_weights): enough to sample from
    (LocalBackend.create_sampling_client(model_path=path)), not to resume training."""
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in weights.items()}, str(path / WEIGHTS_FILE))
    meta = {"base_model": base_model, "step": step, "setup": asdict(setup), "params": list(weights)}
    (path / STATE_FILE).write_text(json.dumps(meta, indent=1))


def read_state_meta(path: Path) -> dict:
    try:
        return json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is not a local save_state checkpoint (no readable {STATE_FILE})") from exc


def setup_from_meta(meta: dict) -> TrainSetup:
    s = meta["setup"]
    return TrainSetup(int(s["rank"]), float(s["lora_alpha"]), tuple(s["targets"]))


def load_weights(path: Path, model: nn.Module) -> None:
    """Copy saved trainable weights into `model` (same trainable set, by name)."""
    from safetensors.torch import load_file

    saved = load_file(str(path / WEIGHTS_FILE))
    params = dict(trainable_params(model))
    if set(saved) != set(params):
        raise ValueError(f"{path}: saved weights do not match this model's trainable parameters")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(saved[name])


def load_optimizer(path: Path, optimizer: torch.optim.Optimizer) -> None:
    optimizer.load_state_dict(torch.load(path / OPTIMIZER_FILE, weights_only=True))


def write_sampler_weights(path: Path, model: HFModel) -> None:
    """PEFT adapter folder (loadable with peft.PeftModel.from_pretrained(base, path)), or for a full
    fine-tune an ordinary HF model folder. A LoRA on a tied lm_head is kept as plain LoRA here, to keep
    periodic checkpoints small, so peft's merge_and_unload would break such an adapter (it merges into the
    tensor shared with the input embeddings); `runner export` (backends/local/export.py) writes a
    mergeable copy."""
    import peft

    if isinstance(model, peft.PeftModel):
        # save_embedding_layers=False: peft would otherwise copy the whole (tied) lm_head weight into the
        # adapter file because lm_head is a target; the base already has it.
        model.save_pretrained(str(path), save_embedding_layers=False)
    else:
        model.save_pretrained(path)
