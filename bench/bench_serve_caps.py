"""What `runner serve`'s memory caps count, against what the process holds: backends/serve/memory.py's estimates
(the peer) vs the measured RSS of the local backend doing the same work, on the CPU with the tiny model.

- a LoRA training run of rank R on every attention, MLP and the unembedding layer: RSS after one
  forward_backward + optim_step (adapters and AdamW's moments stay; the gradients are freed after the step),
  next to `lora_bytes` (adapters + gradients + moments: the peak inside a step);
- a sampling request of N samples x (1 + T) tokens: the peak RSS while it runs (polled every 5 ms), next to
  `sample_bytes` (KV cache of one decode chunk, +25%, and logits).

    python bench/bench_serve_caps.py            # rank 4096; 4096 x (1 + 255) tokens, the largest request allowed
    python bench/bench_serve_caps.py --quick    # rank 1024; 512 x (1 + 255) tokens (~15 s)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.serve import memory
from backends.serve.memory import fmt_bytes


def rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=255)
    args = ap.parse_args()
    rank = args.rank or (1024 if args.quick else 4096)
    n = args.samples or (512 if args.quick else 4096)

    import gc

    import numpy as np

    from backends.local.backend import LocalBackend
    from backends.local.local_config import Local
    from backends.serve.samplers import trim_heap
    from backends.types import AdamParams, Datum, LoraSpec, SamplingParams

    shapes = memory.shapes("tiny")
    backend = LocalBackend(Local(device="cpu"), "tiny", None, Path(tempfile.mkdtemp(prefix="bench-caps-")))
    warm = backend.create_training_client(LoraSpec("tiny", rank=2)).result()  # the base, torch's pools
    sc = backend.create_sampling_client(base_model="tiny").result()
    sc.sample([5, 6, 7], 2, SamplingParams(max_tokens=4, seed=0)).result()
    del warm
    gc.collect()
    trim_heap()

    r0 = rss()
    tc = backend.create_training_client(LoraSpec("tiny", rank=rank)).result()
    datum = Datum(model_input=list(range(5, 40)), target_tokens=np.arange(6, 41), weights=np.ones(35, np.float32))
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(AdamParams(learning_rate=1e-4)).result()
    gc.collect()
    trim_heap()
    held = rss() - r0
    est = memory.lora_bytes(shapes, rank, True, True, True)
    adapters = memory.lora_params(shapes, rank, True, True, True) * memory.FLOAT_BYTES
    print(f"training run, LoRA rank {rank}: RSS +{fmt_bytes(held)} after a step (adapters alone {fmt_bytes(adapters)}); "
          f"counted {fmt_bytes(est)} (adapters + grads + 2 moments); measured / counted = {held / est:.2f}")
    del tc
    gc.collect()
    trim_heap()

    peak = [0]
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.005)

    r0 = rss()
    threading.Thread(target=poll, daemon=True).start()
    t = time.perf_counter()
    out = sc.sample([5], n, SamplingParams(max_tokens=args.max_tokens, seed=0)).result()
    stop.set()
    took = time.perf_counter() - t
    est = memory.sample_bytes(shapes, 4, n, 1, args.max_tokens)
    tokens = sum(len(s.tokens) for s in out.sequences)
    print(f"sampling {n} x (1 + {args.max_tokens}) tokens ({tokens} sampled, {took:.0f} s): peak RSS "
          f"+{fmt_bytes(peak[0] - r0)}; counted {fmt_bytes(est)}; measured / counted = {(peak[0] - r0) / est:.2f}")
    backend.close()


if __name__ == "__main__":
    main()
