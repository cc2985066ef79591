"""Hub models on first use: a hub id that is not in the Hugging Face cache is downloaded there, as transformers,
TRL and vLLM do (the local backend's models and tokenizers: backends/local/model.py; the Tinker backend's tokenizer:
backends/tokenizer.py).

- The cache is looked at first, without a network call; a cached id never touches the hub.
- HF_HUB_OFFLINE=1 (or TRANSFORMERS_OFFLINE=1) and the local backend's `local_files_only = true` keep to the cache.
- The hub (HF_ENDPOINT) gets a quick connection check first: offline, the hub client would retry for most of a
  minute; instead the run stops at once with one line saying how to get the files.
- Progress: one line naming the id, the endpoint and the cache folder, then huggingface_hub's progress bars, all on
  stderr (HF_HUB_DISABLE_PROGRESS_BARS=1 silences the bars). Only what loading needs is fetched: configs,
  safetensors weights, tokenizer files (not .bin/.pt/.gguf copies of the same weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

from backends.errors import UserError
from backends.tokenizer import _first, _offline, hub_endpoint, hub_reachable

# What loading a model or tokenizer reads (transformers' from_pretrained with safetensors weights).
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]


def offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, as set now or as huggingface_hub read it when it was imported."""
    import huggingface_hub.constants

    return _offline() or bool(huggingface_hub.constants.HF_HUB_OFFLINE)


def snapshot(repo_id: str, what: str = "model", local_files_only: bool = False) -> Path:
    """The folder of hub repo `repo_id` in the Hugging Face cache, downloaded on first use (module doc).
    UserError (one line) when it is not cached and cannot be downloaded."""
    import huggingface_hub.constants
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not (fully) in the cache: download it below
        pass
    fix = f"download it first (hf download {repo_id}) or name a local folder"
    if local_files_only or offline():
        why = "local_files_only = true" if local_files_only else "HF_HUB_OFFLINE=1"
        raise UserError(f"{what} {repo_id!r} is not in the Hugging Face cache and downloads are off ({why}); {fix}")
    endpoint = hub_endpoint()
    if not hub_reachable():
        raise UserError(f"{what} {repo_id!r} is not in the Hugging Face cache and the hub ({endpoint}) cannot be "
                        f"reached; {fix}")
    print(f"{what} {repo_id}: not in the Hugging Face cache, downloading it from {endpoint} into "
          f"{huggingface_hub.constants.HF_HUB_CACHE}", file=sys.stderr, flush=True)
    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS))
    except Exception as e:  # noqa: BLE001 - no such repo, gated, a dropped connection: one line either way
        raise UserError(f"cannot download {what} {repo_id!r} from {endpoint} ({_first(e)}); {fix}") from None
