"""The numerics gate: does the trainer see the sampled tokens as the sampler did?

Every RL and distillation step already has both sides: the sampler's logprob of each sampled token (in the datum)
and the trainer's (forward_backward's output, before the update). With Δ = sampler_lp − trainer_lp over the action
tokens (mask > 0):
  optim/kl_sample_train_v1 = mean(Δ), v2 = ½·mean(Δ²)   (runner/rl/kl.py, the cookbook's names)
  numerics/max_abs_dlogprob, numerics/mean_abs_dlogprob, numerics/frac_dlogprob_gt_0.1, numerics/tokens  (here)
No extra forward is made. The recipe's `numerics = {...}` table (runner/recipe/numerics.py) turns them into a gate
(`Gate`): "warn" prints one line per failing step (rate-limited), "stop" ends the run with a UserError (exit 2)
before the failing step's metrics row and checkpoint row are written, so the run dir's last checkpoint is the
last step that passed.

`runner numerics FILE#name` (`check`) runs the same comparison alone, with a third side: the sampling client's
compute_logprobs. docs/numerics.md has the thresholds, the temperature caveat and measured values.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from backends.errors import UserError
from backends.types import Datum, SamplingParams
from runner.recipe.numerics import Numerics

BIG_DLOGPROB = 0.1  # numerics/frac_dlogprob_gt_0.1
FRAC_KEY = f"numerics/frac_dlogprob_gt_{BIG_DLOGPROB:g}"


def action_logprobs(data_D: Sequence[Datum], train_logprobs_D: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sampler, trainer) logprobs of every action token (mask > 0) of the batch, flattened."""
    sampled_T: list[np.ndarray] = []
    trained_T: list[np.ndarray] = []
    for d, lp in zip(data_D, train_logprobs_D, strict=True):
        assert d.logprobs is not None and d.mask is not None  # runner/rl/datums.py sets both
        on = d.mask > 0
        sampled_T.append(d.logprobs[on])
        trained_T.append(np.asarray(lp, dtype=np.float32)[on])
    if not sampled_T:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(sampled_T), np.concatenate(trained_T)


def diff_stats(diff: np.ndarray) -> dict[str, float]:
    """kl_v1, kl_v2, mean/max |Δ|, the fraction over BIG_DLOGPROB, and the count, of Δ = sampler − other."""
    if diff.size == 0:
        return {}
    a = np.abs(diff)
    return {"kl_v1": float(diff.mean()), "kl_v2": float(0.5 * (diff**2).mean()), "mean_abs": float(a.mean()),
            "max_abs": float(a.max()), "frac_big": float((a > BIG_DLOGPROB).mean()), "tokens": float(diff.size)}


def dlogprob_metrics(data_D: Sequence[Datum], train_logprobs_D: Sequence[np.ndarray]) -> dict[str, float]:
    """The numerics/* metrics of a step (the KL pair is optim/kl_sample_train_v1/v2, from runner/rl/kl.py)."""
    sampled, trained = action_logprobs(data_D, train_logprobs_D)
    s = diff_stats(sampled - trained)
    if not s:
        return {}
    return {"numerics/max_abs_dlogprob": s["max_abs"], "numerics/mean_abs_dlogprob": s["mean_abs"],
            FRAC_KEY: s["frac_big"], "numerics/tokens": s["tokens"]}


def failures(cfg: Numerics, kl_v1: float, kl_v2: float, max_abs: float) -> list[str]:
    """What is over the limits, as 'name value > limit' (empty: passed)."""
    out = []
    if abs(kl_v1) > cfg.max_kl:
        out.append(f"|kl_sample_train_v1| {abs(kl_v1):.3g} > max_kl {cfg.max_kl:g}")
    if kl_v2 > cfg.max_kl:
        out.append(f"kl_sample_train_v2 {kl_v2:.3g} > max_kl {cfg.max_kl:g}")
    if cfg.max_abs_dlogprob is not None and max_abs > cfg.max_abs_dlogprob:
        out.append(f"max_abs_dlogprob {max_abs:.3g} > {cfg.max_abs_dlogprob:g}")
    return out


