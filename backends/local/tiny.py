"""The embedded default model "tiny": a ~0.82M-parameter Qwen3-style chat model with a byte-level tokenizer.

What runs with the package: `TINY_DIR` (the shipped, pre-trained checkpoint in `assets/tiny/`), the tokenizer and
config built in code (no hub download, so tests and the local backend run offline; the tokenizer is
backends/tiny_tokenizer.py's, re-exported here), `save_random_tiny(dir)` (a randomly initialised copy for tests),
and `task_prompts` (the pre-training tasks' prompts, which recipes name as `backends.local.tiny:task_prompts`).
Importing this module loads neither torch nor transformers (`runner check` imports it to check a recipe's targets);
the functions that need them import them.

How the checkpoint and the example data in examples/data/ were made (pre-training on synthetic chats, the data
generators) is build tooling outside the package: scripts/tiny_build.py,

    python -m scripts.tiny_build build [--out DIR] [--seed S]   # 1600 steps; bit-identical on one machine
    python -m scripts.tiny_build data [--out DIR]
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

from backends.tiny_tokenizer import CHAT_TEMPLATE as CHAT_TEMPLATE
from backends.tiny_tokenizer import IM_END, PAD, build_tokenizer
from backends.tiny_tokenizer import IM_START as IM_START
from backends.tiny_tokenizer import SPECIALS as SPECIALS
from backends.tiny_tokenizer import build_core_tokenizer as build_core_tokenizer

if TYPE_CHECKING:
    import transformers

TINY_DIR: Path = Path(__file__).parent / "assets" / "tiny"


def build_config(tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.Qwen3Config:
    """Qwen3-style config of ~0.82M parameters (embeddings tied: 259 x 128 of them)."""
    import transformers

    return transformers.Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        rope_theta=10000.0,  # pyright: ignore[reportCallIssue] - accepted (into rope_parameters) via **kwargs
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
    import transformers

    path = Path(path)
    tok = build_tokenizer()
    cfg = build_config(tok)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _save(model, tok, path)
    return path


def _save(model, tok, path: Path) -> None:
    """Write a model and its tokenizer as an HF folder with a generation config naming EOS and PAD."""
    import transformers

    model.generation_config = transformers.GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id
    )
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


# ---------------------------------------------------------------- the pre-training tasks' prompts
# Each task returns (user prompt, assistant answer). Strings are random letters so the model learns
# the operation, not a word list. scripts/tiny_build.py pre-trains on them; recipes prompt with them.

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _word(rng: random.Random, lo: int = 3, hi: int = 8) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _string_task(rng: random.Random) -> tuple[str, str]:
    s = _word(rng)
    kind = rng.randrange(7)
    if kind == 0:
        return rng.choice((f"Repeat: {s}", f"Say {s}.")), s
    if kind == 1:
        return rng.choice((f"Reverse: {s}", f"Write {s} backwards.")), s[::-1]
    if kind == 2:
        return rng.choice((f"Uppercase: {s}", f"Write {s} in capital letters.")), s.upper()
    if kind == 3:
        return rng.choice((f"How many characters are in {s}?", f"Length of {s}?")), str(len(s))
    if kind == 4:
        return rng.choice((f"Sort the letters: {s}", f"Sort {s} alphabetically.")), "".join(sorted(s))
    if kind == 5:
        return f"What is the first letter of {s}?", s[0]
    return f"What is the last letter of {s}?", s[-1]


def _short_task(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 99)
    kind = rng.randrange(4)
    if kind == 0:
        return f"What comes after {n}?", str(n + 1)
    if kind == 1:
        return f"Is {n} even or odd?", "even" if n % 2 == 0 else "odd"
    if kind == 2:
        a, b = rng.sample(range(100), 2)
        return f"Which is larger, {a} or {b}?", str(max(a, b))
    return rng.choice((("Hello!", "Hello! How can I help?"), ("Thanks!", "You are welcome."),
                       ("Who are you?", "I am a small assistant."), ("Say yes.", "yes"), ("Say no.", "no")))


def arithmetic_prompt(x: int, y: int) -> str:
    """The RL environment's prompt; the answer is just the integer x + y."""
    return f"What is {x} + {y}?"


def _arith_task(rng: random.Random, wide_frac: float) -> tuple[str, str]:
    # Small operands are learned fully; wide ones (the RL distribution) only partly, which leaves RL
    # something to improve. wide_frac sets how much of the wide range pre-training sees.
    hi = 99 if rng.random() < wide_frac else 9
    x, y = rng.randint(0, hi), rng.randint(0, hi)
    return arithmetic_prompt(x, y), str(x + y)


def task_prompts(n: int = 600, seed: int = 0, kinds: tuple[str, ...] | list[str] = ("string", "short")) -> list[dict]:
    """Prompts of the pre-training tasks ("string": repeat/reverse/sort/... a random word; "short": counting,
    parity, comparison, greetings), as chat rows {"messages": [{"role": "user", ...}]}: what the
    prompt-distillation recipe asks its teacher."""
    rng = random.Random(seed)
    tasks = tuple({"string": _string_task, "short": _short_task}[k] for k in kinds)
    return [{"messages": [{"role": "user", "content": rng.choice(tasks)(rng)[0]}]} for _ in range(n)]
