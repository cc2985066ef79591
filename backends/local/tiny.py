"""The embedded default model "tiny": a ~0.8M-parameter Qwen3-style chat model with a byte-level tokenizer.

Everything is built in code (no hub download), so tests and the local backend run offline.
`save_random_tiny(dir)` writes a randomly initialised copy for tests; the shipped checkpoint in
`assets/tiny/` is pre-trained on synthetic chat data so that LoRA/SFT/RL on it learn visibly.
"""

from __future__ import annotations

from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

TINY_DIR: Path = Path(__file__).parent / "assets" / "tiny"

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (PAD, IM_START, IM_END)

# Qwen's ChatML template, minus tools/thinking: every message is "<|im_start|>{role}\n{content}<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are the bytes (in GPT-2's printable byte alphabet), 256..258 the
    specials. A BPE model with no merges, so any UTF-8 text round-trips exactly, one token per byte."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = [c for _, c in sorted((_byte_of(c), c) for c in alphabet)]
    vocab = {c: i for i, c in enumerate(byte_chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges, pre-splitting words would only cost time.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))  # in this order: ids 256, 257, 258
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    ids = [tok.convert_tokens_to_ids(s) for s in SPECIALS]
    assert ids == [256, 257, 258], ids  # fixed ids keep saved checkpoints and the config in step
    return tok


def _byte_of(char: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the rest to 256+n."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    code = ord(char)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def build_config(tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.Qwen3Config:
    """Qwen3-style config of ~0.82M parameters (embeddings tied: 259 x 128 of them)."""
    return transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        dtype="float32",
    )


def save_random_tiny(path: str | Path, seed: int = 0) -> Path:
    """Write a randomly initialised tiny model as an ordinary HF folder (config, safetensors, tokenizer,
    generation config); loadable offline with AutoModelForCausalLM / AutoTokenizer.from_pretrained."""
    import torch

    path = Path(path)
    tok = build_tokenizer()
    cfg = build_config(tok)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _save(model, tok, path)
    return path


def _save(model, tok, path: Path) -> None:
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
