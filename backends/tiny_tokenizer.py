"""The embedded "tiny" model's tokenizer: byte-level, built in code (no hub download, no file), so tests, the local
backend and `runner check` have it offline.

Here, in backends/'s shared bottom rather than beside the model (backends/local/tiny.py, which re-exports it), because
the tokenizer loader (backends/tokenizer.py) answers "tiny" with it and the bottom never imports a particular backend
(tests/test_import_graph.py). Importing this module loads neither tokenizers nor transformers; the functions that need
them import them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers
    import transformers

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (PAD, IM_START, IM_END)

# Qwen's ChatML template, minus tools/thinking: every message is "<|im_start|>{role}\n{content}<|im_end|>\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_core_tokenizer() -> tokenizers.Tokenizer:
    """The `tokenizers` core of build_tokenizer (no transformers: `runner check` looks at it, backends/tokenizer.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = [c for _, c in sorted((_byte_of(c), c) for c in alphabet)]
    vocab = {c: i for i, c in enumerate(byte_chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges, pre-splitting words would only cost time.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))  # in this order: ids 256, 257, 258
    return core


def build_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are the bytes (in GPT-2's printable byte alphabet), 256..258 the
    specials. A BPE model with no merges, so any UTF-8 text round-trips exactly, one token per byte."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_core_tokenizer(),
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
