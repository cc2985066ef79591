"""Loading a tokenizer by name, without a model, client or service (dry runs, the Tinker backend).

"tiny" is the embedded byte-level tokenizer, built in code. Anything else is a local folder, a hub id in
the local cache, or a hub id to download. Offline, transformers' hub client retries a missing file with
back-off for most of a minute before failing; so the cache is tried first, and a download is tried only
when the hub answers a quick connection check: a tokenizer that is neither local nor reachable fails at
once with one line.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from backends.errors import UserError
from backends.hub import TOKENIZER_PATTERNS, download, env_offline, first_line, hub_endpoint, hub_reachable

if TYPE_CHECKING:
    from tokenizers import Tokenizer as CoreTokenizer
    from transformers import BatchEncoding, PreTrainedTokenizerBase


class Tokenizer(Protocol):
    """What runner and backends/ use of a Hugging Face tokenizer (load_tokenizer loads one, a
    transformers.PreTrainedTokenizerBase, which meets it; tests build a tiny one). Each method is declared as
    narrow as our calls to it and returns what the Hugging Face one declares: decode's str or list[str] (a list
    only for a batch of sequences), apply_chat_template's text, ids or BatchEncoding (text with tokenize=False);
    callers narrow the result to what their call gives. Here, beside the loader, at the bottom of the import order
    (tests/test_import_graph.py: backends/ never imports runner/; runner/renderers/base.py re-exports it)."""

    def encode(self, text: str, /, *, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], /, *, skip_special_tokens: bool = ...) -> str | list[str]: ...

    def convert_tokens_to_ids(self, tokens: str, /) -> int | list[int]: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], /, *, tokenize: bool = ...,
                            add_generation_prompt: bool = ...
                            ) -> str | list[int] | list[str] | list[list[int]] | BatchEncoding: ...

    def get_vocab(self) -> dict[str, int]: ...

    def __len__(self) -> int: ...  # the vocabulary with added tokens

    # bos_token, eos_token_id and the other special tokens: Hugging Face's answer them from __getattr__ (a token,
    # its id, a list of either, or None when the tokenizer has none), and so does this protocol.
    def __getattr__(self, name: str, /) -> int | str | list[int] | list[str] | None: ...


def eos_token_id(tok: Tokenizer) -> int | None:
    """The tokenizer's end-of-sequence token id; None when it has none."""
    eos = tok.eos_token_id
    return eos if isinstance(eos, int) else None


def decode_text(tok: Tokenizer, token_ids: list[int], *, skip_special_tokens: bool = False) -> str:
    """tok.decode of one sequence: its text (Hugging Face's decode declares list[str] too, for a batch)."""
    text = tok.decode(token_ids, skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"{type(tok).__name__}.decode gave a {type(text).__name__} for one sequence, not its text")
    return text


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    if name == "tiny":
        from backends.tiny_tokenizer import build_tokenizer

        return build_tokenizer()
    from transformers import AutoTokenizer

    if Path(name).expanduser().exists():
        try:
            return AutoTokenizer.from_pretrained(str(Path(name).expanduser()))
        except Exception as e:  # noqa: BLE001 - a folder without a usable tokenizer is the user's to fix
            raise UserError(f"cannot load a tokenizer from {name!r}: {first_line(e)}") from None
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache (or a bad name): try the hub below, if it is there
        pass
    fix = 'set tokenizer = "<local tokenizer folder>" in the recipe'
    if env_offline():
        raise UserError(f"tokenizer {name!r} is not a local folder nor in the Hugging Face cache, and downloads are "
                        f"off (HF_HUB_OFFLINE=1); {fix}")
    if not hub_reachable():
        raise UserError(f"tokenizer {name!r} is not a local folder nor in the Hugging Face cache, and the hub "
                        f"({hub_endpoint()}) cannot be reached; {fix}")
    print(f"tokenizer {name}: not in the Hugging Face cache, downloading it from {hub_endpoint()}", file=sys.stderr,
          flush=True)
    import huggingface_hub.constants

    try:  # bounded in time, stalls and retries, Ctrl-C at once (backends/hub.py); the tokenizer's files only
        folder = download(name, TOKENIZER_PATTERNS, Path(huggingface_hub.constants.HF_HUB_CACHE))
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - no such repo, gated, bad files, a stalled hub: all one fix
        raise UserError(f"cannot load tokenizer {name!r} ({first_line(e)}); {fix}") from None


def local_core_tokenizer(name: str) -> CoreTokenizer | None:
    """The `tokenizers.Tokenizer` of tokenizer `name` when it is on this machine: "tiny" (built in code), a folder
    with a tokenizer.json, or a hub id whose tokenizer.json is in the Hugging Face cache; None otherwise (never a
    download). Light: no transformers, so `runner check` can look at it (runner/renderers/registry.py)."""
    from tokenizers import Tokenizer as CoreTokenizer

    if name == "tiny":
        from backends.tiny_tokenizer import build_core_tokenizer

        return build_core_tokenizer()
    path = Path(name).expanduser()
    file: str | Path | None = path / "tokenizer.json" if path.is_dir() else None
    if file is None and not name.startswith((".", "/", "~")) and name.count("/") <= 1:
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(name, "tokenizer.json")
        except Exception:  # noqa: BLE001 - a name the hub client refuses: not in the cache
            found = None
        file = found if isinstance(found, str) else None
    if file is None or not Path(file).is_file():
        return None
    try:
        return CoreTokenizer.from_file(str(file))
    except Exception:  # noqa: BLE001 - a file tokenizers cannot read: loading it for real says why, later
        return None


def local_has_chat_template(name: str) -> bool | None:
    """Whether tokenizer `name` has a chat template (tokenizer_config.json's `chat_template`, or a chat_template.jinja
    or .json file next to it), when it is on this machine: "tiny" (yes), a folder, a hub id in the Hugging Face
    cache; None when it is not here to look at (never a download)."""
    import json

    if name == "tiny":
        return True

    def find(file: str) -> Path | None:
        path = Path(name).expanduser()
        if path.is_dir():
            return path / file if (path / file).is_file() else None
        if name.startswith((".", "/", "~")) or name.count("/") > 1:
            return None
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(name, file)
        except Exception:  # noqa: BLE001 - a name the hub client refuses: not in the cache
            return None
        return Path(found) if isinstance(found, str) else None

    config = find("tokenizer_config.json")
    if config is None:
        return None
    try:
        if json.loads(config.read_text(encoding="utf-8")).get("chat_template"):
            return True
    except (OSError, ValueError, AttributeError):
        return None
    return find("chat_template.jinja") is not None or find("chat_template.json") is not None
