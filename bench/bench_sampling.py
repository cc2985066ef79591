"""Tokens/s of the local Sampler vs HF `model.generate`, side by side in one process.

Same random-weight model, same prompts (mixed lengths, so left padding is exercised), sampling at
temperature 1 with no top-k/top-p, exactly the budgeted tokens per row (stop=[] for the Sampler,
min_new_tokens for generate). Median of `--runs` interleaved timed runs after one warm-up each.
Batch shapes: B distinct prompts; PxG (P prompts, G samples each: num_return_sequences for generate);
Bragged (per-row budgets from new/8 to new, counted as delivered tokens for both). --modules adds the
Sampler with its Llama-family fast path off (HF's modules decode, as for any other architecture);
--per-row adds it with one prefill per row instead of one per distinct prompt (Sampler.share_prefill = False).

    OMP_NUM_THREADS=1 python bench/bench_sampling.py                 # tiny + 512x8, batch 8 and 32
    python bench/bench_sampling.py --models big --batches 32 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

# This checkout's code, not whatever `runner` the venv has installed (an editable install of another checkout
# would otherwise win, as the script's own folder, not the repository root, leads sys.path).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from backends.local.sampler import Sampler, SampleRequest
from backends.local.tiny import build_config, build_tokenizer
from backends.types import SamplingParams

# name -> overrides of the tiny config. "tiny" is overhead-bound on CPU, "big" (~25M params) compute-bound.
MODELS = {
    "tiny": {},
    "big": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
    },
}


def make_model(name: str, device: torch.device, dtype: torch.dtype):
    tok = build_tokenizer()
    base = {k: v for k, v in build_config(tok).to_dict().items() if k != "layer_types"}  # re-derived from depth
    cfg = transformers.Qwen3Config(**{**base, **MODELS[name]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    return model, tok


def make_prompts(n: int, seed: int = 0, length: int | None = None) -> list[list[int]]:
    rng = torch.Generator().manual_seed(seed)
    lengths = [length] * n if length else torch.randint(8, 64, (n,), generator=rng).tolist()
    return [torch.randint(0, 256, (k,), generator=rng).tolist() for k in lengths]


def run_sampler(sampler: Sampler, prompts: list[list[int]], budgets: list[int], group: int) -> int:
    requests = [SampleRequest(p, group, SamplingParams(max_tokens=b, temperature=1.0, stop=[])) for p, b in zip(prompts, budgets)]
    return sum(len(s.tokens) for o in sampler.sample_batch(requests) for s in o.sequences)


def run_generate(model, prompts: list[list[int]], budgets: list[int], group: int, pad_id: int) -> int:
    """generate has one length for the whole batch: it runs to the largest budget, and the tokens past a
    row's own budget would be thrown away, so only the budgets count as delivered."""
    width, new = max(len(p) for p in prompts), max(budgets)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    dev = model.device
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(dev),
            attention_mask=mask.to(dev),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad_id,
            num_return_sequences=group,
        )
    assert out.shape == (len(prompts) * group, width + new)
    return sum(budgets) * group


def timed(fn, sync, clock) -> tuple[float, int]:
    sync()
    t0 = clock()
    n = fn()
    sync()
    return clock() - t0, n


