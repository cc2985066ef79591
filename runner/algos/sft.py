"""Supervised fine-tuning on conversations: cross-entropy on the chosen messages' tokens.

Per step: a batch of `batch_size` conversations from a seeded per-epoch shuffle (the last partial
batch of an epoch is dropped), each rendered with the recipe's renderer (runner/renderers/: the
cookbook's renderer of that name, or the tokenizer's chat template for "hf"), truncated to max_length, and cut into a Tinker-aligned datum (input = seq[:-1], targets = seq[1:], weights[1:]).
One forward_backward(cross_entropy) and one optim_step; every eval_every steps a forward on the
held-out rows first. As the cookbook (supervised/train.py), except:
1. Besides the cookbook's renderers, renderer = "hf" (what "auto" gives a model the cookbook does not
   know, when its tokenizer has a chat template) finds trained spans by rendering message prefixes with
   the HF chat template, so any model's template works.
2. The data position is stored as the *next* step, so a resume replays nothing (cookbook §8.1).
3. num_loss_tokens counts tokens with weight > 0 (the cookbook sums the weights, which under
   reduction "mean" counts sequences).
Unlike the cookbook's supervised loop (no eval after the last step), the final weights are evaluated once more
(test/nll, and test/agreement when asked for) in a row at step = total steps, as RL does; `runner eval` runs the same
at any checkpoint. No final row when eval_every = 0 (and agreement is off) or there is no held-out set.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from backends.base import Future, TrainingClient
from backends.errors import UserError
from backends.tokenizer import Tokenizer
from backends.types import AdamParams, Datum, ForwardBackwardOutput, Json, OptimStepOutput
from runner.algos.sft_config import SFT
from runner.data.conversations import Conversation, load_conversations
from runner.data.position import check_resume
from runner.engine.context import AlgorithmBase, Context, FinalContext
from runner.engine.spec import AlgoSpec, BuildArgs, Settings
from runner.recipe.schema import Recipe
from runner.renderers import Renderer, render_row, text_of

# How many steps the dry-run plan renders to report datums and tokens per step.
PLAN_STEPS = 20


def to_datum(tokens: list[int], weights: list[float], max_length: int | None, reduction: str) -> Datum | None:
    """Truncate from the right, shift to Tinker's alignment, apply the reduction. None if under 2 tokens."""
    if max_length is not None:
        tokens, weights = tokens[:max_length], weights[:max_length]
    if len(tokens) < 2:
        return None
    w = np.asarray(weights[1:], dtype=np.float32)
    if reduction == "mean" and w.sum() > 0:
        w = w / w.sum()  # each conversation weighs 1, whatever its length (cookbook default)
    return Datum(model_input=tokens[:-1], target_tokens=np.asarray(tokens[1:], dtype=np.int64), weights=w)


def weights(d: Datum) -> np.ndarray:
    """An SFT datum's weights (datum() always sets them)."""
    assert d.weights is not None
    return d.weights


def mean_nll(data: list[Datum], logprobs: list[np.ndarray]) -> float:
    """-sum(logprob * weight) / sum(weight) over the batch (the cookbook's train_mean_nll)."""
    num = sum(float(np.dot(lp.reshape(-1), weights(d).reshape(-1))) for d, lp in zip(data, logprobs, strict=True))
    den = sum(float(weights(d).sum()) for d in data)
    return -num / den if den > 0 else float("nan")


# ---------------------------------------------------------------- the algorithm

@dataclass
class Submitted:
    data: list[Datum]
    fwd_bwd: Future[ForwardBackwardOutput]
    optim: Future[OptimStepOutput]
    eval: Future[ForwardBackwardOutput] | None


