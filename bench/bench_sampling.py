"""Tokens/s of the local Sampler vs HF `model.generate`, side by side in one process.

Same random-weight model, same prompts (mixed lengths, so left padding is exercised), sampling at
temperature 1 with no top-k/top-p, exactly `--new` tokens per row (stop=[] for the Sampler,
min_new_tokens for generate). Median of `--runs` timed runs after one warm-up each.

    OMP_NUM_THREADS=1 python bench/bench_sampling.py                 # tiny + 512x8, batch 8 and 32
    python bench/bench_sampling.py --models big --batches 32 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from backends.local.sampler import Sampler
from backends.local.tiny import build_config, build_tokenizer
from runner.types import SamplingParams

# name -> overrides of the tiny config. "tiny" is overhead-bound on CPU, "big" (~25M params) compute-bound.
MODELS = {
    "tiny": {},
    "big": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64),
}


def make_model(name: str, device: torch.device, dtype: torch.dtype):
    tok = build_tokenizer()
    base = {k: v for k, v in build_config(tok).to_dict().items() if k != "layer_types"}  # re-derived from depth
    cfg = transformers.Qwen3Config(**{**base, **MODELS[name]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    return model, tok


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 64, (n,), generator=rng).tolist()
    return [torch.randint(0, 256, (k,), generator=rng).tolist() for k in lengths]


def run_sampler(sampler: Sampler, prompts: list[list[int]], new: int) -> int:
    params = SamplingParams(max_tokens=new, temperature=1.0, stop=[])
    outs = sampler.sample_batch([(p, 1, params) for p in prompts])
    return sum(len(s.tokens) for o in outs for s in o.sequences)


def run_generate(model, prompts: list[list[int]], new: int, pad_id: int) -> int:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    dev = model.device
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id,
        )
    return (out.shape[1] - width) * len(prompts)


def timed(fn, sync) -> tuple[float, int]:
    sync()
    t0 = time.perf_counter()
    n = fn()
    sync()
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,big")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}, {args.dtype}, "
          f"threads {torch.get_num_threads()}, {args.new} new tokens/row, median of {args.runs}")
    print(f"{'model':6} {'batch':>5} {'sampler tok/s':>14} {'generate tok/s':>15} {'ratio':>6}")
    for name in args.models.split(","):
        model, tok = make_model(name, device, dtype)
        sampler = Sampler(model, tok, device, seed=0)
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = make_prompts(batch)
            ours = lambda: run_sampler(sampler, prompts, args.new)  # noqa: E731
            hf = lambda: run_generate(model, prompts, args.new, tok.pad_token_id)  # noqa: E731
            timed(ours, sync), timed(hf, sync)  # warm-up
            t_ours, t_hf = [], []
            for _ in range(args.runs):  # interleaved, so drift in machine load hits both alike
                dt, n_ours = timed(ours, sync)
                t_ours.append(dt)
                dt, n_hf = timed(hf, sync)
                t_hf.append(dt)
            assert n_ours == n_hf == batch * args.new, (n_ours, n_hf)
            r_ours, r_hf = n_ours / statistics.median(t_ours), n_hf / statistics.median(t_hf)
            print(f"{name:6} {batch:5d} {r_ours:14.0f} {r_hf:15.0f} {r_ours / r_hf:6.2f}", flush=True)


if __name__ == "__main__":
    main()
