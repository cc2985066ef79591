"""`lr = "auto"`: the cookbook's recommended learning rate for a model (tinker_cookbook/hyperparam_utils.py get_lr).

    lr = 5e-5 × (10 for LoRA, 1 for a full fine-tune) × (2000 / hidden_size) ** exponent
    exponent: 0.781 for the Llama family, 0.0775 for Qwen (by name; a local folder by its config's model_type)

hidden_size comes from hidden_sizes() (runner/models.toml: the cookbook's table of Tinker's models, by name, a
":peft:..." suffix ignored), else from a local model folder's config.json (or its text_config), else from the embedded "tiny" model's config
(a Qwen3-style model, hidden 128: lr 6.19e-4). Any other model, and the families the cookbook has not calibrated
(DeepSeek, gpt-oss, Kimi, GLM, Nemotron, ...), is a UserError asking for a number: no network lookup, no guess.

Resolved when the recipe loads (runner/recipe/load.py), so config.toml, sweeps and resume see the number;
`runner show` prints it with `auto_note`.
"""

from __future__ import annotations

import json
from pathlib import Path

from backends.errors import UserError
from runner.models import hidden_sizes
from runner.recipe.common import Json

AUTO = "auto"
BASE_LR, LORA_MULTIPLIER = 5e-5, 10.0
EXPONENTS = {"llama": 0.781, "qwen": 0.0775}


def auto_lr(model: str, full_finetune: bool = False) -> tuple[float, str]:
    """(the learning rate, how it was found) for `model`; UserError when the formula does not cover it."""
    base = model.split(":", 1)[0]
    folder = _folder(model)
    # The cookbook's _KNOWN_HIDDEN_SIZES for the families get_lr calibrates (Llama, Qwen): the `hidden_size` column
    # of runner/models.toml.
    known = hidden_sizes()
    if base in known or folder is None:
        name, hidden, source = base, known.get(base), "the cookbook's table"
    else:
        name, hidden, source = _read_config(folder)
    family = next((f for f in EXPONENTS if f in name.lower()), None)
    if family is None:
        raise UserError(f"lr = \"auto\": no calibrated learning rate for model {model!r} (the cookbook's get_lr "
                        f"covers the Llama and Qwen families only); set lr to a number")
    if hidden is None:
        raise UserError(f"lr = \"auto\": the hidden size of model {model!r} is unknown (not in the cookbook's table, "
                        "not a local model folder with config.json); set lr to a number")
    lr = BASE_LR * (1.0 if full_finetune else LORA_MULTIPLIER) * (2000 / hidden) ** EXPONENTS[family]
    how = (f"auto: the cookbook's get_lr for {'a full fine-tune' if full_finetune else 'LoRA'} of {model} "
           f"({family} family, hidden size {hidden} from {source})")
    return lr, how


def _folder(model: str) -> Path | None:
    """The local model folder `model` names (the embedded "tiny" included), or None."""
    if model == "tiny":  # backends/local/tiny.py's TINY_DIR, found without importing transformers
        import backends

        return Path(backends.__file__).parent / "local" / "assets" / "tiny"
    folder = Path(model).expanduser()
    return folder if (folder / "config.json").is_file() else None


def _read_config(folder: Path) -> tuple[str, int | None, str]:
    """(model_type, hidden size, where it came from) of a local model folder."""
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"lr = \"auto\": cannot read {config_file}: {e}") from None
    if not isinstance(config, dict):
        raise UserError(f"lr = \"auto\": {config_file} is not a JSON object; set lr to a number")
    text_config = config.get("text_config")
    hidden = config.get("hidden_size") or (text_config.get("hidden_size") if isinstance(text_config, dict) else None)
    if not isinstance(hidden, int) or hidden <= 0:
        raise UserError(f"lr = \"auto\": {config_file} has no hidden_size; set lr to a number")
    return str(config.get("model_type", "")), hidden, str(config_file)


def resolve_auto(raw: Json) -> tuple[Json, str | None]:
    """A raw recipe table with lr = "auto" replaced by its value, and how it was found (None: no "auto")."""
    if raw.get("lr") != AUTO:
        return raw, None
    model = raw.get("model", "tiny")
    backend = raw.get("backend")
    full = isinstance(backend, dict) and backend.get("full_finetune") is True
    if not isinstance(model, str):
        return raw, None  # decoding reports the bad model
    lr, how = auto_lr(model, full_finetune=full)
    return {**raw, "lr": lr}, how


def auto_note(raw: Json) -> str | None:
    """`runner show`'s comment line for a raw table (overrides applied) whose lr is "auto"."""
    resolved, how = resolve_auto(raw)
    return None if how is None else f"# lr = {resolved['lr']:.6g}: {how}\n"
