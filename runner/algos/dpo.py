"""DPO (Rafailov et al. 2023) behind the loop's Algorithm interface, as the cookbook's preference/train_dpo.py.

Per pair (prompt, chosen c, rejected r), with sequence logprobs summed over the completion's tokens (weight 1 on
the completion, 0 on the prompt) under the policy π and the reference:
    Δc = π(c) − ref(c),  Δr = π(r) − ref(r),  loss = mean over pairs of −log σ(β·(Δc − Δr)).
Metrics (the cookbook's names): dpo_loss, accuracy = mean[Δc > Δr] with a tie counted 1/2 (`tie_accuracy`: at
step 0 the policy is the reference, Δc and Δr are float noise, and the accuracy reads 0.5), margin = mean β(Δc − Δr),
chosen_reward = mean βΔc, rejected_reward = mean βΔr; test/... the same on the held-out pairs.

Per step k (the loop calls prepare, submit, finish):
  prepare(k)  renders batch k (chosen and rejected datums side by side) and awaits the reference's logprobs of
              it (compute_logprobs per datum). With depth >= 1 the loop runs prepare(k) while step k-1 trains, so
              the reference calls overlap training;
  submit(k)   [forward on the held-out pairs, on eval steps] + forward_backward_custom(the DPO loss) +
              optim_step. The custom loss is one autograd pass on the local backend and the SDK's two passes on
              Tinker (docs/losses.md: forward_backward_custom), with the same gradient;
  finish(k)   the metrics, from the logprobs forward_backward_custom saw (before the update).
After the last step, as RL, one more eval on the final weights (the final checkpoint's sampler weights, through
compute_logprobs), logged at step = total steps.

Departures from the cookbook:
1. The reference is the run's initial weights, whatever happens: the base model (or `reference_path`, the sampler
   weights a chained recipe starts from), never a snapshot of the training client, so after a resume it is still
   the initial weights (the cookbook snapshots the resumed weights: §8.2).
2. "Tie" rows are dropped and counted (the cookbook makes B the winner: §8.3).
3. The reference runs ahead, pipelined with training, and its sequence logprobs are cached per pair (the reference
   never changes), so later epochs make no reference calls.
4. The data position stored with a checkpoint is the next step's, so a resume replays nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from backends.base import Backend, CustomLossFn, Future, SamplingClient, TrainingClient
from backends.errors import UserError
from backends.losses import Tensor
from backends.tokenizer import Tokenizer
from backends.types import AdamParams, Datum, ForwardBackwardOutput, Json, OptimStepOutput
from runner.algos.dpo_config import DPO
from runner.algos.sft import PLAN_STEPS, to_datum, weights
from runner.data.comparisons import Batches, Pair, Pairs, load_pairs, render_completion
from runner.engine.context import AlgorithmBase, Context, FinalContext
from runner.engine.spec import AlgoSpec, BuildArgs, Settings
from runner.recipe.schema import Recipe
from runner.renderers import Renderer
from runner.rl.kl import reference_logprobs

# ---------------------------------------------------------------- the math


def sequence_logprobs(data: list[Datum], logprobs: list[np.ndarray]) -> np.ndarray:
    """Σ_t w_t·lp_t per datum (float64)."""
    return np.array([float(np.dot(np.asarray(lp, np.float64).reshape(-1), weights(d).astype(np.float64).reshape(-1)))
                     for d, lp in zip(data, logprobs, strict=True)])


# Relative size of a difference of summed float32 logprobs that is rounding, not preference: the trainer's and the
# sampler's sums of the same weights differ by up to ~4e-7 of the sequences' |logprob| (dpo_basic's 116 pairs at
# step 0); 25x that is a tie.
TIE_RTOL = 1e-5


def tie_accuracy(better: np.ndarray, worse: np.ndarray, scale: np.ndarray) -> float:
    """mean[better > worse], a tie (|better − worse| <= TIE_RTOL·scale) counted 1/2: where the two are equal up to
    rounding (a policy that is still its reference) the accuracy is 0.5, not whichever way the noise fell."""
    diff = np.asarray(better, np.float64) - np.asarray(worse, np.float64)
    tie = np.abs(diff) <= TIE_RTOL * np.asarray(scale, np.float64)
    return float(np.mean(np.where(tie, 0.5, diff > 0)))


def dpo_stats(policy: np.ndarray, reference: np.ndarray, beta: float) -> dict[str, float]:
    """The DPO loss and metrics of interleaved (chosen, rejected) sequence logprobs."""
    policy, reference = np.asarray(policy, np.float64), np.asarray(reference, np.float64)
    delta = policy - reference
    dc, dr = delta[0::2], delta[1::2]
    z = beta * (dc - dr)
    scale = np.abs(policy[0::2]) + np.abs(policy[1::2]) + np.abs(reference[0::2]) + np.abs(reference[1::2])
    return {
        "dpo_loss": float(np.mean(np.logaddexp(0.0, -z))),  # −log σ(z), stable for large |z|
        "accuracy": tie_accuracy(dc, dr, scale),
        "margin": float(np.mean(z)),
        "chosen_reward": float(np.mean(beta * dc)),
        "rejected_reward": float(np.mean(beta * dr)),
    }


def dpo_loss_fn(reference: np.ndarray, beta: float) -> CustomLossFn:
    """The loss for forward_backward_custom on interleaved (chosen, rejected) datums; `reference`: the reference
    sequence logprob of each datum."""

    def loss_fn(data: list[Datum], logprobs: list[Tensor]) -> tuple[Tensor, dict[str, float]]:
        import torch
        import torch.nn.functional as F

        seq = torch.stack([(lp.double().reshape(-1) * torch.as_tensor(weights(d), dtype=torch.float64).reshape(-1)).sum()
                           for d, lp in zip(data, logprobs, strict=True)])
        delta = seq - torch.as_tensor(reference, dtype=torch.float64)
        loss = -F.logsigmoid(beta * (delta[0::2] - delta[1::2])).mean()
        return loss, dpo_stats(seq.detach().numpy(), reference, beta)

    return loss_fn


# ---------------------------------------------------------------- the algorithm


@dataclass
class Batch:
    """A step's datums (chosen, rejected, chosen, ...) and the reference's sequence logprob of each."""

    data: list[Datum]
    reference: np.ndarray
    reference_s: float


@dataclass
class Submitted:
    batch: Batch
    fwd_bwd: Future[ForwardBackwardOutput]
    optim: Future[OptimStepOutput]
    eval: Future[ForwardBackwardOutput] | None


class DPOAlgo(AlgorithmBase):
    """DPO behind the loop's Algorithm interface (runner/engine/loop.py)."""

    def __init__(self, cfg: DPO, pairs: Pairs, s: Settings):
        self.cfg, self.tokenizer, self.data = cfg, s.tokenizer, pairs
        self.renderer = s.renderer
        self.base_model, self.reference_path = s.model, s.reference_path
        self.batches = Batches(pairs.pairs, test_size=cfg.test_size, batch_size=cfg.batch_size, epochs=cfg.epochs,
                               seed=s.seed, max_steps=s.max_steps, what="pairs")
        self.total_steps = self.batches.total_steps
        self.next_step = 0
        self._reference: asyncio.Task[SamplingClient] | None = None
        self._backend: Backend | None = None  # the session's backend (set by prepare), for the held-out reference logprobs
        # The reference's sequence logprobs of (chosen, rejected) per training pair index: it never changes.
        self._train_ref: dict[int, tuple[float, float]] = {}
        self._test_data: list[Datum] | None = None
        self._test_ref: asyncio.Task[np.ndarray] | None = None

    # --- data

    def datums(self, pair: Pair) -> list[Datum]:
        """[chosen, rejected] of one pair."""
        out = []
        for side, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            try:
                tokens, w = render_completion(self.renderer, pair.prompt, completion)
            except UserError as e:
                raise UserError(f"{pair.where}: the {side} side: {e}") from None
            except Exception as e:  # noqa: BLE001 - the template's own errors, e.g. roles that must alternate
                raise UserError(f"{pair.where}: renderer {self.renderer.name!r} cannot render the {side} side: {e}"
                                ) from None
            datum = to_datum(tokens, w, self.cfg.max_length, "none")
            if datum is None or not weights(datum).any():
                raise UserError(f"{pair.where}: the prompt fills algo.max_length = {self.cfg.max_length} tokens, so the "
                                f"{side} completion has no tokens left; raise max_length")
            out.append(datum)
        return out

    def test_data(self) -> list[Datum]:
        if self._test_data is None:
            self._test_data = [d for p in self.batches.test for d in self.datums(p)]
        return self._test_data

    def state(self) -> Json:
        return self.batches.state(self.next_step)

    def load_state(self, state: Json, next_step: int) -> None:
        self.batches.check_state(state)
        self.next_step = next_step

    # --- the reference: the initial weights, never the training client's

    def reference(self, backend: Backend) -> asyncio.Task[SamplingClient]:
        if self._reference is None:
            path = self.reference_path

            async def create() -> SamplingClient:
                return await backend.create_sampling_client(model_path=path, base_model=None if path else self.base_model)

            self._reference = asyncio.ensure_future(create())
        return self._reference

    async def reference_sums(self, backend: Backend, data: list[Datum]) -> np.ndarray:
        client = await self.reference(backend)
        return sequence_logprobs(data, await reference_logprobs(client, data))

    # --- one step

    async def prepare(self, step: int, ctx: Context) -> AsyncIterator[Batch]:
        self.next_step = step + 1
        self._backend = ctx.backend
        idx = self.batches.indices(step)
        data = [d for i in idx for d in self.datums(self.batches.train[i])]
        t = time.monotonic()
        todo = [j for j, i in enumerate(idx) if i not in self._train_ref]
        if todo:
            sums = await self.reference_sums(ctx.backend, [data[k] for j in todo for k in (2 * j, 2 * j + 1)])
            for n, j in enumerate(todo):
                self._train_ref[idx[j]] = (float(sums[2 * n]), float(sums[2 * n + 1]))
        reference = np.array([x for i in idx for x in self._train_ref[i]])
        yield Batch(data, reference, time.monotonic() - t)

    def submit(self, tc: TrainingClient, step: int, batch: Batch, adam: AdamParams, evaluate: bool) -> Submitted:
        ev = None
        if evaluate and self.batches.test:
            ev = tc.forward(self.test_data(), "cross_entropy")  # the weights after step - 1; nothing accumulates
            if self._test_ref is None:  # once: the reference never changes
                assert self._backend is not None, "submit before prepare set the backend"
                self._test_ref = asyncio.ensure_future(self.reference_sums(self._backend, self.test_data()))
        fb = tc.forward_backward_custom(batch.data, dpo_loss_fn(batch.reference, self.cfg.beta))
        return Submitted(batch, fb, tc.optim_step(adam), ev)

    async def finish(self, step: int, subs: list[Submitted]) -> dict[str, float]:
        (sub,) = subs  # one part per step
        fb = await sub.fwd_bwd
        opt = await sub.optim
        data = sub.batch.data
        metrics: dict[str, float] = {
            "epoch": self.batches.position(step)[0],
            **dpo_stats(sequence_logprobs(data, fb.logprobs), sub.batch.reference, self.cfg.beta),
            "num_pairs": len(data) // 2,
            "num_tokens": sum(d.length for d in data),
            "time/reference": sub.batch.reference_s,
        }
        if step == 0:
            metrics["data/ties_dropped"] = self.data.ties
        if "grad_norm:mean" in opt.metrics:
            metrics["optim/grad_norm"] = opt.metrics["grad_norm:mean"]
        if sub.eval is not None:
            assert self._test_ref is not None
            ev = await sub.eval
            metrics.update(self.test_metrics(sequence_logprobs(self.test_data(), ev.logprobs), await self._test_ref))
        return metrics

    def test_metrics(self, policy: np.ndarray, reference: np.ndarray) -> dict[str, float]:
        return {f"test/{k}": v for k, v in dpo_stats(policy, reference, self.cfg.beta).items()}

    # --- after the last step: the held-out pairs on the final weights


    def final_plan(self, evaluate: bool) -> str | None:
        if not evaluate or not self.batches.test:
            return None
        return f"final eval (the held-out pairs on the final weights), logged at step {self.total_steps}"

    async def final(self, ctx: FinalContext, evaluate: bool) -> dict[str, float]:
        """test/... on the final checkpoint's sampler weights (ctx: runner.engine.loop.FinalContext)."""
        data = self.test_data()
        policy = await ctx.backend.create_sampling_client(model_path=ctx.sampler_path)
        pol, ref = await asyncio.gather(reference_logprobs(policy, data), self.reference_sums(ctx.backend, data))
        return self.test_metrics(sequence_logprobs(data, pol), ref)

    # --- dry run

    def describe(self) -> list[str]:
        cfg, b = self.cfg, self.batches
        steps = min(self.total_steps, PLAN_STEPS)
        per_step = [[d for i in b.indices(s) for d in self.datums(b.train[i])] for s in range(steps)]
        b._order = None
        tokens = [sum(d.length for d in data) for data in per_step]
        completion = [int(sum((weights(d) > 0).sum() for d in data)) for data in per_step]
        reference = (f"sampler weights {self.reference_path}" if self.reference_path
                     else "the upstream run's final sampler weights" if self.reference_path is not None
                     else f"the base model {self.base_model!r}")
        n = 2 * cfg.batch_size
        lines = [
            (f"data: {len(b.train) + len(b.test)} pairs from {self.data.source} ({self.data.ties} ties dropped), "
             f"{len(b.test)} held out; {b.per_epoch} batches of {cfg.batch_size} pairs per epoch x {cfg.epochs} "
             "epochs"),
            (f"per step (first {steps} steps): {n} datums (chosen + rejected), tokens mean {np.mean(tokens):.0f} "
             f"max {max(tokens)}, completion tokens mean {np.mean(completion):.0f}; beta {cfg.beta:g}"),
            (f"calls per step: {n} x compute_logprobs on the reference (first epoch only; in prepare, while the "
             f"previous step trains) + forward_backward_custom(dpo, {n} datums; two passes on Tinker) + optim_step"),
            f"reference: the initial weights, {reference} (also after a resume)",
        ]
        if b.test:
            lines.append(f"eval steps add: forward({2 * len(b.test)} held-out datums) first, and the reference's "
                         "logprobs of them once")
        else:
            lines.append("no held-out pairs (algo.test_size = 0): eval steps evaluate nothing")
        return lines


# ---------------------------------------------------------------- the registry entry (runner/engine/spec.py)

def build(cfg: DPO, args: BuildArgs) -> Callable[[Tokenizer], DPOAlgo]:
    pairs = load_pairs(cfg.data)
    return lambda tokenizer: DPOAlgo(cfg, pairs, Settings.of(args, tokenizer))


def show(cfg: DPO, recipe: Recipe, renderer: Renderer, n: int) -> Iterator[Json]:
    """`runner render`: each side of the first `n` comparisons, tokens and weights."""
    for pair in load_pairs(cfg.data).pairs[:n]:
        for side, completion in (("chosen", pair.chosen), ("rejected", pair.rejected)):
            tokens, ws = render_completion(renderer, pair.prompt, completion)
            yield {"where": pair.where, "side": side, "tokens": tokens[: cfg.max_length],
                   "weights": ws[: cfg.max_length]}


SPEC = AlgoSpec(build=build, show=show,
                headline=[("dpo_loss", "loss"), ("accuracy", "acc"), ("test/accuracy", "test/acc")],
                compare=["test/accuracy", "accuracy"])
