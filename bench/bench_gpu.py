"""LoRA training and sampling throughput of the local backend on one GPU against hand-written loops (issue #29).

Models: Qwen3-0.6B's and Qwen3-1.7B's shapes built from a config with random weights (nothing downloaded),
bf16 on CUDA; `--shape tiny` is backends/local/tiny.py's model in fp32 on the CPU (a smoke run: tests/test_bench_gpu.py).
LoRA rank 32 (alpha 32) on all 7 linear modules of every layer, AdamW lr 1e-4. Batches: --rows rows of random
tokens, lengths uniform in [--min-len, --max-len], the first 30% of each row weight 0 (a prompt), the rest 1.

Training contenders (a step = forward + backward + AdamW step on one batch; tokens = the batch's input tokens):
  ours-sdpa     LocalBackend(attention="sdpa", what "auto" runs on CUDA): forward_backward("cross_entropy") +
                optim_step (packed rows, SDPA per block of the chunk, chunked unembedding: backends/local/packed.py,
                logprobs.py); the reference every first loss is checked against
  ours-flex     the same with attention="flex": one compiled FlexAttention call per layer over each chunk, padded
                to one size per run (backends/local/attention.py; CUDA only: no CPU backward)
  ours-before   ours-sdpa with the packed path as before issue #29 (full logits per chunk of 2^27 / vocab tokens):
                PackedLM.chunked_head = False
  hf-padded     HF + peft: right-padded batch with attention mask, full [rows x width x vocab] logits, weighted CE
  hf-packed     HF + peft: the batch as one packed row (position ids restart per sequence), causal SDPA per
                sequence (bench_train.varlen_sdpa), logits only at trained positions
  hf-flex       hf-packed with compiled FlexAttention and a document block mask, q/k/v padded to the largest
                possible batch so it compiles once (CUDA only)
  liger         hf-packed with Liger-Kernel's fused linear cross entropy on the trained positions' hidden
                states (when liger_kernel is installed; CUDA only)
TRL's padding-free SFTTrainer is measured by bench/bench_train.py (CPU); it is not repeated here.

Each training contender runs in a child process of its own, one after another, under --contender-timeout
seconds (its process group is killed at the limit and reported as "timed out after S s (first step not
finished)", or with its first step's time if that had finished): a contender whose compiles stall cannot eat the
device call, and the others still run. A child builds its model, runs one step (the first loss and the time to
the first step, compiles included: "first step (s)"), then --rounds rounds of --steps distinct batches; tokens/s
is the steady state (medians of the rounds). Every contender's first loss (weighted CE summed, before any update;
LoRA B = 0, so the base model's) must agree with ours-sdpa's to 2e-2 relative in bf16 (1e-4 in fp32) or the
bench exits non-zero after its table. A contender that runs out of memory is reported as such. MFU = tokens/s x (4 N_base + 6 N_LoRA) / peak, N_base
counting the tied embedding once (as the lm_head matmul), attention scores not counted, peak = the median of
measured bf16 (CUDA) / fp32 (CPU) torch.mm throughput on 8192^3 (CUDA) / 1024^3 (CPU). Memory: the largest
torch.cuda.max_memory_allocated during a contender's steps, less what was allocated before them (every
contender's weights and optimizer state stay resident; they are the same for all).

RL: rl_basic-shaped batches (8 groups x 8 samples of a 69-token prompt, 2-8 answer tokens), importance_sampling:
training steps/s of ours (attention "auto") against ours-before, in this process, interleaved (the sampling half of an RL step is measured separately below).

Sampling: --prompts prompts of --prompt-len random tokens, --new-tokens tokens each at temperature 1 with no stop
(ours: stop=[]; generate: min_new_tokens = max_new_tokens), against HF `generate` (dynamic cache) and, on CUDA,
`generate` with a static cache and a torch.compile'd forward; tokens/s = new tokens / wall time, medians.
  ours          the sampling client (one batch): on CUDA the Llama fast path at static shapes, its decode steps
                replayed from CUDA graphs (backends/local/static_decode.py); on the CPU the eager fast path
  ours-eager    (CUDA) the same Sampler engine with the graphs off: the static shapes run eagerly
  ours-before   the Sampler engine decoding through HF's modules (its path before issue #29, and for any model
                outside the Llama family)

    python bench/bench_gpu.py                      # CUDA: 0.6b and 1.7b, writes bench/results/gpu_speed.md
    python bench/bench_gpu.py --shape tiny --quick # CPU smoke
    python bench/bench_gpu.py --shape 0.6b --only ours-flex --no-rl --no-sampling   # one contender against ours-sdpa
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_train import VARLEN  # noqa: E402  (registers varlen_sdpa with transformers)

from backends.local.backend import LocalBackend  # noqa: E402
from backends.local.local_config import Local  # noqa: E402
from backends.local.tiny import _save, build_config, build_tokenizer  # noqa: E402
from backends.types import AdamParams, Datum, LoraSpec, SamplingParams  # noqa: E402

RANK, ALPHA = 32, 32.0
ADAM = AdamParams(learning_rate=1e-4)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
             "max_position_embeddings": 40960},
    "1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
             "max_position_embeddings": 40960},
}
Step = Callable[[list[Datum]], float]
RESULTS = Path(__file__).resolve().parent / "results" / "gpu_speed.md"
# Seconds per training contender (its child process: start-up, model, first step, timed rounds). On an H100/H200
# a contender without compiles needs about 20-30 s on the 0.6b shape, one with compiles (ours-flex, hf-flex) about
# a minute if its compiles happen once: seven contenders stay under ~6 minutes even with two of them timing out.
CONTENDER_TIMEOUT = 100.0
REFERENCE = "ours-sdpa"  # the contender every first loss is checked against; always run
CHILD_MARK = "@@bench-gpu "  # a child's result lines on stdout


# ---------------------------------------------------------------- setup


def write_model(shape: str, path: Path, dtype: torch.dtype) -> tuple[Path, transformers.PretrainedConfig]:
    tok = build_tokenizer()
    base = {k: v for k, v in build_config(tok).to_dict().items() if k != "layer_types"}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**{**base, **SHAPES[shape]}))
    _save(model.to(dtype), tok, path)
    return path, model.config


def make_batches(n: int, rows: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[Datum]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = []
        for _ in range(rows):
            length = int(rng.integers(lo, hi + 1))
            ids = rng.integers(0, vocab, length + 1)
            w = np.ones(length, np.float32)
            w[: int(0.3 * length)] = 0
            batch.append(Datum(list(map(int, ids[:-1])), ids[1:].astype(np.int64), weights=w))
        out.append(batch)
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peft_model(model_dir: Path, device: torch.device, dtype: torch.dtype, attn: str | None = None):
    import peft

    kw = {"attn_implementation": attn} if attn else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kw).to(device)
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0, bias="none",
                          task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, cfg)


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ADAM.learning_rate,
                             betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps, weight_decay=ADAM.weight_decay)


def hf_step(model, loss_of: Callable[[Any, list[Datum]], torch.Tensor]) -> Step:
    opt = adamw(model)

    def step(batch: list[Datum]) -> float:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


# ---------------------------------------------------------------- contenders


def make_ours(model_dir: Path, device: torch.device, storage: Path, before: bool = False, loss_fn: str = "cross_entropy",
              attention: str = "auto") -> Step:
    """attention: the Local option ("auto", "sdpa", "flex"). before: the packed path as it was before issue #29
    (full [tokens x vocab] logits per chunk, chunks of 2^27 / vocab tokens, attention per block: the C tree
    kernel on the CPU, SDPA per block on CUDA): PackedLM.chunked_head off, attention "auto" on the CPU, "sdpa"
    on CUDA."""
    if before:
        attention = "sdpa" if device.type == "cuda" else "auto"
    cfg = Local(device=device.type, lora_alpha=ALPHA, packed=True, attention=attention)  # type: ignore[arg-type]
    backend = LocalBackend(cfg, str(model_dir), None, storage, seed=0)
    client = backend.create_training_client(LoraSpec(base_model=str(model_dir), rank=RANK, seed=0,
                                                     train_unembed=False)).result()
    if before:
        assert client.packed is not None
        client.packed.chunked_head = False

    def step(batch: list[Datum]) -> float:
        fb = client.forward_backward(batch, loss_fn)
        opt = client.optim_step(ADAM)
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss

    step.client = client  # type: ignore[attr-defined]  (the sampling bench takes its sampler from it)
    return step


def rl_batches(n: int, vocab: int, groups: int = 8, group: int = 8, prompt: int = 69, seed: int = 0) -> list[list[Datum]]:
    """rl_basic-shaped batches: `groups` prompts of `prompt` tokens, `group` samples each with 2-8 answer tokens;
    importance_sampling inputs (sampler logprobs, advantages on the answer, 0 on the prompt)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        batch = []
        for _ in range(groups):
            p = list(map(int, rng.integers(0, vocab, prompt)))
            for _ in range(group):
                seq = p + list(map(int, rng.integers(0, vocab, int(rng.integers(2, 9)) + 1)))
                k = len(seq) - 1
                adv = np.zeros(k, np.float32)
                adv[prompt - 1:] = rng.normal()
                batch.append(Datum(seq[:-1], np.array(seq[1:]), logprobs=(-rng.random(k) * 3).astype(np.float32),
                                   advantages=adv))
        out.append(batch)
    return out