def measure(fns, runs: int, sync, clock) -> list[tuple[float, int]]:
    """(median seconds, tokens) per function: one warm-up each, then `runs` rounds, interleaved so that drift
    in the machine's load hits every function alike."""
    for fn in fns:
        timed(fn, sync, clock)
    times: list[list[float]] = [[] for _ in fns]
    counts = [0] * len(fns)
    for _ in range(runs):
        for i, fn in enumerate(fns):
            dt, counts[i] = timed(fn, sync, clock)
            times[i].append(dt)
    return [(statistics.median(t), n) for t, n in zip(times, counts, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,big")
    ap.add_argument("--batches", default="8,32")
    # Also time each batch as batch/group prompts x group samples (RL's shape; generate's num_return_sequences).
    ap.add_argument("--group", type=int, default=8)
    # Also time each batch with per-row budgets (the Sampler drops rows as they finish; generate cannot).
    ap.add_argument("--ragged", action=argparse.BooleanOptionalAction, default=True)
    # Also time the Sampler with its Llama-family fast path off (HF's modules decode: its path for other models).
    ap.add_argument("--modules", action=argparse.BooleanOptionalAction, default=False)
    # Also time the Sampler prefilling every row on its own (the shared prefill's reference).
    ap.add_argument("--per-row", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--new", type=int, default=64)
    # Every prompt this many tokens (default: 8-63, mixed); long prompts and few new tokens weigh the prefill.
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    # "cpu" (default on a CPU device) times the process's CPU seconds: on a shared machine wall time mostly
    # measures the neighbours. With one thread that is the wall time an idle machine would show.
    ap.add_argument("--clock", choices=["cpu", "wall"], default=None)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock_name = args.clock or ("cpu" if device.type == "cpu" else "wall")
    clock = time.process_time if clock_name == "cpu" else time.perf_counter
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}, {args.dtype}, "
        f"threads {torch.get_num_threads()}, {args.new} new tokens/row, median of {args.runs}, {clock_name} clock"
    )
    extra = f" {'modules tok/s':>14} {'ratio':>6}" if args.modules else ""
    extra += f" {'per-row tok/s':>14} {'ours/it':>7}" if args.per_row else ""
    print(f"{'model':6} {'batch':>9} {'sampler tok/s':>14} {'generate tok/s':>15} {'ratio':>6}{extra}")
    for name in args.models.split(","):
        model, tok = make_model(name, device, dtype)
        sampler = Sampler(model, tok, device, seed=0)
        plain = Sampler(model, tok, device, seed=0)
        plain.fast = None
        per_row = Sampler(model, tok, device, seed=0)
        per_row.share_prefill = False
        batches = [int(b) for b in args.batches.split(",")]
        # (label, rows, samples per prompt, ragged budgets)
        shapes = [(str(b), b, 1, False) for b in batches]
        shapes += [(f"{b // args.group}x{args.group}", b, args.group, False) for b in batches if 1 < args.group <= b]
        shapes += [(f"{b}ragged", b, 1, True) for b in batches if args.ragged and b > 1]
        for label, batch, group, ragged in shapes:
            prompts = make_prompts(batch // group, length=args.prompt_len)
            # ragged: budgets spread over [new/8, new], as when rows stop at EOS at different times
            budgets = [max(1, args.new * (1 + 7 * i // max(1, len(prompts) - 1)) // 8) for i in range(len(prompts))]
            budgets = budgets if ragged else [args.new] * len(prompts)
            ours = functools.partial(run_sampler, sampler, prompts, budgets, group)
            hf = functools.partial(run_generate, model, prompts, budgets, group, tok.pad_token_id)
            fns = [ours, hf]
            if args.modules:
                fns.append(functools.partial(run_sampler, plain, prompts, budgets, group))
            if args.per_row:
                fns.append(functools.partial(run_sampler, per_row, prompts, budgets, group))
            results = measure(fns, args.runs, sync, clock)
            (t_ours, n_ours), (t_hf, n_hf) = results[:2]
            assert n_ours == n_hf == sum(budgets) * group, (n_ours, n_hf)
            r_ours, r_hf = n_ours / t_ours, n_hf / t_hf
            line = f"{name:6} {label:>9} {r_ours:14.0f} {r_hf:15.0f} {r_ours / r_hf:6.2f}"
            if args.modules:
                r_mod = results[2][1] / results[2][0]
                line += f" {r_mod:14.0f} {r_mod / r_hf:6.2f}"
            if args.per_row:
                r_row = results[-1][1] / results[-1][0]
                line += f" {r_row:14.0f} {r_ours / r_row:7.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
