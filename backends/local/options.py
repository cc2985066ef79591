"""What the local backend reads of its recipe table (local_config.Local), as a read-only Protocol.

local_config.py makes the backend (`Local.make` imports backend.py lazily); the backend and device.py type their
settings with this Protocol instead of importing local_config.py back, so the modules form no circle (tests/
test_import_graph.py). `Local` satisfies it structurally; pyright checks that where `make` passes itself.
"""

from __future__ import annotations

from typing import Protocol


class LocalOptions(Protocol):
    @property
    def device(self) -> str:  # "auto" | "cpu" | "cuda"
        ...

    @property
    def dtype(self) -> str:  # "auto" | "float32" | "bfloat16"
        ...

    @property
    def lora_alpha(self) -> float: ...

    @property
    def full_finetune(self) -> bool: ...

    @property
    def packed(self) -> bool: ...

    @property
    def attention(self) -> str:  # "auto" | "sdpa" | "flex"
        ...

    @property
    def sampler_weights(self) -> str:  # "auto" | "merged" | "lora"
        ...

    @property
    def local_files_only(self) -> bool:  # a hub id not in the cache: an error instead of a download
        ...
