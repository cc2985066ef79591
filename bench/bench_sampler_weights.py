"""What a LoRA sampling client costs, merged vs unmerged (backends/local/local_config.py `sampler_weights`).

    merged   model.sampling_snapshot(merge=True): its own tensor W + s B A for every adapted layer
    lora     model.sampling_snapshot(merge=False): the base's own tensors plus a copy of the adapters (LoraDelta),
             applied unmerged at every matmul

Per model (the random-weight models of bench_sampling.py; LoRA rank 16 on every attention and MLP Linear and the
tied lm_head, lora_B randomised so the adapters are not a no-op): the bytes an extra sampling client holds beyond
the base, the snapshot's cost (ms, Sampler setup included), decode throughput (sampled tokens/s: 8 prompts x 4
samples x 64 tokens through Sampler.sample_batch), and each path's max |logprob - the trainer's| (the peft model's
own forward) on the sampled tokens. Interleaved rounds, medians, CPU clock (run with OMP_NUM_THREADS=1).

    OMP_NUM_THREADS=1 python bench/bench_sampler_weights.py
    OMP_NUM_THREADS=1 python bench/bench_sampler_weights.py --models big --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backends.local import model as M
from backends.local.sampler import Sampler, SampleRequest
from backends.types import SamplingParams
from bench.bench_sampling import make_prompts
from bench.bench_snapshot import trained_lora


def _own_bytes(model: torch.nn.Module, base: torch.nn.Module) -> int:
    shared = {t.untyped_storage().data_ptr() for t in (*base.parameters(), *base.buffers())}
    own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers())}
    return sum(n for p, n in own.items() if p not in shared)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,big")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    clock, cpu = time.process_time, torch.device("cpu")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, LoRA rank {args.rank}, "
          f"median of {args.rounds}")
    print(f"{'model':6} {'base MB':>8} {'merged MB':>10} {'lora MB':>8} {'snap ms m/l':>12} {'tok/s merged':>13} "
          f"{'tok/s lora':>11} {'lora/merged':>12} {'max|dlp| m':>11} {'max|dlp| l':>11}")
    for name in args.models.split(","):
        base, tok, trained = trained_lora(name, args.rank)
        prompts = make_prompts(8)
        params = SamplingParams(max_tokens=64, temperature=1.0, stop=[], seed=5)
        requests = [SampleRequest(p, 4, params) for p in prompts]
        modes = {"merged": True, "lora": False}
        snaps, samplers, snap_ms, tps, err = {}, {}, {}, {}, {}
        for mode, merge in modes.items():
            snaps[mode] = M.sampling_snapshot(trained, base, merge=merge)
            samplers[mode] = Sampler(snaps[mode], tok, cpu)
            snap_ms[mode], tps[mode] = [], []
            out = samplers[mode].sample_batch(requests[:2])  # warm-up, and the numerics check
            worst = 0.0
            with torch.inference_mode():
                for p, o in zip(prompts, out):
                    for s in o.sequences:
                        ids = torch.tensor([p + s.tokens])
                        lp = torch.log_softmax(trained(ids).logits[0, len(p) - 1:-1].float(), -1)
                        ref = lp.gather(-1, torch.tensor(s.tokens)[:, None])[:, 0]
                        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
            err[mode] = worst
        for _ in range(args.rounds):
            for mode, merge in modes.items():
                t0 = clock()
                Sampler(M.sampling_snapshot(trained, base, merge=merge), tok, cpu)
                snap_ms[mode].append((clock() - t0) * 1e3)
                t0 = clock()
                n = sum(len(s.tokens) for o in samplers[mode].sample_batch(requests) for s in o.sequences)
                tps[mode].append(n / (clock() - t0))
        mb = {m: _own_bytes(snaps[m], base) / 2**20 for m in modes}
        base_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20
        med = {m: statistics.median(tps[m]) for m in modes}
        ms = {m: statistics.median(snap_ms[m]) for m in modes}
        print(f"{name:6} {base_mb:8.1f} {mb['merged']:10.2f} {mb['lora']:8.2f} "
              f"{ms['merged']:5.1f}/{ms['lora']:<6.1f} {med['merged']:13.0f} {med['lora']:11.0f} "
              f"{med['lora'] / med['merged']:12.2f} {err['merged']:11.1e} {err['lora']:11.1e}", flush=True)


if __name__ == "__main__":
    main()
