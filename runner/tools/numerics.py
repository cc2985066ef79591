"""`runner numerics FILE#name`: the numerics gate's comparison alone, for a recipe's model and backend.

Samples N prompts (the recipe's env or prompt sets, else GENERIC_PROMPTS) at temperature 1 from a fresh training
client's weights, then scores the sampled tokens three ways: the sampler's own logprobs, the sampling client's
compute_logprobs, and the training client's forward. The report: KL and |Δ| stats per pair, sampler − trainer by
position in the sequence, and the worst tokens; exit 1 when sampler − trainer is over the recipe's numerics limits
(its `numerics` table, else the defaults). The per-step metrics and the gate are runner/rl/gate.py.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import numpy as np

from backends.base import Backend
from backends.errors import UserError
from backends.tokenizer import Tokenizer, decode_text
from backends.types import Datum, Json, SamplingParams
from runner.recipe.numerics_table import Numerics
from runner.recipe.schema import Recipe
from runner.rl.gate import BIG_DLOGPROB, diff_stats, failures

if TYPE_CHECKING:
    from runner.rl.types import StopCondition

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
    limits: Json
    failed: list[str]

    def to_json(self) -> Json:
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


async def prompts_of(recipe: Recipe, tokenizer: Tokenizer, n: int) -> list[tuple[list[int], StopCondition]]:
    """n (prompt tokens, stop) from the recipe's env / prompt sets (RL, distill), else generic chat prompts."""
    from runner.algos.rl import RLAlgo
    from runner.engine.spec import make_algo
    from runner.renderers.chat import ChatRenderer

    out: list[tuple[list[int], StopCondition]] = []
    if type(recipe.algo).__name__ in ("RL", "Distill"):
        algo = make_algo(recipe)(tokenizer)
        assert isinstance(algo, RLAlgo)
        for k in range(len(algo.train)):
            for builder in algo.builders(k):
                envs = await builder.make_envs()
                first = await envs[0].initial_observation() if envs else None  # a builder may make none
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


async def measure(recipe: Recipe, backend: Backend, n: int) -> tuple[list[TokenRow], str]:
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
            rows.append(TokenRow(i, pos, int(tok), decode_text(tokenizer, [tok]), float(lp),
                                 float(c) if c is not None else float("nan"), float(np.asarray(train)[pos - 1])))
    temperature = getattr(recipe.algo, "temperature", 1.0)
    note = "sampled at temperature 1" + (
        f" (the recipe samples at {temperature:g}, where the gate does not apply)" if temperature != 1.0 else "")
    return rows, note


def check(ref: str, overrides: Sequence[str], n: int, as_json: bool, out: TextIO,
          backend: Backend | None = None) -> int:
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
