"""Cost of a sampler snapshot (`save_weights_and_get_sampling_client` on the local backend): the LoRA model's
weights merged into a model the Sampler can decode with, plus the Sampler's own setup.

    before:      model.sampling_copy      deep copy of the peft model, then peft's merge_and_unload (the
                                          Sampler then cost nothing: it only read the config)
    copy+fast:   sampling_copy, then Sampler(...), which on the fast path derives its matmul weights
                 (backends/local/sampler.py, _Linear): what the old snapshot would cost today
    after:       model.sampling_snapshot  a module tree over the base's tensors, merged tensors only for
                                          the adapted layers (W + s B A, one addmm each, in the layout the
                                          sampler wants), then Sampler(...) Same random-weight models as bench_sampling.py, LoRA
rank 16, alpha 32 on every attention and MLP Linear layer and on the tied lm_head (the local backend's
defaults for train_unembed=True), lora_B randomised so the merge is not a no-op. Interleaved rounds, medians,
CPU clock; the script checks both snapshots give the same logits.

    OMP_NUM_THREADS=1 python bench/bench_snapshot.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# This checkout's code, not whatever `runner` the venv has installed (an editable install of another checkout
# would otherwise win, as the script's own folder, not the repository root, leads sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from backends.local import model as M
from backends.local.sampler import Sampler
from bench.bench_sampling import make_model


def trained_lora(name: str, rank: int) -> tuple[torch.nn.Module, Any, torch.nn.Module]:
    """(frozen base, tokenizer, LoRA model on it) for a bench_sampling.py model on the CPU: rank `rank`, alpha 2 x rank
    on every attention and MLP Linear and the tied lm_head, lora_B randomised so the adapters are not a no-op."""
    base, tok = make_model(name, torch.device("cpu"), torch.float32)
    base.requires_grad_(False)
    targets = M.lora_targets(base, attn=True, mlp=True, unembed=True)
    trained = M.make_trainable(base, M.TrainSetup(rank, 2.0 * rank, targets), seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for n, p in trained.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return base, tok, trained


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,big")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    clock = time.process_time
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, LoRA rank {args.rank}, median of {args.runs}")
    print(f"{'model':6} {'before ms':>10} {'copy+fast ms':>13} {'after ms':>9} {'before/after':>13} "
          f"{'max |logit diff|':>17}")
    for name in args.models.split(","):
        base, tok, trained = trained_lora(name, args.rank)

        def before(trained=trained):
            return M.sampling_copy(trained)

        def copy_fast(trained=trained, tok=tok):
            return Sampler(M.sampling_copy(trained), tok, cpu)

        def after(trained=trained, base=base, tok=tok):
            return Sampler(M.sampling_snapshot(trained, base), tok, cpu)

        ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            diff = (before()(ids).logits - after().model(ids).logits).abs().max().item()
        fns = [before, copy_fast, after]
        times: list[list[float]] = [[] for _ in fns]
        for fn in fns:
            fn()  # warm-up (and the base's derived weights, made once per base)
        for _ in range(args.runs):
            for i, fn in enumerate(fns):
                t0 = clock()
                fn()
                times[i].append(clock() - t0)
        b, c, a = (statistics.median(t) * 1e3 for t in times)
        print(f"{name:6} {b:10.1f} {c:13.1f} {a:9.1f} {b / a:13.1f} {diff:17.2e}", flush=True)


if __name__ == "__main__":
    main()