class SFTAlgo(AlgorithmBase):
    """SFT behind the loop's Algorithm interface (runner/engine/loop.py)."""

    def __init__(self, cfg: SFT, convs: list[Conversation], where: list[str], s: Settings):
        self.cfg, self.tokenizer, self.seed = cfg, s.tokenizer, s.seed
        self.renderer: Renderer = s.renderer
        seed, max_steps = s.seed, s.max_steps
        if cfg.test_size >= len(convs):
            raise UserError(f"algo.test_size = {cfg.test_size} leaves no training rows (the data has {len(convs)})")
        order = np.random.default_rng(seed).permutation(len(convs))  # one seeded shuffle, then split
        self.test_rows = [(convs[i], where[i]) for i in order[: cfg.test_size]]
        self.train_rows = [(convs[i], where[i]) for i in order[cfg.test_size:]]
        self.batches_per_epoch = len(self.train_rows) // cfg.batch_size
        if self.batches_per_epoch == 0:
            raise UserError(
                f"algo.batch_size = {cfg.batch_size} is larger than the {len(self.train_rows)} training rows"
            )
        full = self.batches_per_epoch * cfg.epochs
        self.total_steps = min(full, max_steps) if max_steps else full
        self.next_step = 0
        self._test_data: list[Datum] | None = None
        self._order: tuple[int, np.ndarray] | None = None

    # --- data position

    def position(self, step: int) -> tuple[int, int]:
        return divmod(step, self.batches_per_epoch)

    def rows_for(self, step: int) -> list[tuple[Conversation, str]]:
        epoch, batch = self.position(step)
        if self._order is None or self._order[0] != epoch:
            # Reshuffled every epoch with (seed, epoch), so epoch 0 is shuffled too, as the cookbook.
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.train_rows)))
        idx = self._order[1][batch * self.cfg.batch_size : (batch + 1) * self.cfg.batch_size]
        return [self.train_rows[i] for i in idx]

    def datums(self, rows: list[tuple[Conversation, str]]) -> list[Datum]:
        out = []
        for messages, where in rows:
            tokens, weights = render_row(self.renderer, messages, self.cfg.train_on_what, where)
            if not any(weights):
                raise UserError(f"{where}: no message to train on (train_on_what = {self.cfg.train_on_what!r})")
            datum = to_datum(tokens, weights, self.cfg.max_length, self.cfg.reduction)
            if datum is None:
                raise UserError(f"{where}: renders to fewer than 2 tokens")
            out.append(datum)
        return out

    def state(self) -> Json:
        epoch, batch = self.position(self.next_step)
        return {"epoch": epoch, "batch": batch, "train_rows": len(self.train_rows)}

    def load_state(self, state: Json, next_step: int) -> None:
        check_resume(state, "train_rows", len(self.train_rows), "the training data", " rows")
        self.next_step = next_step

    # --- one step

    async def prepare(self, step: int, ctx: Context) -> AsyncIterator[list[Datum]]:
        self.next_step = step + 1
        yield self.datums(self.rows_for(step))

    def submit(self, tc: TrainingClient, step: int, batch: list[Datum], adam: AdamParams,
               evaluate: bool) -> Submitted:
        ev = None
        if evaluate and self.test_rows:
            if self._test_data is None:
                self._test_data = self.datums(self.test_rows)
            ev = tc.forward(self._test_data, "cross_entropy")  # sees the weights after step - 1
        fb = tc.forward_backward(batch, "cross_entropy")
        return Submitted(batch, fb, tc.optim_step(adam), ev)

    async def finish(self, step: int, subs: list[Submitted]) -> dict[str, float]:
        (sub,) = subs  # one part per step
        fb = await sub.fwd_bwd
        opt = await sub.optim
        metrics = {
            "epoch": self.position(step)[0],
            "train_mean_nll": mean_nll(sub.data, fb.logprobs),
            "num_sequences": len(sub.data),
            "num_tokens": sum(d.length for d in sub.data),
            "num_loss_tokens": int(sum((weights(d) > 0).sum() for d in sub.data)),
        }
        if "grad_norm:mean" in opt.metrics:
            metrics["optim/grad_norm"] = opt.metrics["grad_norm:mean"]
        if sub.eval is not None:
            ev = await sub.eval
            metrics["test/nll"] = mean_nll(self._test_data or [], ev.logprobs)
        return metrics

    # --- after the last step, and `runner eval` at any checkpoint: the held-out NLL (the cookbook's SL has no final
    # eval, so its last test/nll is from before the last eval_every steps), plus the agreement eval when asked for

    def final_plan(self, evaluate: bool) -> str | None:
        if not self.test_rows or not (evaluate or self.cfg.agreement):
            return None
        parts = [f"test/nll of the {len(self.test_rows)} held-out rows"] if evaluate else []
        if self.cfg.agreement:
            parts.append("test/agreement (greedy answers to the held-out prompts equal to the data's)")
        return f"on the final weights: {' and '.join(parts)}, logged at step {self.total_steps}"

    async def final(self, ctx: FinalContext, evaluate: bool) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if evaluate and self.test_rows:
            metrics.update(await self.test_nll(ctx))
        if self.cfg.agreement and self.test_rows:
            metrics.update(await self.agreement(ctx))
        return metrics


    async def test_nll(self, ctx: FinalContext) -> dict[str, float]:
        """test/nll of the held-out rows on ctx's sampler weights (weights as the training loss has them)."""
        from runner.rl.kl import reference_logprobs

        data = self.datums(self.test_rows)
        client = await ctx.backend.create_sampling_client(model_path=ctx.sampler_path)
        lps = await reference_logprobs(client, data)
        return {"test/nll": mean_nll(data, [np.asarray(lp) for lp in lps])}

    async def agreement(self, ctx: FinalContext) -> dict[str, float]:
        """test/agreement: greedy answers to each held-out conversation's last user turn vs the data's answer."""
        import asyncio

        from backends.types import SamplingParams
        from runner.renderers.chat import ChatRenderer

        renderer = ChatRenderer(self.renderer)
        client = await ctx.backend.create_sampling_client(model_path=ctx.sampler_path)
        cases = []
        for messages, _ in self.test_rows:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            expected = text_of(messages[last]).strip()
            budget = len(self.tokenizer.encode(expected, add_special_tokens=False)) + 8
            cases.append((renderer.build_prompt(messages[:last]), expected, budget))
        outs = await asyncio.gather(*(client.sample(prompt, 1, SamplingParams(
            max_tokens=budget, temperature=0.0, stop=renderer.stop, seed=0))
            for prompt, _, budget in cases))
        same = [renderer.parse(out.sequences[0].tokens).text.strip() == expected
                for out, (_, expected, _) in zip(outs, cases, strict=True)]
        return {"test/agreement": sum(same) / len(same)}

    # --- dry run

    def describe(self) -> list[str]:
        cfg = self.cfg
        steps = min(self.total_steps, PLAN_STEPS)
        per_step = [self.datums(self.rows_for(s)) for s in range(steps)]
        self._order = None
        tokens = [sum(d.length for d in b) for b in per_step]
        loss_tokens = [int(sum((weights(d) > 0).sum() for d in b)) for b in per_step]
        lines = [
            (f"data: {len(self.train_rows)} train rows, {len(self.test_rows)} held out; "
             f"{self.batches_per_epoch} batches of {cfg.batch_size} per epoch x {cfg.epochs} epochs"),
            (f"per step (first {steps} steps): {cfg.batch_size} datums, tokens mean {np.mean(tokens):.0f} "
             f"max {max(tokens)}, trained tokens mean {np.mean(loss_tokens):.0f}"),
            f"calls per step: forward_backward(cross_entropy, {cfg.batch_size} datums) + optim_step",
            f"renderer: {self.renderer.name}, train_on_what = {cfg.train_on_what} (`runner render` shows the tokens)",
        ]
        if self.test_rows:
            lines.append(f"eval steps add: forward(cross_entropy, {len(self.test_rows)} held-out datums) first")
        else:
            lines.append("no held-out rows (algo.test_size = 0): eval steps evaluate nothing")
        return lines


# ---------------------------------------------------------------- the registry entry (runner/engine/spec.py)

def build(cfg: SFT, args: BuildArgs) -> Callable[[Tokenizer], SFTAlgo]:
    convs, where = load_conversations(cfg.data)
    return lambda tokenizer: SFTAlgo(cfg, convs, where, Settings.of(args, tokenizer))


def show(cfg: SFT, recipe: Recipe, renderer: Renderer, n: int) -> Iterator[Json]:
    """`runner render`: the first `n` conversations, tokens and weights as a step trains them."""
    convs, where = load_conversations(cfg.data)
    for conv, w in list(zip(convs, where, strict=True))[:n]:
        tokens, ws = render_row(renderer, conv, cfg.train_on_what, w)
        yield {"where": w, "tokens": tokens[: cfg.max_length], "weights": ws[: cfg.max_length]}


SPEC = AlgoSpec(build=build, headline=[("train_mean_nll", "nll"), ("test/nll", "test/nll")],
                compare=["test/nll", "train_mean_nll"], show=show)
