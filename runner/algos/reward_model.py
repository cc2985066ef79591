"""A pairwise reward model (the cookbook's RLHF stage 2, preference/rlhf) behind the loop's Algorithm interface.

Supervised training of a judge on comparisons: the input is one user message showing the conversation and both
completions, "which completion is better, A or B?" (runner/data/comparisons.py `judge_messages`), and the target is the
preferred label as the assistant's reply, cut right after the label token, so exactly one token is trained. Every
comparison is trained in both orders (A/B swapped, so the label flips): a judge cannot learn that one position
tends to win. Plain forward_backward(cross_entropy) + optim_step, as SFT.

The label position carries two targets (a (N, 2) cross_entropy datum): the preferred label, weight 1, and the
other label, weight 0. The gradient is SFT's, and the same forward also returns the logprob of the other label, so
accuracy comes for free: per comparison, P(chosen better) = the mean over both orders of σ(lp(preferred label) −
lp(other label)), correct when > 0.5, a tie (0.5 up to rounding) counted 1/2 (what runner/rewards/judge.py `judge_prob` computes from a sampling
client). Metrics: train_mean_nll (−lp of the preferred label, whole vocabulary), accuracy; test/nll and
test/accuracy on the held-out comparisons every eval_every steps (a forward, no gradient) and, as RL and DPO, once
more after the last step on the final sampler weights (through compute_logprobs), at step = total steps.
Ties are dropped and counted (runner/data/comparisons.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from backends.base import Future, TrainingClient
from backends.errors import UserError
from backends.tokenizer import Tokenizer
from backends.types import AdamParams, Datum, ForwardBackwardOutput, Json, OptimStepOutput
from runner.algos.dpo import tie_accuracy
from runner.algos.reward_model_config import RewardModel
from runner.algos.sft import PLAN_STEPS
from runner.data.comparisons import Batches, Pair, Pairs, load_pairs, render_judge
from runner.engine.context import AlgorithmBase, Context, FinalContext
from runner.engine.spec import AlgoSpec, BuildArgs, Settings
from runner.recipe.schema import Recipe
from runner.renderers import Renderer
from runner.rewards.judge import label_logprobs, p_first


@dataclass(frozen=True)
class Judged:
    """One order of one comparison: the judge prompt, the preferred label's token and the other one."""

    prefix: list[int]
    label: int
    other: int


def orders(renderer: Renderer, pair: Pair, max_length: int) -> list[Judged]:
    """Both orders of a comparison: (A = chosen, B = rejected, label "A"), then (A = rejected, B = chosen, "B")."""
    out = []
    for a, b, preferred in ((pair.chosen, pair.rejected, 0), (pair.rejected, pair.chosen, 1)):
        try:
            prefix, tok_a, tok_b = render_judge(renderer, pair.prompt, a, b)
        except UserError as e:
            raise UserError(f"{pair.where}: {e}") from None
        except Exception as e:  # noqa: BLE001 - the template's own errors
            raise UserError(f"{pair.where}: the renderer cannot render the judge prompt: {e}") from None
        if len(prefix) + 1 > max_length:
            raise UserError(f"{pair.where}: the judge prompt is {len(prefix) + 1} tokens, over algo.max_length = "
                            f"{max_length}; raise max_length")
        label, other = (tok_a, tok_b) if preferred == 0 else (tok_b, tok_a)
        out.append(Judged(prefix, label, other))
    return out


def to_datum(j: Judged) -> Datum:
    """prefix + [label] as a (N, 2) cross_entropy datum: column 0 the sequence's own next tokens, column 1 the same
    except the other label at the last position; weight 1 on the preferred label only."""
    seq = [*j.prefix, j.label]
    n = len(seq) - 1
    targets = np.repeat(np.asarray(seq[1:], np.int64)[:, None], 2, axis=1)
    targets[-1, 1] = j.other
    w = np.zeros((n, 2), np.float32)
    w[-1, 0] = 1.0
    return Datum(model_input=seq[:-1], target_tokens=targets, weights=w)


