"""Train tokens/s of the local backend vs hand-written torch+peft loops vs TRL's SFTTrainer, in one process.

Same random-weight model, same LoRA (rank 16, alpha 32, the attention and MLP Linear layers), same AdamW
(lr 1e-3), same batches of chat conversations (examples/data/chat_sft.jsonl rendered with the chat
template, truncated to --max-length), fp32 on the CPU. A step is forward + backward + optimizer step;
its tokens are the batch's input tokens (sum of len(model_input)). Contenders:

  ours          LocalBackend: forward_backward(cross_entropy) + optim_step futures, awaited every step
                (padding-free packed training, backends/local/packed.py: conversations that share a
                prefix of >= 16 tokens, here the system prompt, compute it once)
  ours-noshare  the same with prefix sharing off (packed.MIN_SHARED huge): every token of every row computed
  ours-padded   the same with backend.packed = false: padded chunks (batching.PAD_FILL), ours before packing
  ours-before   ours with the full-logits unembedding of before issue #29 (PackedLM.chunked_head = False; the
                chunked one skips the unembedding's backward at weight-0 positions): the CPU must not regress
  plain         the obvious loop: right-pad, model(ids, attention_mask).logits, weighted cross entropy,
                backward, AdamW step, zero_grad (ratio "vs plain")
  plain-nomask  the same without attention_mask (right padding cannot change a causal LM's real positions)
  packed        the batch as ONE row, no padding: position ids restart at 0 per conversation, causal SDPA
                per conversation (varlen_sdpa, registered with transformers.AttentionInterface; the
                boundaries reach it as cu_seq_lens_q; no mask is built), logits only where weights > 0
  bucketed      rows sorted by length and split into micro-batches by an exact DP minimising
                padded tokens + a fixed per-forward cost (in tokens, fitted at start-up: fit_per_forward);
                each micro-batch right-padded (no mask), backwarded before the next; one AdamW step
  trl           TRL SFTTrainer.train() with its defaults (gradient checkpointing ON), except fp32
                (bf16=False), the same batch size / lr / max_length, and a sequential sampler so it
                sees the same batches
  trl-nogc      the same with gradient_checkpointing=False
  trl-best      trl-nogc with padding_free=True (TRL's CPU-capable padding-free collator: one packed row,
                position ids + cu_seq_lens; with transformers' sdpa this builds a dense T x T block mask)
  trl-pf-varlen trl-best with the model on varlen_sdpa (TRL's collator, packed's attention)

The best hand-written peer is the fastest of plain, plain-nomask, packed, bucketed: "vs best" is each
contender's tokens/s over its. MFU = tokens/s x (4 N_base + 6 N_LoRA) / peak, where N_base counts the base
model's parameters with the tied embedding once (as the lm_head matmul; the input lookup is no matmul), N_LoRA
the adapter's, attention's score/value FLOPs are not counted, and peak is the best median GFLOP/s of fp32
torch.mm on a few shapes (2048^3 and the model's token x hidden x intermediate) sampled in the same run, at the start
and before every round.
Every contender's first-step loss (summed over trained tokens, before any update) must match plain's to 1e-4.

Each contender is warmed up, then timed in interleaved rounds (ours, plain, ..., ours, plain, ...) so
drift in the machine's load hits all alike; each round is --steps distinct batches; medians are reported.

    python bench/bench_train.py            # tiny (4 batches x 5 rounds) and wide (2 x 3), 1 thread, CPU clock
    python bench/bench_train.py --quick    # tiny only, 2 batches x 3 rounds
    python bench/bench_train.py --profile  # also where ours spends a step
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import transformers

# Measure the checkout this file is in: run as `python bench/bench_train.py`, sys.path[0] is bench/, and an
# editable install of the package elsewhere (another worktree) would otherwise supply backends/ and runner/.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from backends.local import batching
from backends.local import model as M
from backends.local.backend import LocalBackend
from backends.local.local_config import Local
from backends.local.tiny import _save, build_config, build_tokenizer
from backends.types import AdamParams, Datum, LoraSpec
from runner.algos.sft import to_datum
from runner.renderers.chat_template import render

try:
    import trl
except ImportError:  # optional: the `bench` extra
    trl = None

DATA = Path(__file__).resolve().parent.parent / "examples" / "data" / "chat_sft.jsonl"
RANK, ALPHA, LR = 16, 32.0, 1e-3
# Ours and plain use Tinker's AdamW defaults; TRL keeps its own (betas 0.9/0.999, eps 1e-8): same cost.
ADAM = AdamParams(learning_rate=LR)

# name -> overrides of the tiny config. "tiny" has ~0.8M params, "wide" ~25M (the shape bench_sampling.py
# calls "big"), where matmuls dominate even more.
MODELS = {
    "tiny": {},
    "wide": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 64},
}
# name -> (batches per round, rounds) unless given: a wide step takes ~5-10 s on one core.
ROUNDS = {"tiny": (4, 5), "wide": (2, 3)}

Step = Callable[[list[Datum]], float]


# ---------------------------------------------------------------- model and data


def write_model(name: str, path: Path) -> Path:
    """A random-weight model of shape `name` as an ordinary HF folder (every contender loads this)."""
    tok = build_tokenizer()
    base = {k: v for k, v in build_config(tok).to_dict().items() if k != "layer_types"}  # re-derived from depth
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**{**base, **MODELS[name]}))
    _save(model, tok, path)
    return path.resolve()


def make_batches(tok, n_batches: int, batch: int, max_length: int) -> list[list[Datum]]:
    """n_batches distinct batches: conversations in a seeded shuffle of the file, all assistant turns trained."""
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    order = np.random.default_rng(0).permutation(len(rows))
    data = []
    for i in order:
        tokens, weights = render(tok, rows[i]["messages"], "all_assistant_messages")
        d = to_datum(tokens, weights, max_length, "sum")
        if d is not None:
            data.append(d)
    if len(data) < n_batches * batch:
        raise SystemExit(f"{DATA} has {len(data)} usable rows; {n_batches} batches of {batch} need more")
    return [data[k * batch:(k + 1) * batch] for k in range(n_batches)]


def lora_config(targets: tuple[str, ...]):
    import peft

    return peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(targets), lora_dropout=0.0, bias="none",
                           task_type="CAUSAL_LM")


# ---------------------------------------------------------------- contenders: each returns a step function


def make_ours(model_dir: Path, storage: Path, packed: bool = True) -> tuple[Step, LocalBackend, object]:
    cfg = Local(device="cpu", dtype="float32", lora_alpha=ALPHA, packed=packed)
    backend = LocalBackend(cfg, str(model_dir), None, storage, seed=0)
    spec = LoraSpec(base_model=str(model_dir), rank=RANK, seed=0, train_unembed=False)
    client = backend.create_training_client(spec).result()

    def step(batch: list[Datum]) -> float:
        fb = client.forward_backward(batch, "cross_entropy")
        opt = client.optim_step(ADAM)
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss

    return step, backend, client


def no_share(step: Step) -> Step:
    """`step` with packed training's prefix sharing off (the step's jobs run while it waits for them)."""
    from backends.local import packed

    def run(batch: list[Datum]) -> float:
        keep, packed.MIN_SHARED = packed.MIN_SHARED, 1 << 30
        try:
            return step(batch)
        finally:
            packed.MIN_SHARED = keep

    return run


def peft_model(model_dir: Path, targets: tuple[str, ...], attn: str | None = None):
    """The base model from model_dir with a fresh LoRA (A seeded as ours; B = 0), fp32; `attn` sets the
    attention implementation (a transformers AttentionInterface name)."""
    import peft

    kw = {"attn_implementation": attn} if attn else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    torch.manual_seed(0)  # LoRA A init as ours (B = 0 either way, so the first loss matches regardless)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, lora_config(targets))


def adamw(model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps,
                             weight_decay=ADAM.weight_decay)


def padded(batch: list[Datum]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, targets, weights, attention mask: the batch right-padded to its longest row (pad id 0)."""
    width = max(d.length for d in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    targets = torch.zeros((len(batch), width), dtype=torch.long)
    weights = torch.zeros((len(batch), width))
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for row, d in enumerate(batch):
        n = d.length
        ids[row, :n] = torch.as_tensor(d.model_input)
        targets[row, :n] = torch.from_numpy(d.target_tokens)
        weights[row, :n] = torch.from_numpy(d.weights)
        attn[row, :n] = 1
    return ids, targets, weights, attn


def padded_loss(model, batch: list[Datum], mask: bool) -> torch.Tensor:
    """Summed weighted cross entropy of one right-padded forward (the plain loop's loss)."""
    ids, targets, weights, attn = padded(batch)
    logits = model(input_ids=ids, attention_mask=attn if mask else None, use_cache=False).logits
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return (nll * weights.flatten()).sum()


def make_plain(model_dir: Path, targets: tuple[str, ...], mask: bool) -> Step:
    model = peft_model(model_dir, targets)
    opt = adamw(model)

    def step(batch: list[Datum]) -> float:
        loss = padded_loss(model, batch, mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


# A varlen causal attention for a packed row, registered with transformers' AttentionInterface under this name.
# transformers builds no mask for it: create_causal_mask returns the (absent) 2D mask as is for any implementation
# that has no entry in ALL_MASK_ATTENTION_FUNCTIONS (masking_utils._preprocess_mask_arguments, "custom attention
# without equivalent mask creation"), so no T x T mask exists anywhere; varlen_sdpa asserts it gets None.
VARLEN = "bench_varlen_sdpa"


def varlen_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, cu_seq_lens_q=None, **kwargs):
    """Causal SDPA run separately on each sequence of a packed row. query (1, H, T, D), key/value (1, Hkv, T, D);
    cu_seq_lens_q: the sequence boundaries [0, l0, l0+l1, ..., T] (the kwarg flash-attention varlen kernels take,
    which TRL's padding-free collator also passes). Returns (1, T, H, D) as transformers' attention functions do."""
    assert attention_mask is None, "a dense mask was built for the packed row"
    assert query.shape[0] == 1 and cu_seq_lens_q is not None, "varlen_sdpa needs one packed row and cu_seq_lens_q"
    bounds = cu_seq_lens_q.tolist()
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=True)
        for s, e in itertools.pairwise(bounds)]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(VARLEN, varlen_sdpa)