class Gate:
    """Acts on a step's metrics (RLAlgo.finish calls `check`). `warn_every_s`: at most one warning line per that
    many seconds; the next line counts the failing steps it did not show."""

    def __init__(self, cfg: Numerics | None, warn_every_s: float = 60.0, stream: TextIO | None = None):
        self.cfg, self.warn_every_s, self.stream = cfg, warn_every_s, stream
        self.last_warn = -float("inf")
        self.unshown = 0

    def check(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """{"numerics/gate_failed": 0 or 1} for the row; raises UserError when a failing step must stop the run."""
        cfg = self.cfg
        if cfg is None or step < cfg.after_steps or "optim/kl_sample_train_v1" not in metrics:
            return {}
        bad = failures(cfg, metrics["optim/kl_sample_train_v1"], metrics["optim/kl_sample_train_v2"],
                       metrics.get("numerics/max_abs_dlogprob", 0.0))
        if not bad:
            return {"numerics/gate_failed": 0.0}
        what = f"numerics gate: step {step}: the sampler's and the trainer's logprobs of the sampled tokens disagree: " \
               + ", ".join(bad)
        if cfg.action == "stop":
            raise UserError(f"{what}; run stopped before step {step} was checkpointed (its last checkpoint is the "
                            "last step that passed); see docs/numerics.md")
        now = time.monotonic()
        if now - self.last_warn < self.warn_every_s:
            self.unshown += 1
        else:
            more = f" ({self.unshown} more failing steps since the last warning)" if self.unshown else ""
            _write(f"warning: {what}{more}", self.stream)
            self.last_warn, self.unshown = now, 0
        return {"numerics/gate_failed": 1.0}


def _write(line: str, stream: TextIO | None) -> None:
    """One line on stderr (through tqdm, so a live progress bar is redrawn under it)."""
    from tqdm import tqdm

    tqdm.write(line, file=stream or sys.stderr)


# ---------------------------------------------------------------- `runner numerics FILE#name`

# When the recipe's algorithm has no prompts of its own (SFT, DPO, ...): generic chat prompts.
GENERIC_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works.",
    "List five uses of a paperclip.",
    "What is 17 times 23? Show your work.",
    "Describe the water cycle to a child.",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Give three arguments for and against remote work.",
    "Write a haiku about autumn.",
]
WORST = 5
# Context-depth buckets (absolute position in the sequence): the cookbook's check found a trainer bug by depth.
DEPTHS = [0, 64, 256, 1024, 4096, 16384]


@dataclass(frozen=True)
class TokenRow:
    """One sampled token: its prompt, absolute position, and the three logprobs."""

    prompt: int
    pos: int
    token: int
    text: str
    sampler: float
    compute: float
    trainer: float


@dataclass
class Report:
    model: str
    backend: str
    prompts: int
    temperature_note: str
    pairs: dict[str, dict[str, float]]
    depth: list[dict[str, float]]
    worst: list[TokenRow]
    limits: dict[str, Any]
    failed: list[str]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["worst"] = [asdict(r) for r in self.worst]
        return out


PAIRS = {
    "sampler - trainer": ("sampler", "trainer"),
    "sampler - compute_logprobs": ("sampler", "compute"),
    "compute_logprobs - trainer": ("compute", "trainer"),
}


