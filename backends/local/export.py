"""Export a local-backend sampler checkpoint (`runner export`): a PEFT adapter folder that stays exact under
`PeftModel.merge_and_unload()`, or a plain merged Hugging Face model folder. Runs on the CPU, in the base
model's own dtype unless --dtype says otherwise: merging into bfloat16 weights rounds the update (W + s B A) to
bfloat16, and export then prints what that costs in logprobs (docs/export.md gives the measured figures).

The problem (issue #9): with tied embeddings (the tiny model; most small Qwen / Llama models) lm_head and the
input embedding are ONE tensor. The sampler checkpoints hold a LoRA on lm_head (train_unembed = true), and
peft's merge_and_unload adds its delta into that shared tensor, so the merged model's input embeddings change
too (logits off by 9-37 on the tiny model after a few steps; peft only warns). The backend's own sampler
unties lm_head before merging (model.sampling_copy), but a user merging the raw adapter does not.

What export writes for such an adapter: the lm_head LoRA becomes a full `modules_to_save` lm_head weight
W + scale·B·A; every other LoRA stays as it is. peft wraps a modules_to_save layer in a copy of it, so the
adapter model computes the same logits, and merge_and_unload swaps in that copy as an untied lm_head and
leaves the input embedding alone. Chosen because it is the only form that plain peft loads and merges
correctly without a patched base: the tensor is shared, so no LoRA delta can be merged into lm_head alone,
and a canceling embed_tokens LoRA would be merged into the same tensor too. The price is a vocab x hidden
tensor in the adapter file (1.2 GB in bf16 for a 152k x 4096 model), which is why the sampler checkpoints
written during training stay plain LoRA. An untied lm_head LoRA merges into lm_head's own weight, so such
adapters are copied unchanged.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from backends.errors import UserError
from backends.local import model as M

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# `runner export --dtype`: what the base is loaded in, so what merged weights (and a tied lm_head's full weight) are
# rounded to and stored in. "auto": the dtype the base's files store (a real chat model's: bfloat16).
DTYPES = ("auto", "float32", "bfloat16")
# The probe a rounding merge is measured on (merged model vs the adapter model, max |dlogprob| of its tokens).
PROBE = "The quick brown fox jumps over the lazy dog. 12 + 30 = 42, and the answer is yes."


def export(sampler_dir: Path, out: Path, model: str, tokenizer: str | None = None, merged: bool = False,
           dtype: str = "auto") -> str:
    """Write the sampler checkpoint `sampler_dir` of a run on base `model` (its recipe's model / tokenizer)
    to the new folder `out`, with the run's tokenizer (and chat template) alongside. merged=False: a PEFT
    adapter folder; merged=True, or a full fine-tune's checkpoint: a Hugging Face model folder. dtype (DTYPES):
    the base is loaded, merged into and saved in it. Returns what was written (a merge that rounds to bfloat16:
    a second line with its measured cost). Nothing is written on error."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    sampler_dir = Path(sampler_dir)
    if out.is_symlink():  # the write is a rename onto OUT, which a link (even to an empty folder) refuses
        raise UserError(f"{out} is a symbolic link; export writes a new folder: name the folder itself")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; export never overwrites")
    is_adapter = (sampler_dir / "adapter_config.json").is_file()
    if not is_adapter and not (sampler_dir / "config.json").is_file():
        raise UserError(f"{sampler_dir} is neither a PEFT adapter folder nor a Hugging Face model folder")
    model_dir = M.resolve_model_dir(model)
    tokenizer_dir = M.resolve_tokenizer_dir(tokenizer) if tokenizer else model_dir
    tok = _load_tokenizer(tokenizer_dir)

    def copy_as_is(tmp: Path) -> None:
        for f in sampler_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)
        tok.save_pretrained(tmp)

    if not is_adapter:
        # A full fine-tune: its sampler folder is already a model folder (model.save_pretrained, which keeps
        # a tied model tied: training updated the one shared tensor), only the tokenizer is missing.
        _write_new(out, copy_as_is)
        note = f"; --dtype {dtype} ignored: its weights are copied as trained" if dtype != "auto" else ""
        return f"wrote a Hugging Face model folder to {out} (a full fine-tune: there is no adapter{note})"

    import peft

    base = _load_base(model_dir, dtype)
    stored = next(base.parameters()).dtype
    with M._quiet_peft():
        adapted = peft.PeftModel.from_pretrained(base, sampler_dir)
    adapted.eval()
    lm_head = _tied_lm_head_lora(adapted)
    ids = tok(PROBE)["input_ids"]
    rounds = stored != torch.float32 and (merged or lm_head is not None)  # a merge into weights below float32
    want = _logprobs(adapted, ids) if rounds else None  # taken before a merge consumes `adapted`
    drift: list[float] = []
    if merged:
        _write_new(out, lambda tmp: drift.extend(_save_merged(adapted, lm_head is not None, tok, tmp, ids, want)))
        line = f"wrote a merged Hugging Face model folder to {out} ({_dtype_name(stored)})"
        what = "the merged weights are"
    elif lm_head is None:
        _write_new(out, copy_as_is)
        return f"wrote a PEFT adapter to {out} (copied as is: it merges exactly)"
    else:
        _write_new(out, lambda tmp: drift.extend(_save_untied_adapter(adapted, lm_head, tok, tmp, ids, want)))
        line = (f"wrote a PEFT adapter to {out} (the tied lm_head's LoRA stored as a full lm_head in "
                "modules_to_save, so merge_and_unload leaves the input embeddings alone)")
        what = "that lm_head is"
    if drift:
        line += (f"\n{what} rounded to {_dtype_name(stored)}: max |dlogprob| {drift[0]:.3g} vs the adapter on the "
                 f"{_dtype_name(stored)} base, on a probe text; --dtype float32 keeps it exact (~1e-5, files larger; "
                 "docs/export.md)")
    return line