def padded_loss(model, batch: list[Datum]) -> torch.Tensor:
    dev = model.device
    width = max(d.length for d in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    tgt = torch.zeros((len(batch), width), dtype=torch.long)
    w = torch.zeros((len(batch), width))
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for r, d in enumerate(batch):
        ids[r, : d.length] = torch.as_tensor(d.model_input)
        tgt[r, : d.length] = torch.from_numpy(d.target_tokens)
        w[r, : d.length] = torch.from_numpy(d.weights)
        attn[r, : d.length] = 1
    logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev), use_cache=False).logits.float()
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.to(dev).flatten(), reduction="none")
    return (nll * w.to(dev).flatten()).sum()


def packed_inputs(batch: list[Datum], dev: torch.device) -> dict[str, Any]:
    lengths = [d.length for d in batch]
    # The boundaries stay on the host: varlen_sdpa and flex_doc read them with .tolist() in every layer, which on
    # a CUDA tensor is a host sync per layer (28 a forward on the 0.6b shape) that the hand loops do not need.
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    ids = torch.as_tensor(np.concatenate([d.model_input for d in batch]), dtype=torch.long, device=dev)[None]
    pos = torch.as_tensor(np.concatenate([np.arange(n) for n in lengths]), device=dev)[None]
    return {"input_ids": ids, "position_ids": pos, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max(lengths), "max_length_k": max(lengths)}