def summarize(rows: Sequence[TokenRow], cfg: Numerics, model: str, backend: str, n_prompts: int,
              note: str) -> Report:
    cols = {k: np.array([getattr(r, k) for r in rows], dtype=np.float64) for k in ("sampler", "compute", "trainer")}
    pairs = {name: diff_stats(cols[a] - cols[b]) for name, (a, b) in PAIRS.items()}
    pos = np.array([r.pos for r in rows])
    diff = cols["sampler"] - cols["trainer"]
    depth = []
    for lo, hi in zip(DEPTHS, [*DEPTHS[1:], None], strict=True):
        on = (pos >= lo) & (pos < hi) if hi is not None else pos >= lo
        if on.any():
            depth.append({"from": float(lo), "to": float(hi) if hi is not None else float("inf"), **diff_stats(diff[on])})
    worst = [rows[i] for i in np.argsort(-np.abs(diff), kind="stable")[:WORST]]
    st = pairs["sampler - trainer"]
    failed = failures(cfg, st.get("kl_v1", 0.0), st.get("kl_v2", 0.0), st.get("max_abs", 0.0))
    limits = {"max_kl": cfg.max_kl, "max_abs_dlogprob": cfg.max_abs_dlogprob}
    return Report(model, backend, n_prompts, note, pairs, depth, worst, limits, failed)


def render(report: Report, out: TextIO) -> None:
    w = out.write
    w(f"numerics check: {report.model} on {report.backend}, {report.prompts} prompts, "
      f"{int(report.pairs['sampler - trainer'].get('tokens', 0))} sampled tokens; {report.temperature_note}\n\n")
    head = f"{'Δ logprob':<28}{'kl_v1':>11}{'kl_v2':>11}{'mean|Δ|':>11}{'max|Δ|':>11}{'>' + format(BIG_DLOGPROB, 'g'):>9}\n"
    w(head)
    for name, s in report.pairs.items():
        if s:
            w(f"{name:<28}{s['kl_v1']:>11.3g}{s['kl_v2']:>11.3g}{s['mean_abs']:>11.3g}{s['max_abs']:>11.3g}"
              f"{s['frac_big']:>9.1%}\n")
    w("\nsampler - trainer by position in the sequence\n")
    w(f"{'positions':<28}{'kl_v1':>11}{'kl_v2':>11}{'mean|Δ|':>11}{'max|Δ|':>11}{'tokens':>9}\n")
    for d in report.depth:
        span = f"{int(d['from'])}-{int(d['to']) - 1}" if d["to"] != float("inf") else f"{int(d['from'])}+"
        w(f"{span:<28}{d['kl_v1']:>11.3g}{d['kl_v2']:>11.3g}{d['mean_abs']:>11.3g}{d['max_abs']:>11.3g}"
          f"{int(d['tokens']):>9}\n")
    w(f"\nworst tokens (|sampler - trainer|)\n{'prompt':>6}{'pos':>7}  {'token':<16}{'sampler':>10}{'compute':>10}"
      f"{'trainer':>10}{'Δ':>10}\n")
    for r in report.worst:
        w(f"{r.prompt:>6}{r.pos:>7}  {r.text[:16]!r:<16}{r.sampler:>10.4f}{r.compute:>10.4f}{r.trainer:>10.4f}"
          f"{r.sampler - r.trainer:>10.2e}\n")
    lim = f"max_kl {report.limits['max_kl']:g}" + (
        f", max_abs_dlogprob {report.limits['max_abs_dlogprob']:g}" if report.limits["max_abs_dlogprob"] else "")
    w(f"\n{'FAILED: ' + '; '.join(report.failed) if report.failed else 'ok'} ({lim})\n")


async def prompts_of(recipe: Any, tokenizer: Any, n: int) -> list[tuple[list[int], Any]]:
    """n (prompt tokens, stop) from the recipe's env / prompt sets (RL, distill), else generic chat prompts."""
    from runner.algos import make_algo
    from runner.rl.algo import RLAlgo
    from runner.rl.renderer import ChatRenderer

    out: list[tuple[list[int], Any]] = []
    if type(recipe.algo).__name__ in ("RL", "Distill"):
        algo = make_algo(recipe)(tokenizer)
        assert isinstance(algo, RLAlgo)
        for k in range(len(algo.train)):
            for builder in algo.builders(k):
                first = await (await builder.make_envs())[0].initial_observation()
                if first is not None:
                    out.append((list(first[0]), first[1]))
                if len(out) >= n:
                    return out
    renderer = ChatRenderer(tokenizer)
    i = 0
    while len(out) < n:
        out.append((renderer.build_prompt([{"role": "user", "content": GENERIC_PROMPTS[i % len(GENERIC_PROMPTS)]}]),
                    renderer.stop_tokens))
        i += 1
    return out