# ---------------------------------------------------------------- helpers


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _logprobs(model: nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, in float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _load_base(model_dir: Path, dtype: str = "auto") -> M.HFModel:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    want: str | torch.dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    base: PreTrainedModel = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=want)
    base.eval()
    base.requires_grad_(False)
    return base


def _load_tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    except Exception as exc:  # a folder without a usable tokenizer is the user's
        raise UserError(f"cannot load a tokenizer from {tokenizer_dir}: {exc}") from exc


def _write_new(out: Path, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling folder, then rename it to `out`: a failure leaves nothing behind."""
    try:  # runner export checks the folder first (runner/cli.py); what only trying finds (/proc, a full disk) is here
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise UserError(f"{out}: cannot create a folder there ({e.strerror or e})") from None
    try:
        write(tmp)
        if out.is_dir():  # empty (checked by export)
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tied_lm_head_lora(adapted: PeftModel) -> tuple[str, LoraLinear] | None:
    """(module name, peft LoRA layer) of the output embedding when it has a LoRA and shares its weight
    with the input embedding; else None."""
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import PreTrainedModel

    inner = adapted.get_base_model()
    assert isinstance(inner, PreTrainedModel)  # what _load_base loaded, under peft's LoRA layers
    out_emb = inner.get_output_embeddings()
    if not isinstance(out_emb, LoraLinear) or out_emb.base_layer.weight is not inner.get_input_embeddings().weight:
        return None
    name = next(n for n, m in inner.named_modules() if m is out_emb)
    return name, out_emb


def _save_untied_adapter(adapted: PeftModel, lm_head: tuple[str, LoraLinear], tok: PreTrainedTokenizerBase, path: Path,
                         ids: list[int] | None = None, want: torch.Tensor | None = None) -> list[float]:
    """Save `adapted` with its tied lm_head LoRA turned into a full modules_to_save lm_head (module doc). want: the
    adapter model's logprobs of ids; given, the saved adapter's max |dlogprob| from them is returned ([] otherwise)."""
    import peft
    from peft.tuners.lora import LoraLayer

    name, layer = lm_head
    head = layer.get_base_layer()
    assert isinstance(head, nn.Linear)  # the lm_head under its LoRA
    weight = head.weight
    with torch.no_grad():
        full = (weight.float() + layer.get_delta_weight("default").float()).to(weight.dtype)
    state = peft.get_peft_model_state_dict(adapted, save_embedding_layers=False)
    prefix = f"base_model.model.{name}."
    state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    state[f"{prefix}weight"] = full  # the key peft saves a modules_to_save layer under
    # A peft LoraConfig. Any: its target_modules is a set once built (__post_init__), as peft reads and saves it,
    # which its annotation (list[str] | str | None) does not say; the sets written here are what peft would build.
    config: Any = copy.deepcopy(adapted.peft_config["default"])
    leaf = name.rsplit(".", 1)[-1]
    config.target_modules = {t for t in config.target_modules if t not in (leaf, name)}
    config.modules_to_save = [leaf]
    base = adapted.unload()  # the base again, lm_head tied as loaded
    placeholder = None
    if not config.target_modules:
        # Only lm_head was trained. peft refuses an adapter without a LoRA layer, so one Linear gets an
        # all-zero LoRA (delta exactly 0: the same logits, merged or not).
        placeholder = next(n for n, m in base.named_modules()
                           if isinstance(m, nn.Linear) and m is not base.get_output_embeddings())
        config.target_modules = {placeholder}
    with M._quiet_peft():
        new = peft.get_peft_model(base, config)
    result = peft.set_peft_model_state_dict(new, state)
    # A peft whose key layout differs: fail loudly rather than save a wrong adapter.
    missed = [k for k in result.missing_keys if ("lora_" in k or "modules_to_save" in k)
              and (placeholder is None or f".{placeholder}." not in k)]
    if result.unexpected_keys or missed:
        raise RuntimeError(f"export: peft did not take adapter weights {(result.unexpected_keys + missed)[:3]}")
    if placeholder is not None:
        zeroed = new.get_base_model().get_submodule(placeholder)
        assert isinstance(zeroed, LoraLayer)
        with torch.no_grad():
            for p in (*zeroed.lora_A.parameters(), *zeroed.lora_B.parameters()):
                p.zero_()
    drift = [] if want is None or ids is None else [float((_logprobs(new.eval(), ids) - want).abs().max())]
    new.save_pretrained(str(path))
    tok.save_pretrained(path)
    return drift


def _save_merged(adapted: PeftModel, tied_lora: bool, tok: PreTrainedTokenizerBase, path: Path, ids: list[int] | None = None,
                 want: torch.Tensor | None = None) -> list[float]:
    """LoRA merged into the weights. model.sampling_copy unties a tied lm_head that has a LoRA (tied_lora)
    before merging, and marks the config untied; if lm_head came out equal to the input embeddings anyway
    (an untrained LoRA, B = 0), it is tied again, as in the base. want: the adapter model's logprobs of ids;
    given, the merged model's max |dlogprob| from them is returned ([] otherwise)."""
    merged = M.sampling_copy(adapted, private=True)
    drift = [] if want is None or ids is None else [float((_logprobs(merged, ids) - want).abs().max())]
    emb_in, emb_out = merged.get_input_embeddings(), merged.get_output_embeddings()
    if tied_lora and torch.equal(emb_out.weight, emb_in.weight):
        emb_out.weight = emb_in.weight
        merged.config.tie_word_embeddings = True
    merged.save_pretrained(path)
    tok.save_pretrained(path)
    return drift
