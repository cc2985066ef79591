"""renderer = "auto": the cookbook's recommended renderer for a model it knows (tinker_cookbook.model_info,
as of 0.6.1, restricted to the renderers this project has), else the tokenizer's chat template ("hf"), else
"role_colon" for a tokenizer without one (a base model)."""

from __future__ import annotations

from typing import Any

# Exact model names (":checkpoint" suffixes are ignored) -> renderer. Base models get role_colon, as in the
# cookbook.
MODEL_RENDERERS: dict[str, str] = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama3",
    "meta-llama/Llama-3.3-70B-Instruct": "llama3",
    "meta-llama/Llama-3.2-1B": "role_colon",
    "meta-llama/Llama-3.2-3B": "role_colon",
    "meta-llama/Llama-3.1-8B": "role_colon",
    "meta-llama/Llama-3.1-70B": "role_colon",
    "Qwen/Qwen3-8B": "qwen3",
    "Qwen/Qwen3-32B": "qwen3",
    "Qwen/Qwen3-30B-A3B": "qwen3",
    "Qwen/Qwen3-4B-Instruct-2507": "qwen3_instruct",
    "Qwen/Qwen3-30B-A3B-Instruct-2507": "qwen3_instruct",
    "Qwen/Qwen3-235B-A22B-Instruct-2507": "qwen3_instruct",
    "Qwen/Qwen3-8B-Base": "role_colon",
    "Qwen/Qwen3-30B-A3B-Base": "role_colon",
    "Qwen/Qwen3.5-9B-Base": "role_colon",
    "Qwen/Qwen3.5-35B-A3B-Base": "role_colon",
    "deepseek-ai/DeepSeek-V3.1": "deepseekv3",
    "deepseek-ai/DeepSeek-V3.1-Base": "role_colon",
    "openai/gpt-oss-20b": "gpt_oss_no_sysprompt",
    "openai/gpt-oss-120b": "gpt_oss_no_sysprompt",
    "moonshotai/Kimi-K2-Thinking": "kimi_k2",
}


def pick_renderer(model_name: str, tokenizer: Any) -> str:
    """The renderer name `auto` resolves to for `model_name` with `tokenizer`."""
    name = MODEL_RENDERERS.get(model_name.split(":", 1)[0])
    if name is not None:
        return name
    return "hf" if getattr(tokenizer, "chat_template", None) else "role_colon"


def auto_note(renderer: str, model: str) -> str:
    """`runner show`'s comment line saying what renderer = "auto" picks for a model the cookbook knows; '' otherwise
    (a named renderer, or a model whose pick depends on its tokenizer having a chat template)."""
    name = MODEL_RENDERERS.get(model.split(":", 1)[0]) if renderer == "auto" else None
    return f"# renderer = {name}: auto: the cookbook's renderer for {model}\n" if name else ""