async def measure(recipe: Any, backend: Any, n: int) -> tuple[list[TokenRow], str]:
    """Sample n prompts at temperature 1 from a fresh training client's weights, then score the samples with the
    sampling client's compute_logprobs and the training client's forward; one TokenRow per sampled token."""
    from runner.engine.loop import lora_spec

    tokenizer = backend.get_tokenizer()
    prompts = await prompts_of(recipe, tokenizer, n)
    tc = await backend.create_training_client(lora_spec(recipe))
    sampler = await tc.save_weights_and_get_sampling_client()
    max_tokens = int(getattr(recipe.algo, "max_tokens", 64))
    outs = await asyncio.gather(*(
        sampler.sample(p, 1, SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=stop, seed=recipe.seed + i))
        for i, (p, stop) in enumerate(prompts)))
    seqs = [(p, o.sequences[0]) for (p, _), o in zip(prompts, outs, strict=True) if o.sequences[0].tokens]
    if not seqs:
        raise UserError("runner numerics: every sample was empty; nothing to compare")
    fulls = [p + s.tokens for p, s in seqs]
    computed = await asyncio.gather(*(sampler.compute_logprobs(f) for f in fulls))
    data_D = [Datum(model_input=f[:-1], target_tokens=np.asarray(f[1:]),
                    weights=np.asarray([0.0] * (len(p) - 1) + [1.0] * len(s.tokens), dtype=np.float32))
              for f, (p, s) in zip(fulls, seqs, strict=True)]
    fwd = await tc.forward(data_D, "cross_entropy")
    rows = []
    for i, ((p, s), comp, train) in enumerate(zip(seqs, computed, fwd.logprobs, strict=True)):
        for j, (tok, lp) in enumerate(zip(s.tokens, s.logprobs, strict=True)):
            pos = len(p) + j
            c = comp[pos]
            rows.append(TokenRow(i, pos, int(tok), tokenizer.decode([tok]), float(lp),
                                 float(c) if c is not None else float("nan"), float(np.asarray(train)[pos - 1])))
    temperature = getattr(recipe.algo, "temperature", 1.0)
    note = "sampled at temperature 1" + (
        f" (the recipe samples at {temperature:g}, where the gate does not apply)" if temperature != 1.0 else "")
    return rows, note


def check(ref: str, overrides: Sequence[str], n: int, as_json: bool, out: TextIO,
          backend: Any = None) -> int:
    """`runner numerics`: the table (or JSON) on `out`; 1 when over the recipe's limits (its numerics table, else
    the defaults), else 0."""
    from runner.recipe.load import load_recipe

    _, recipe = load_recipe(ref, overrides)
    cfg = getattr(recipe.algo, "numerics", None) or Numerics()
    with tempfile.TemporaryDirectory(prefix="runner-numerics-") as tmp:
        own = backend is None
        if own:
            backend = recipe.backend.make(recipe.model, recipe.tokenizer, Path(tmp), recipe.seed)
        try:
            rows, note = asyncio.run(measure(recipe, backend, n))
        finally:
            if own:
                backend.close()
    report = summarize(rows, cfg, recipe.model, str(type(recipe.backend).__struct_config__.tag), n, note)
    if as_json:
        out.write(json.dumps(report.to_json(), allow_nan=True) + "\n")
    else:
        render(report, out)
    return 1 if report.failed else 0