def packed_inputs(batch: list[Datum]) -> dict[str, torch.Tensor | int]:
    """The batch as one row with no padding: position ids restart at 0 per conversation, boundaries as
    cu_seq_lens (the model hands **kwargs down to the attention function)."""
    lengths = [d.length for d in batch]
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    return {"input_ids": torch.cat([torch.as_tensor(d.model_input, dtype=torch.long) for d in batch])[None],
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}


def make_packed(model_dir: Path, targets: tuple[str, ...]) -> Step:
    """One packed row per batch, attention per conversation (varlen_sdpa), logits only where weights > 0."""
    model = peft_model(model_dir, targets, attn=VARLEN)
    assert model.config._attn_implementation == VARLEN, model.config._attn_implementation
    opt = adamw(model)

    def step(batch: list[Datum]) -> float:
        inputs = packed_inputs(batch)
        weights = torch.from_numpy(np.concatenate([d.weights for d in batch]))
        keep = torch.nonzero(weights > 0).flatten()  # positions with zero weight add nothing to the loss
        tgt = torch.from_numpy(np.concatenate([d.target_tokens for d in batch]))[keep]
        logits = model(**inputs, logits_to_keep=keep, use_cache=False).logits[0]
        loss = (torch.nn.functional.cross_entropy(logits, tgt, reduction="none") * weights[keep]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def plan_buckets(lengths: list[int], per_forward: float) -> list[list[int]]:
    """Indices in micro-batches minimising sum(rows x longest + per_forward) over the rows sorted longest first
    (an exact DP over contiguous runs of the sorted order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):
            c = best[i] + (j - i) * lengths[order[i]] + per_forward
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def make_bucketed(model_dir: Path, targets: tuple[str, ...], per_forward: float | None,
                  clock: Callable[[], float]) -> tuple[Step, float]:
    """Rows sorted by length, split by plan_buckets; each micro-batch right-padded (no mask), forwarded and
    backwarded before the next; one AdamW step. per_forward None: measured (fit_per_forward)."""
    model = peft_model(model_dir, targets)
    opt = adamw(model)
    if per_forward is None:
        per_forward = fit_per_forward(model, clock)

    def step(batch: list[Datum]) -> float:
        total = 0.0
        for idx in plan_buckets([d.length for d in batch], per_forward):
            loss = padded_loss(model, [batch[i] for i in idx], mask=False)
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    return step, per_forward


def fit_per_forward(model, clock: Callable[[], float], reps: int = 3) -> float:
    """The fixed cost of one forward+backward in padded tokens: the intercept / slope of a least-squares line
    through the median times of short random batches (rows x width), where attention's width^2 term is small."""
    shapes = [(r, w) for w in (64, 128) for r in (1, 2, 4, 8)]
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    xs, ys = [], []
    for rows, width in shapes:
        ids = torch.randint(0, vocab, (rows, width), generator=gen)
        times = []
        for rep in range(reps + 1):
            t0 = clock()
            model(input_ids=ids, use_cache=False).logits.sum().backward()
            if rep:  # the first is a warm-up
                times.append(clock() - t0)
        model.zero_grad(set_to_none=True)
        xs.append(rows * width)
        ys.append(statistics.median(times))
    slope, intercept = np.polyfit(xs, ys, 1)
    return max(0.0, float(intercept / slope))


# ---------------------------------------------------------------- MFU


def matmul_samples(shapes: list[tuple[int, int, int]], reps: int, clock: Callable[[], float],
                   into: dict[str, list[float]]) -> None:
    """Add `reps` GFLOP/s samples of torch.mm (m x k) @ (k x n), fp32, per shape (on this process's threads)."""
    gen = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        torch.mm(a, b)
        for _ in range(reps):
            t0 = clock()
            torch.mm(a, b)
            into.setdefault(f"{m}x{k}x{n}", []).append(2 * m * k * n / (clock() - t0) / 1e9)


def matmul_peak(shapes: list[tuple[int, int, int]], reps: int, clock: Callable[[], float]) -> dict[str, float]:
    """Median GFLOP/s of torch.mm (m x k) @ (k x n), fp32, per shape (on this process's threads)."""
    samples: dict[str, list[float]] = {}
    matmul_samples(shapes, reps, clock, samples)
    return {k: statistics.median(v) for k, v in samples.items()}


class TrlRunner:
    """SFTTrainer over a dataset of [warm batch] + the round's batches; each round is one trainer.train()
    of len(batches) + 1 steps, timed from the end of its first step to the end of its last, so the
    per-call setup (dataloader, accelerate prepare) is left out and everything per step is in.

    padding_free: TRL's padding-free collator (the batch flattened into one row, position ids restarting per
    conversation, cu_seq_lens passed along); max_length is then None (TRL refuses it without packing; the rows
    are already truncated). attn: the model's attention implementation (None: transformers' default, sdpa)."""

    def __init__(self, model_dir: Path, targets: tuple[str, ...], batches: list[list[Datum]], max_length: int,
                 gradient_checkpointing: bool, out_dir: Path, clock: Callable[[], float], padding_free: bool = False,
                 attn: str | None = None):
        import datasets

        tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        model = peft_model(model_dir, targets, attn)
        rows = [d for b in [batches[-1], *batches] for d in b]
        # Pre-tokenized: labels are the full sequence with untrained positions at -100 (HF shifts them).
        ds = datasets.Dataset.from_dict({
            "input_ids": [d.full_sequence for d in rows],
            "labels": [[-100] + [int(t) if w > 0 else -100 for t, w in zip(d.target_tokens, d.weights)] for d in rows],
        })
        self.steps = len(batches) + 1
        with warnings.catch_warnings():  # transformers 5 renames gradient_checkpointing; TRL still sets it
            warnings.simplefilter("ignore")
            args = trl.SFTConfig(
                output_dir=str(out_dir), per_device_train_batch_size=len(batches[0]), max_steps=self.steps,
                learning_rate=LR, max_length=None if padding_free else max_length, bf16=False,
                gradient_checkpointing=gradient_checkpointing, padding_free=padding_free,
                train_sampling_strategy="sequential", use_cpu=True, report_to="none", save_strategy="no",
                disable_tqdm=True, seed=0,
            )
        self.ends: list[float] = []
        ends, clock_ = self.ends, clock

        class Timer(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                ends.append(clock_())

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                          callbacks=[Timer()])
        transformers.logging.set_verbosity_error()
        self.batch = len(batches[0])

    def first_loss(self) -> float:
        """Summed loss of the trainer's model on batch 0 as its collator presents it, before any step: HF's mean
        cross entropy times the number of predicted labels (which with the same weights is the plain loop's sum)."""
        ds = self.trainer.train_dataset
        inputs = self.trainer.data_collator([ds[i] for i in range(self.batch, 2 * self.batch)])
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = self.trainer.model(**inputs, use_cache=False).loss
        return float(loss) * int((inputs["labels"][..., 1:] != -100).sum())

    def round(self) -> float:
        self.ends.clear()
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer.train()
        assert len(self.ends) == self.steps, self.ends
        return self.ends[-1] - self.ends[0]


# ---------------------------------------------------------------- profile of ours


def profile_ours(client, batch: list[Datum], reps: int, clock: Callable[[], float]) -> dict[str, float]:
    """Median seconds of each phase of ours' step (summed over chunks), run inline on this thread, next to
    the same step through the futures: the difference is the per-call overhead (worker thread handoff)."""
    from backends.local.loss_math import datum_loss, inputs_from_datum

    device = torch.device("cpu")
    parts: dict[str, list[float]] = {k: [] for k in ("validate", "forward+logprobs", "loss", "backward",
                                                     "logprobs to numpy", "optim_step", "inline total",
                                                     "via futures")}
    for _ in range(reps):
        acc = dict.fromkeys(parts, 0.0)
        t0 = clock()
        client._validate(batch, "cross_entropy")
        acc["validate"] = clock() - t0
        with torch.enable_grad():
            chunks = client._logprobs(batch)
            while True:
                t = clock()
                try:
                    idx, lps = next(chunks)  # the chunk's forward runs here
                except StopIteration:
                    break
                t1 = clock()
                loss = sum(datum_loss("cross_entropy", lp, inputs_from_datum(batch[i], device), {})
                           for i, lp in zip(idx, lps))
                t2 = clock()
                loss.backward()
                t3 = clock()
                _ = [lp.detach().cpu().numpy() for lp in lps]
                t4 = clock()
                for k, v in zip(("forward+logprobs", "loss", "backward", "logprobs to numpy"),
                                (t1 - t, t2 - t1, t3 - t2, t4 - t3)):
                    acc[k] += v
        t5 = clock()
        client._optim_step(ADAM)
        acc["optim_step"] = clock() - t5
        acc["inline total"] = clock() - t0
        t0 = clock()
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(ADAM).result()
        acc["via futures"] = clock() - t0
        for k, v in parts.items():
            v.append(acc[k])
    return {k: statistics.median(v) for k, v in parts.items()}


def describe_plan(batch: list[Datum], per_forward: float) -> str:
    lengths = [d.length for d in batch]
    plans = {"bucketed": plan_buckets(lengths, per_forward)}
    fill = getattr(batching, "PAD_FILL", None)
    if fill is not None:
        try:  # ours' chunk planner (backends/local/batching.py) may change under this bench
            plans["ours (cpu plan)"] = batching.plan_chunks(lengths, batching.chunk_tokens(259), fill)
        except (AttributeError, TypeError) as e:
            print(f"(ours' chunk plan not shown: {e})")
    plans["one chunk"] = [list(range(len(lengths)))]
    return ", ".join(f"{k}: {len(c)} chunk(s), {sum(len(x) * max(lengths[i] for i in x) for x in c)} padded"
                     for k, c in plans.items()) + f" for {sum(lengths)} real tokens"


# ---------------------------------------------------------------- main

HAND_WRITTEN = ("plain", "plain-nomask", "packed", "bucketed")


def bench_model(name: str, args, clock: Callable[[], float], tmp: Path) -> None:
    steps, rounds = args.steps or ROUNDS[name][0], args.rounds or ROUNDS[name][1]
    model_dir = write_model(name, tmp / name)
    tok = build_tokenizer()
    batches = make_batches(tok, steps, args.batch, args.max_length)
    tokens = sum(d.length for b in batches for d in b)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    targets = M.lora_targets(base, attn=True, mlp=True, unembed=False)
    n_params = sum(p.numel() for p in base.parameters())  # the tied embedding once (as the lm_head matmul)
    cfg = base.config
    del base
    n_lora = sum(p.numel() for p in peft_model(model_dir, targets).parameters() if p.requires_grad)
    flops_per_token = 4 * n_params + 6 * n_lora
    lengths = [d.length for b in batches for d in b]
    print(f"\n{name}: {n_params / 1e6:.2f}M params, {len(targets)} LoRA layers ({n_lora / 1e6:.3f}M params); "
          f"{rounds} rounds of {steps} batches x {args.batch} rows, {tokens} input tokens per round "
          f"(rows {min(lengths)}..{max(lengths)} tokens)", flush=True)

    # MFU denominator: this thread's fp32 matmul peak, measured now (same process, same load).
    t0 = sum(d.length for d in batches[0])
    shapes = [(2048, 2048, 2048), (t0, cfg.hidden_size, cfg.intermediate_size),
              (t0, cfg.intermediate_size, cfg.hidden_size), (t0, cfg.hidden_size, cfg.hidden_size)]
    # Sampled now and again before every round (this machine's speed drifts by ~5-10% over minutes): the peak is
    # the best shape's median over all samples.
    peak_samples: dict[str, list[float]] = {}
    matmul_samples(shapes, 3 if args.quick else 7, clock, peak_samples)
    print("fp32 torch.mm GFLOP/s at the start (median): "
          + ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in peak_samples.items())
          + f"; model FLOPs/token 4*N_base + 6*N_LoRA = {flops_per_token / 1e6:.2f}M")

    ours, backend, client = make_ours(model_dir, tmp / f"{name}-storage")
    ours_padded, backend_padded, _ = make_ours(model_dir, tmp / f"{name}-storage-padded", packed=False)
    ours_noshare, backend_noshare, _ = make_ours(model_dir, tmp / f"{name}-storage-noshare")
    ours_noshare = no_share(ours_noshare)
    ours_before, backend_before, client_before = make_ours(model_dir, tmp / f"{name}-storage-before")
    if client_before.packed is not None:
        client_before.packed.chunked_head = False
    from backends.local.packed import plan

    min_shared = client.packed.min_shared() if client.packed is not None else None
    computed = sum(len(layout.tokens) for b in batches for layout in plan(b, 1 << 30, min_shared))
    print(f"ours computes {computed} of the {tokens} input tokens per round (shared prefixes once)")
    plain, plain_nomask = make_plain(model_dir, targets, True), make_plain(model_dir, targets, False)
    packed = make_packed(model_dir, targets)
    bucketed, per_forward = make_bucketed(model_dir, targets, args.per_forward, clock)
    print(f"bucketed: fixed cost per forward+backward {per_forward:.0f} padded tokens"
          f"{' (measured)' if args.per_forward is None else ''}")
    print(f"batch 0: {describe_plan(batches[0], per_forward)}")
    # Before any update the LoRA delta is 0, so every contender sees the base model: the same loss.
    first = {"ours": ours(batches[0]), "ours-noshare": ours_noshare(batches[0]), "ours-before": ours_before(batches[0]),
             "ours-padded": ours_padded(batches[0]), "plain": plain(batches[0]), "plain-nomask": plain_nomask(batches[0]),
             "packed": packed(batches[0]), "bucketed": bucketed(batches[0])}

    def loop(step: Step) -> Callable[[], float]:
        def run() -> float:
            t0 = clock()
            for b in batches:
                step(b)
            return clock() - t0
        return run

    contenders: dict[str, Callable[[], float]] = {"ours": loop(ours), "ours-noshare": loop(ours_noshare),
                                                  "ours-padded": loop(ours_padded), "ours-before": loop(ours_before)}
    contenders.update({"plain": loop(plain), "plain-nomask": loop(plain_nomask), "packed": loop(packed),
                       "bucketed": loop(bucketed)})
    if args.trl:
        trls = {"trl": {"gradient_checkpointing": True}, "trl-nogc": {"gradient_checkpointing": False},
                "trl-best": {"gradient_checkpointing": False, "padding_free": True},
                "trl-pf-varlen": {"gradient_checkpointing": False, "padding_free": True, "attn": VARLEN}}
        for label, kw in trls.items():
            runner = TrlRunner(model_dir, targets, batches, args.max_length, out_dir=tmp / f"{name}-{label}",
                               clock=clock, **kw)
            first[label] = runner.first_loss()
            contenders[label] = runner.round
    ref = first["plain"]
    print("first-step loss (sum): " + ", ".join(f"{k} {v:.4f}" for k, v in first.items()))
    bad = {k: v for k, v in first.items() if abs(v - ref) > 1e-4 * abs(ref)}
    assert not bad, f"first-step loss differs from plain's {ref}: {bad}"

    if args.only:
        contenders = {k: v for k, v in contenders.items() if k in args.only.split(",")}
    for run in contenders.values():  # warm-up
        run()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        matmul_samples(shapes, 3, clock, peak_samples)
        for label, run in contenders.items():
            times[label].append(run())
    gflops = {k: statistics.median(v) for k, v in peak_samples.items()}
    peak = max(gflops.values())
    print("fp32 torch.mm GFLOP/s over the run (median of " + f"{len(next(iter(peak_samples.values())))} samples): "
          + ", ".join(f"{k} {v:.1f}" for k, v in gflops.items()) + f"; peak {peak:.1f}")
    rates = {k: tokens / statistics.median(v) for k, v in times.items()}
    best = max((k for k in HAND_WRITTEN if k in rates), key=lambda k: rates[k], default="ours")
    print(f"{'model':5} {'contender':13} {'tok/s':>8} {'vs best':>7} {'vs plain':>8} {'MFU':>6} {'ms/step':>8} "
          f"{'max/min':>7}")
    for label, rate in rates.items():
        print(f"{name:5} {label:13} {rate:8.0f} {rate / rates[best]:6.2f}x {rate / rates.get('plain', float('nan')):7.2f}x "
              f"{rate * flops_per_token / (peak * 1e9):6.1%} {statistics.median(times[label]) * 1000 / steps:8.1f} "
              f"{max(times[label]) / min(times[label]):7.2f}", flush=True)
    print(f"{name} seconds per round, in round order: "
          + "; ".join(f"{k} " + " ".join(f"{t:.2f}" for t in v) for k, v in times.items()))
    summary = f"{name}: best hand-written peer {best}; ours / {best} = {rates['ours'] / rates[best]:.2f}x"
    if args.trl and not args.only:
        best_trl = max(("trl", "trl-nogc", "trl-best"), key=lambda k: rates[k])
        summary += (f"; ours / trl (defaults) = {rates['ours'] / rates['trl']:.2f}x; fastest TRL option "
                    f"{best_trl}: ours / {best_trl} = {rates['ours'] / rates[best_trl]:.2f}x")
    print(summary)
    if args.profile:
        try:  # reaches into ours' internals, which may change under this bench
            prof = profile_ours(client, batches[0], rounds, clock)
        except (AttributeError, TypeError, ImportError) as e:
            print(f"{name} ours: profile skipped ({type(e).__name__}: {e})")
        else:
            print(f"{name} ours, phases of one step on batch 0 (ms, median of {rounds}):")
            for k, v in prof.items():
                print(f"    {k:18} {v * 1000:8.2f}")
    backend.close()
    backend_padded.close()
    backend_noshare.close()
    backend_before.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model only, 3 rounds of 2 batches")
    ap.add_argument("--models", default=None, help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=None, help="distinct batches per timed round (default: ROUNDS)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per contender (default: ROUNDS)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    # "cpu" (default) times the process's CPU seconds: on a shared machine wall time mostly measures the
    # neighbours. With one thread that is the wall time an idle machine would show.
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--trl", action=argparse.BooleanOptionalAction, default=None,
                    help="include TRL's SFTTrainer (default: when trl imports)")
    ap.add_argument("--profile", action="store_true", help="break ours' step into phases")
    ap.add_argument("--only", default=None, help="comma list of contenders to time (all are checked for the first loss)")
    ap.add_argument("--per-forward", type=float, default=None,
                    help="bucketed: fixed cost of a forward+backward in padded tokens (default: measured)")
    args = ap.parse_args()
    args.models = args.models or ("tiny" if args.quick else "tiny,wide")
    if args.quick:
        args.steps, args.rounds = args.steps or 2, args.rounds or 3
    if args.trl is None:
        args.trl = trl is not None
        if trl is None:
            print("trl does not import: skipping SFTTrainer (pip install trl; see bench/README.md)")
    elif args.trl and trl is None:
        raise SystemExit("--trl: trl does not import")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    transformers.utils.logging.disable_progress_bar()
    import datasets
    import peft

    datasets.disable_progress_bars()
    trl_version = f", trl {trl.__version__}" if args.trl else ""

    print(f"backends from {Path(M.__file__).parent}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}{trl_version}; "
          f"fp32 cpu, {args.threads} thread(s), {args.clock} clock; batch {args.batch}, max_length {args.max_length}, "
          f"LoRA r{RANK}/alpha{ALPHA:g} attn+mlp, AdamW lr {LR:g}; medians of interleaved rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for name in args.models.split(","):
            bench_model(name, args, clock, Path(tmp))
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
