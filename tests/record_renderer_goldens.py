"""Record tinker-cookbook's renderer outputs as the goldens tests/test_renderers.py compares ours against:
`PYTHONPATH=. python tests/record_renderer_goldens.py` (needs tinker-cookbook 0.6.1 importable) writes
tests/data/renderers/<renderer>__<tokenizer>.json for every pair in renderer_tokenizers.RENDERERS."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from renderer_tokenizers import PROBE, RENDERERS, reference, tokenizer  # noqa: E402

OUT = Path(__file__).resolve().parent / "data" / "renderers"


def golden_path(renderer: str, tok: str) -> Path:
    return OUT / f"{renderer}__{tok}.json"


def main() -> None:
    import tinker_cookbook

    version = getattr(tinker_cookbook, "__version__", "unknown")
    OUT.mkdir(parents=True, exist_ok=True)
    for renderer, toks in RENDERERS.items():
        for tok in toks:
            data = {"cookbook": version, "renderer": renderer, "tokenizer": tok,
                    "probe": list(tokenizer(tok).encode(PROBE, add_special_tokens=False)),
                    **reference(renderer, tok)}
            golden_path(renderer, tok).write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
            print("wrote", golden_path(renderer, tok))


if __name__ == "__main__":
    main()