def trained(batch: list[Datum], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = np.concatenate([d.weights for d in batch])
    keep = np.nonzero(w > 0)[0]
    tgt = np.concatenate([d.target_tokens for d in batch])[keep]
    return (torch.as_tensor(keep, device=dev), torch.as_tensor(tgt, device=dev),
            torch.as_tensor(w[keep], device=dev))


def packed_loss(model, batch: list[Datum]) -> torch.Tensor:
    dev = model.device
    keep, tgt, w = trained(batch, dev)
    logits = model(**packed_inputs(batch, dev), logits_to_keep=keep, use_cache=False).logits[0].float()
    return (torch.nn.functional.cross_entropy(logits, tgt, reduction="none") * w).sum()


FLEX = "bench_flex_doc"
_FLEX_MASKS: dict[tuple[int, ...], Any] = {}
FLEX_PAD = [0]  # hf-flex pads q/k/v to this many rows (the largest batch, rounded to 128): one compiled shape


def flex_doc(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None, **kwargs):
    """Compiled FlexAttention over a packed row with a document-causal block mask (built once per batch, cached
    by the boundaries), q/k/v padded to FLEX_PAD rows (one compiled shape). query (1, H, T, D); returns
    (1, T, H, D)."""
    from backends.local.attention import _compiled, _mask_builder

    T = query.shape[2]
    P = max(FLEX_PAD[0], -(-T // 128) * 128)
    bounds = tuple(cu_seq_lens_q.tolist())
    mask = _FLEX_MASKS.get(bounds)
    if mask is None:
        lengths = torch.tensor(np.diff(bounds), device=query.device)
        n = len(bounds) - 1  # padding rows: a document each (the block mask skips all but their diagonal blocks)
        doc = torch.cat([torch.repeat_interleave(torch.arange(n, device=query.device), lengths),
                         torch.arange(n, n + P - T, device=query.device)])

        def mm(b, h, q, kv):
            return (kv <= q) & (doc[q] == doc[kv])

        _FLEX_MASKS.clear()
        mask = _FLEX_MASKS[bounds] = _mask_builder("inductor")(mm, None, None, P, P, device=str(query.device))
    pad = (0, 0, 0, P - T)
    q, k, v = (torch.nn.functional.pad(t, pad) for t in (query, key, value))
    o = _compiled("inductor")(q, k, v, block_mask=mask, scale=scaling, enable_gqa=True)
    return o[:, :, :T].transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(FLEX, flex_doc)


def liger_loss_fn() -> Callable[[Any, list[Datum]], torch.Tensor] | None:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # type: ignore[import-not-found]
    except ImportError:
        return None
    flce = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def loss(model, batch: list[Datum]) -> torch.Tensor:
        dev = model.device
        keep, tgt, w = trained(batch, dev)
        body = model.get_base_model().model
        h = body(**packed_inputs(batch, dev), use_cache=False).last_hidden_state[0, keep]
        return (flce(model.get_base_model().lm_head.weight, h, tgt).float() * w).sum()

    return loss


# ---------------------------------------------------------------- measuring


def matmul_peak(device: torch.device) -> float:
    """FLOP/s: median of bf16 (CUDA) or fp32 (CPU) torch.mm on a square shape."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        for _ in range(5):
            a @ b
        sync(device)
        times.append((time.perf_counter() - t) / 5)
    return 2 * n**3 / statistics.median(times[1:])


def flops_per_token(cfg: Any) -> tuple[float, int, int]:
    """4 N_base + 6 N_LoRA, N_base with the (tied) embedding counted once as the lm_head matmul."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * i
    n_base = L * per_layer + cfg.vocab_size * h
    lora_layer = RANK * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h))
    n_lora = L * lora_layer
    return 4 * n_base + 6 * n_lora, n_base, n_lora


def progress(msg: str) -> None:
    """A line on stderr while the bench runs (compiles and warm-ups can take minutes on a GPU)."""
    print(msg, file=sys.stderr, flush=True)


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def contender_makers(model_dir: Path, device: torch.device, dtype: torch.dtype, storage: Path
                     ) -> dict[str, Callable[[], Step]]:
    makers: dict[str, Callable[[], Step]] = {
        "ours-sdpa": lambda: make_ours(model_dir, device, storage, attention="sdpa"),
    }
    if device.type == "cuda":
        makers["ours-flex"] = lambda: make_ours(model_dir, device, storage / "flex", attention="flex")
    makers.update({
        "ours-before": lambda: make_ours(model_dir, device, storage / "before", before=True),
        "hf-padded": lambda: hf_step(peft_model(model_dir, device, dtype), padded_loss),
        "hf-packed": lambda: hf_step(peft_model(model_dir, device, dtype, VARLEN), packed_loss),
    })
    if device.type == "cuda":
        makers["hf-flex"] = lambda: hf_step(peft_model(model_dir, device, dtype, FLEX), packed_loss)
        liger = liger_loss_fn()
        if liger is not None:
            makers["liger"] = lambda: hf_step(peft_model(model_dir, device, dtype, VARLEN), liger)
    return makers


def child_main(args: Any) -> None:
    """One training contender in this process (`--child NAME`): its results as CHILD_MARK + JSON lines on stdout
    (setup_s and first_s with the first loss, then times and mem), or {"error": "out of memory"}."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = Path(args.model_dir)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    batches = make_batches(args.steps + 1, args.rows, args.min_len, args.max_len, cfg.vocab_size)
    FLEX_PAD[0] = -(-args.rows * args.max_len // 128) * 128

    def say(**kw: Any) -> None:
        print(CHILD_MARK + json.dumps(kw), flush=True)

    try:
        t0 = time.perf_counter()
        step = contender_makers(model_dir, device, dtype, Path(args.storage))[args.child]()
        sync(device)
        t1 = time.perf_counter()
        say(setup_s=t1 - t0)
        first = step(batches[0])  # the first loss (before any update), compiles included
        sync(device)
        say(first=first, first_s=time.perf_counter() - t1)
        times: list[float] = []
        mem = 0.0
        for _ in range(args.rounds):
            sync(device)
            if device.type == "cuda":
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            for b in batches[1:]:
                step(b)
            sync(device)
            times.append(time.perf_counter() - t)
            if device.type == "cuda":
                mem = max(mem, (torch.cuda.max_memory_allocated() - base) / 2**30)
        say(times=times, mem=mem)
    except Exception as exc:  # noqa: BLE001 (an out-of-memory contender is a result, anything else is not)
        if not is_oom(exc):
            raise
        say(error="out of memory")


def run_child(cmd: list[str], timeout: float) -> tuple[dict[str, Any], str | None]:
    """Run one contender's child under `timeout` seconds: (what it reported, None) or (..., why it did not finish).
    The child leads a process group of its own (inductor's compile workers join it), killed whole at the limit."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    info: dict[str, Any] = {}
    while True:
        left = timeout - (time.perf_counter() - t0)
        try:
            line = lines.get(timeout=max(0.0, left))
        except queue.Empty:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            done = "first step not finished" if "first_s" not in info else f"first step {info['first_s']:.1f} s, timing not finished"
            return info, f"timed out after {timeout:g} s ({done})"
        if line is None:
            break
        if line.startswith(CHILD_MARK):
            info.update(json.loads(line[len(CHILD_MARK):]))
    rc = proc.wait()
    if rc != 0:
        return info, f"failed (exit {rc}; its traceback is on stderr)"
    return info, info.get("error")


def bench_training(shape: str, model_dir: Path, cfg: Any, device: torch.device, dtype: torch.dtype, args: Any,
                   storage: Path, lines: list[str]) -> bool:
    """The training table; False when a contender crashed or a first loss disagreed (the bench then exits 1)."""
    batches = make_batches(args.steps + 1, args.rows, args.min_len, args.max_len, cfg.vocab_size)
    tokens = sum(d.length for b in batches[1:] for d in b)
    names = list(contender_makers(model_dir, device, dtype, storage))
    if args.only:
        keep = {REFERENCE, *args.only.split(",")}
        names = [n for n in names if n in keep]
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for name in names:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--model-dir", str(model_dir),
               "--storage", str(storage / name), "--device", device.type, "--rows", str(args.rows),
               "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--steps", str(args.steps),
               "--rounds", str(args.rounds)]
        info, why = run_child(cmd, args.contender_timeout)
        results[name] = info
        if why is not None:
            failed[name] = why
        first = f"first loss {info['first']:.4f}, first step {info['first_s']:.1f} s" if "first_s" in info else "no first step"
        progress(f"{shape}: {name}: {why or 'done'} ({first}; setup {info.get('setup_s', float('nan')):.1f} s)")
    ok = not any(w.startswith("failed") for w in failed.values())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    firsts = {n: r["first"] for n, r in results.items() if "first" in r}
    print(f"{shape}: first loss " + ", ".join(f"{k} {v:.4f}" for k, v in firsts.items()))
    ref = firsts.get(REFERENCE)
    for name, value in firsts.items():
        if ref is not None and abs(value - ref) > tol * abs(ref):
            print(f"{shape}: {name}'s first loss {value} differs from {REFERENCE}'s {ref} by more than {tol:.0e}")
            ok = False
    fpt, n_base, n_lora = flops_per_token(cfg)
    peak = matmul_peak(device)
    lines.append(f"\n### {shape} training: N_base {n_base / 1e6:.1f}M, N_LoRA {n_lora / 1e6:.2f}M, "
                 f"{args.rows} rows x {args.min_len}-{args.max_len} tokens, {tokens / args.steps:.0f} tokens/batch; "
                 f"MFU = tokens/s x (4 N_base + 6 N_LoRA = {fpt / 1e6:.1f} MFLOP/token) / {peak / 1e9:,.0f} GFLOP/s "
                 f"(measured {'bf16' if device.type == 'cuda' else 'fp32'} torch.mm); first step = the first "
                 f"forward_backward + optim_step after the model is built, compiles included; tokens/s = steady "
                 f"state, each contender in a process of its own, --contender-timeout {args.contender_timeout:.0f} s\n")
    lines.append("| contender | tokens/s | vs best hand loop | MFU | first step (s) | step peak above resident (GiB) |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    tps = {n: tokens / statistics.median(r["times"]) for n, r in results.items() if r.get("times") and n not in failed}
    hand = [v for n, v in tps.items() if not n.startswith("ours")]
    best = max(hand) if hand else float("nan")
    for name in names:
        first_s = f"{results[name]['first_s']:.1f}" if "first_s" in results[name] else ""
        if name in tps:
            mem = f"{results[name]['mem']:.2f}" if device.type == "cuda" else "n/a (CPU)"
            lines.append(f"| {name} | {tps[name]:,.0f} | {tps[name] / best:.2f}x | {100 * tps[name] * fpt / peak:.1f}% "
                         f"| {first_s} | {mem} |")
        else:
            lines.append(f"| {name} | {failed.get(name, 'failed')} | | | {first_s} | |")
    lines.extend(verdict(tps, results, best))
    return ok


def verdict(tps: dict[str, float], results: dict[str, dict[str, Any]], best_hand: float) -> list[str]:
    """The lines a device session decides on: flex against SDPA per block (what "auto" should run on CUDA), and
    the faster of ours against the best hand loop (issue #29's target: >= 2x)."""
    out = []
    if "ours-sdpa" in tps and "ours-flex" in tps:
        a, b = results["ours-sdpa"], results["ours-flex"]
        out.append(f"\nours-flex / ours-sdpa: {tps['ours-flex'] / tps['ours-sdpa']:.2f}x tokens/s; first step "
                   f"{b['first_s']:.1f} s vs {a['first_s']:.1f} s")
    mine = {n: v for n, v in tps.items() if n in ("ours-sdpa", "ours-flex")}
    if mine and best_hand == best_hand:  # not NaN: some hand loop finished
        name = max(mine, key=lambda n: mine[n])
        out.append(f"\n{name} / best hand loop: {mine[name] / best_hand:.2f}x (issue #29's target: >= 2x)")
    return out


def bench_rl(shape: str, model_dir: Path, cfg: Any, device: torch.device, args: Any, storage: Path,
             lines: list[str]) -> None:
    """Training steps/s (forward_backward importance_sampling + optim_step) on rl_basic-shaped batches, ours
    against ours before issue #29, interleaved."""
    batches = rl_batches(args.steps + 1, cfg.vocab_size)
    steps = {"ours": make_ours(model_dir, device, storage / "rl", loss_fn="importance_sampling"),
             "ours-before": make_ours(model_dir, device, storage / "rl-before", before=True, loss_fn="importance_sampling")}
    first = {n: s(batches[0]) for n, s in steps.items()}
    if abs(first["ours"] - first["ours-before"]) > 2e-2 * max(1.0, abs(first["ours-before"])):
        raise SystemExit(f"{shape} RL: first losses differ: {first}")
    times: dict[str, list[float]] = {n: [] for n in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync(device)
            t = time.perf_counter()
            for b in batches[1:]:
                step(b)
            sync(device)
            times[name].append((time.perf_counter() - t) / args.steps)
    per = {n: statistics.median(t) for n, t in times.items()}
    lines.append(f"\n### {shape} RL-shaped training steps (8 groups x 8 samples, 69-token prompts, 2-8 answer tokens; "
                 f"importance_sampling; sampling not included)\n")
    lines.append("| contender | steps/s | vs before |")
    lines.append("|---|---:|---:|")
    for name, v in per.items():
        lines.append(f"| {name} | {1 / v:.2f} | {per['ours-before'] / v:.2f}x |")


def bench_sampling(shape: str, model_dir: Path, cfg: Any, device: torch.device, dtype: torch.dtype, args: Any,
                   ours: Any, lines: list[str]) -> None:
    rng = np.random.default_rng(1)
    prompts = [list(map(int, rng.integers(0, cfg.vocab_size, args.prompt_len))) for _ in range(args.prompts)]
    new = args.new_tokens
    sampler = ours.client.save_weights_and_get_sampling_client().result()

    def run_ours() -> int:
        params = SamplingParams(max_tokens=new, temperature=1.0, stop=[], seed=0)
        futs = [sampler.sample(p, 1, params) for p in prompts]  # all submitted, then awaited: one batch
        return sum(len(s.tokens) for f in futs for s in f.result().sequences)

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    ids = torch.tensor(prompts, device=device)
    gen_kw = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": new,
              "min_new_tokens": new, "attention_mask": torch.ones_like(ids)}

    def run_generate(m: Any, **extra: Any) -> int:
        with torch.no_grad():
            out = m.generate(ids, **gen_kw, **extra)
        return int(out.shape[0] * (out.shape[1] - ids.shape[1]))

    # The engine behind the client, for its variants (run on this thread while the client's worker is idle).
    engine = sampler._sampler  # noqa: SLF001 - a bench reaching into the client it measures

    def variant(**attrs: Any) -> Callable[[], int]:
        from backends.local.sampler import Sampler, SampleRequest

        other = Sampler(engine.model, engine.tokenizer, device, seed=0)
        for k, v in attrs.items():
            setattr(other, k, v)
        params = SamplingParams(max_tokens=new, temperature=1.0, stop=[], seed=0)

        def run() -> int:
            return sum(len(s.tokens) for o in other.sample_batch([SampleRequest(p, 1, params) for p in prompts])
                       for s in o.sequences)
        return run

    contenders: dict[str, Callable[[], int]] = {"ours": run_ours}
    if device.type == "cuda":
        contenders["ours-eager"] = variant(cuda_graphs=False)
    contenders["ours-before"] = variant(fast=None)
    contenders["generate"] = lambda: run_generate(model)
    if device.type == "cuda":
        static = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        static.forward = torch.compile(static.forward, mode="reduce-overhead", fullgraph=True)
        contenders["generate static+compile"] = lambda: run_generate(static, cache_implementation="static")
    times: dict[str, list[float]] = {n: [] for n in contenders}
    made: dict[str, int] = {}
    for fn in contenders.values():
        fn()  # warm-up (compiles)
    for _ in range(args.rounds):
        for name, fn in contenders.items():
            sync(device)
            t = time.perf_counter()
            made[name] = fn()
            sync(device)
            times[name].append(time.perf_counter() - t)
    lines.append(f"\n### {shape} sampling: {args.prompts} prompts x {args.prompt_len} tokens, {new} new tokens each, T = 1\n")
    lines.append("| contender | new tokens/s | ours vs it |")
    lines.append("|---|---:|---:|")
    tps = {n: made[n] / statistics.median(t) for n, t in times.items()}
    for name, v in tps.items():
        lines.append(f"| {name} | {v:,.0f} | {tps['ours'] / v:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=None, help="comma list of: " + ", ".join(SHAPES) + " (default: 0.6b,1.7b on CUDA, tiny on CPU)")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 1 batch, fewer rows and prompts")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=None)
    ap.add_argument("--max-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="distinct batches per timed round")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--no-sampling", action="store_true")
    ap.add_argument("--no-training", action="store_true", help="skip the training contenders (bench/gpu_check.py's "
                    "sampling step)")
    ap.add_argument("--no-rl", action="store_true", help="skip the RL-shaped steps")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    ap.add_argument("--only", default=None, help=f"comma list of training contenders to run ({REFERENCE} is always run)")
    ap.add_argument("--contender-timeout", type=float, default=CONTENDER_TIMEOUT, metavar="S",
                    help=f"seconds per training contender, start-up and compiles included (default {CONTENDER_TIMEOUT:.0f})")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: run one contender (child_main)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--storage", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args)
        return
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = (args.shape or ("0.6b,1.7b" if device.type == "cuda" else "tiny")).split(",")
    small = device.type == "cpu"
    args.rows = args.rows or (4 if small else 16)
    args.min_len = args.min_len or (16 if small else 256)
    args.max_len = args.max_len or (64 if small else 2048)
    args.steps = args.steps or (1 if args.quick else 3)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.prompts = args.prompts or (4 if small else 64)
    args.new_tokens = args.new_tokens or (8 if small else 128)
    if small:
        args.prompt_len = min(args.prompt_len, 16)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"Device: {card}; torch {torch.__version__}, transformers {transformers.__version__}; "
             f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}; LoRA rank {RANK} on {', '.join(TARGETS)}; "
             f"{args.rounds} rounds of {args.steps} batch(es), medians (bench/bench_gpu.py)"]
    ok = True
    for shape in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir, cfg = write_model(shape, Path(tmp) / "model", dtype)
            if not args.no_training:
                done = len(lines)
                ok = bench_training(shape, model_dir, cfg, device, dtype, args, Path(tmp) / "storage", lines) and ok
                progress("\n".join(lines[done:]))  # each section as soon as it is measured (a run cut short keeps it)
            if not args.no_rl:
                done = len(lines)
                bench_rl(shape, model_dir, cfg, device, args, Path(tmp) / "storage", lines)
                progress("\n".join(lines[done:]))
            if not args.no_sampling:
                ours = make_ours(model_dir, device, Path(tmp) / "storage" / "sampling")
                done = len(lines)
                bench_sampling(shape, model_dir, cfg, device, dtype, args, ours, lines)
                progress("\n".join(lines[done:]))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if device.type == "cuda" and not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text("# bench/bench_gpu.py results\n\n" + text)
        print(f"wrote {RESULTS}")
    if not ok:
        raise SystemExit("a training contender failed or its first loss disagreed (above)")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