def judge_stats(label_lps: np.ndarray, other_lps: np.ndarray) -> dict[str, float]:
    """nll and accuracy of interleaved (order 1, order 2) label logprobs, per comparison."""
    p = np.array([p_first(a, b) for a, b in zip(label_lps, other_lps, strict=True)])  # P(preferred label)
    # A comparison judged 0.5 up to rounding (both orders cancel: a judge that only ever says "A") is a tie, 1/2.
    return {"nll": float(-np.mean(label_lps)),
            "accuracy": tie_accuracy((p[0::2] + p[1::2]) / 2, np.full(len(p) // 2, 0.5), np.ones(len(p) // 2))}


def label_columns(logprobs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The (preferred, other) label logprobs at the last position of each (N, 2) datum's output."""
    last = np.array([np.asarray(lp).reshape(-1, 2)[-1] for lp in logprobs], np.float64)
    return last[:, 0], last[:, 1]


@dataclass
class Submitted:
    data: list[Datum]
    fwd_bwd: Future[ForwardBackwardOutput]
    optim: Future[OptimStepOutput]
    eval: Future[ForwardBackwardOutput] | None


class RewardModelAlgo(AlgorithmBase):
    """The reward model behind the loop's Algorithm interface (runner/engine/loop.py)."""

    def __init__(self, cfg: RewardModel, pairs: Pairs, s: Settings):
        self.cfg, self.tokenizer, self.data = cfg, s.tokenizer, pairs
        self.renderer = s.renderer
        self.batches = Batches(pairs.pairs, test_size=cfg.test_size, batch_size=cfg.batch_size, epochs=cfg.epochs,
                               seed=s.seed, max_steps=s.max_steps, what="comparisons")
        self.total_steps = self.batches.total_steps
        self.next_step = 0
        self._test: list[Judged] | None = None

    def judged(self, pairs: list[Pair]) -> list[Judged]:
        return [j for p in pairs for j in orders(self.renderer, p, self.cfg.max_length)]

    def test_judged(self) -> list[Judged]:
        if self._test is None:
            self._test = self.judged(self.batches.test)
        return self._test

    def state(self) -> Json:
        return self.batches.state(self.next_step)

    def load_state(self, state: Json, next_step: int) -> None:
        self.batches.check_state(state)
        self.next_step = next_step

    # --- one step

    async def prepare(self, step: int, ctx: Context) -> AsyncIterator[list[Datum]]:
        self.next_step = step + 1
        yield [to_datum(j) for j in self.judged([self.batches.train[i] for i in self.batches.indices(step)])]

    def submit(self, tc: TrainingClient, step: int, batch: list[Datum], adam: AdamParams,
               evaluate: bool) -> Submitted:
        ev = None
        if evaluate and self.batches.test:
            ev = tc.forward([to_datum(j) for j in self.test_judged()], "cross_entropy")
        return Submitted(batch, tc.forward_backward(batch, "cross_entropy"), tc.optim_step(adam), ev)

    async def finish(self, step: int, subs: list[Submitted]) -> dict[str, float]:
        (sub,) = subs
        fb = await sub.fwd_bwd
        opt = await sub.optim
        stats = judge_stats(*label_columns(fb.logprobs))
        metrics: dict[str, float] = {
            "epoch": self.batches.position(step)[0],
            "train_mean_nll": stats["nll"],
            "accuracy": stats["accuracy"],
            "num_sequences": len(sub.data),
            "num_tokens": sum(d.length for d in sub.data),
        }
        if step == 0:
            metrics["data/ties_dropped"] = self.data.ties
        if "grad_norm:mean" in opt.metrics:
            metrics["optim/grad_norm"] = opt.metrics["grad_norm:mean"]
        if sub.eval is not None:
            ev = await sub.eval
            metrics.update({f"test/{k}": v for k, v in judge_stats(*label_columns(ev.logprobs)).items()})
        return metrics

    # --- after the last step: the held-out comparisons on the final weights


    def final_plan(self, evaluate: bool) -> str | None:
        if not evaluate or not self.batches.test:
            return None
        return f"final eval (the held-out comparisons on the final weights), logged at step {self.total_steps}"

    async def final(self, ctx: FinalContext, evaluate: bool) -> dict[str, float]:
        client = await ctx.backend.create_sampling_client(model_path=ctx.sampler_path)
        lps = await asyncio.gather(*(label_logprobs(client, j.prefix, j.label, j.other) for j in self.test_judged()))
        return {f"test/{k}": v for k, v in judge_stats(np.array([a for a, _ in lps]), np.array([b for _, b in lps])).items()}

    # --- dry run

    def describe(self) -> list[str]:
        cfg, b = self.cfg, self.batches
        steps = min(self.total_steps, PLAN_STEPS)
        tokens = [sum(len(j.prefix) for j in self.judged([b.train[i] for i in b.indices(s)])) for s in range(steps)]
        b._order = None
        n = 2 * cfg.batch_size
        lines = [
            (f"data: {len(b.train) + len(b.test)} comparisons from {self.data.source} ({self.data.ties} ties dropped), "
             f"{len(b.test)} held out; {b.per_epoch} batches of {cfg.batch_size} per epoch x {cfg.epochs} epochs"),
            (f"per step (first {steps} steps): {n} datums (each comparison in both orders), tokens mean "
             f"{np.mean(tokens):.0f} max {max(tokens)}, 1 trained token each (the label)"),
            f"calls per step: forward_backward(cross_entropy, {n} datums) + optim_step",
        ]
        if b.test:
            lines.append(f"eval steps add: forward(cross_entropy, {2 * len(b.test)} held-out datums) first")
        else:
            lines.append("no held-out comparisons (algo.test_size = 0): eval steps evaluate nothing")
        return lines


# ---------------------------------------------------------------- the registry entry (runner/engine/spec.py)

def build(cfg: RewardModel, args: BuildArgs) -> Callable[[Tokenizer], RewardModelAlgo]:
    pairs = load_pairs(cfg.data)
    return lambda tokenizer: RewardModelAlgo(cfg, pairs, Settings.of(args, tokenizer))


def show(cfg: RewardModel, recipe: Recipe, renderer: Renderer, n: int) -> Iterator[Json]:
    """`runner render`: each order of the judge prompt of the first `n` comparisons; the label is trained."""
    for pair in load_pairs(cfg.data).pairs[:n]:
        for side, judged in zip(("chosen first", "rejected first"), orders(renderer, pair, cfg.max_length),
                                strict=True):
            tokens = [*judged.prefix, judged.label]
            yield {"where": pair.where, "side": side, "tokens": tokens, "weights": [0.0] * len(judged.prefix) + [1.0]}


SPEC = AlgoSpec(build=build, show=show,
                headline=[("train_mean_nll", "nll"), ("accuracy", "acc"), ("test/accuracy", "test/acc")],
                compare=["test/accuracy", "accuracy"])
