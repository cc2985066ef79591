"""The packed trainer's attention: the C tree attention (backends/local/kernels.c, `_TreeAttention`) against
torch's SDPA run the way packed.py ran it before (`_attention`: flash SDPA per run of equal-length sequences and
per prefix-tree node, ancestors' keys concatenated, lower-right masks), on the same chunks.

The chunks are bench_train.py's: its chat batches (16 conversations, most sharing a system prompt, so prefix
trees), planned by packed.plan with the wide model's shared-run threshold. Per head configuration (the tiny and
the wide model of bench_train.py, and Qwen3's 128-wide heads), random q, k, v, one layer's attention: forward
alone, and forward + backward. Outputs and gradients are checked against each other first. Interleaved rounds,
medians, CPU clock, 1 thread.

    python bench/bench_attention.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.local import packed as P
from backends.local.kernels import load
from bench.bench_train import build_tokenizer, make_batches

# name -> (query heads, KV heads, head size)
HEADS = {"tiny": (4, 2, 32), "wide": (8, 4, 64), "qwen3-128": (16, 8, 128)}


def run(cases: list, scale: float, kern, tree: bool, backward: bool, out: list | None = None) -> None:
    """One layer's attention over every chunk: the tree kernel or torch's path, forward (and backward); `out`
    collects the output and gradients."""
    for plan, blocks, q, k, v, do in cases:
        with torch.set_grad_enabled(backward):
            qq, kk, vv = (x.detach().requires_grad_(backward) for x in (q, k, v))
            if tree:
                o = P._TreeAttention.apply(qq, kk, vv, plan, scale, kern)
            else:
                o = P._attention(qq, kk, vv, blocks, scale)
            if backward:
                o.backward(do)
            if out is not None:
                out.append((o.detach(), qq.grad, kk.grad, vv.grad))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kern = load()
    if kern is None:
        raise SystemExit("the C kernels did not build (no C compiler?): nothing to compare")
    batches = make_batches(build_tokenizer(), args.batches, 16, 512)
    layouts = [lay for b in batches for lay in P.plan(b, 1 << 30, 6)]
    print(f"torch {torch.__version__}, 1 thread, CPU clock; {len(layouts)} chunks of "
          f"{', '.join(str(len(lay.tokens)) for lay in layouts)} rows; medians of {args.rounds} interleaved rounds")
    g = torch.Generator().manual_seed(0)
    for name, (h, kv, d) in HEADS.items():
        scale = d ** -0.5
        cases = []
        for lay in layouts:
            t = len(lay.tokens)
            q, k, v = torch.randn(t, h, d, generator=g), torch.randn(t, kv, d, generator=g), torch.randn(t, kv, d, generator=g)
            cases.append((P.attention_plan(lay), P.attention_blocks(lay, torch.device("cpu")), q, k, v,
                          torch.randn(t, h * d, generator=g)))

        ours: list = []
        theirs: list = []
        run(cases, scale, kern, True, True, ours)
        run(cases, scale, kern, False, True, theirs)
        for a, b in zip(ours, theirs):
            for x, y in zip(a, b):
                torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-3)
        variants = {"tree fwd": (True, False), "torch fwd": (False, False), "tree fwd+bwd": (True, True),
                    "torch fwd+bwd": (False, True)}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for r in range(args.rounds + 1):
            for label, (tree, backward) in variants.items():
                t0 = time.process_time()
                run(cases, scale, kern, tree, backward)
                if r:  # the first round warms up
                    times[label].append(time.process_time() - t0)
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        print(f"{name:9} heads {h}/{kv} x {d}: forward tree {med['tree fwd']:7.2f} ms, torch {med['torch fwd']:7.2f} ms "
              f"({med['torch fwd'] / med['tree fwd']:.2f}x); forward+backward tree {med['tree fwd+bwd']:7.2f} ms, "
              f"torch {med['torch fwd+bwd']:7.2f} ms ({med['torch fwd+bwd'] / med['tree fwd+bwd']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
