"""RL behind the loop's Algorithm interface (runner/engine/loop.py): group rollouts -> advantages -> datums -> a ratio loss.

Per step k (the loop calls prepare, submit, finish):
  prepare(k)  picks the sampling client (below), rolls out batch k % len(train) of group builders, then
              advantages (group-centred), datums, the optional KL penalty against the base model, metrics
              and, every transcript_every steps and at the last step, the step's transcript
              (iteration_NNNNNN/train.html + train_rollout_summaries.jsonl);
  submit(k)   queues forward_backward + optim_step per substep, then save_weights_and_get_sampling_client:
              the snapshot "after step k" sits in the FIFO right behind step k's last optim_step;
              on eval steps also starts the test-set rollouts on step k's sampler (a task, awaited in finish);
  finish(k)   awaits it all: optim/kl_sample_train_v1/v2, optim/entropy, numerics/* and the numerics gate
              (runner/rl/gate.py), loss, grad norm, test/..., and optionally optim/kl_pre_post_v1/v2 under
              the new weights.
After the last step (the loop calls final, when eval_every > 0 and there is a test set) one more eval, as the
cookbook's "after the loop": the test set on the final weights, loaded from the final checkpoint's sampler
weights (saved right behind the last optim_step), with the same test/... metrics and an
iteration_NNNNNN/test.html at NNNNNN = total steps; the loop logs it at step = total steps (end_batch). It never
repeats a periodic eval: the eval on step k samples the weights that sample step k (after k optimizer steps, or
fewer in async mode), so even an eval on the last step sees the weights before its update.

Which weights sample step k (the sampler "step" s = weights after s optimizer steps):
  sync    s = k: prepare(k) awaits the snapshot submit(k-1) queued, so every step is on-policy;
  stream  as sync, but each minibatch's forward_backward is submitted from prepare as soon as its groups
          finish (and each substep's optim_step after its last minibatch), so training overlaps sampling;
  async   the newest snapshot already made, at least k - max_staleness: with the loop's depth >= 1,
          prepare(k+1) runs while step k trains, on the weights after step k-1 (staleness 1);
          with fixed_staleness exactly k - max_staleness (the session's first snapshot until then), so
          runs repeat whatever the timing.
          Staleness is per group: async/staleness_{min,max,mean} = k - s.

Exact resume (sync, stream with one minibatch order aside): the data position is the step itself, every sample
has an explicit seed from (recipe seed, step, group, member, turn), and the first resumed step samples from a
snapshot of the restored weights, which are exactly those after the previous step.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from backends import losses
from backends.base import Backend, BackendError, Future, SamplingClient, TrainingClient
from backends.errors import UserError
from backends.tokenizer import Tokenizer
from backends.types import AdamParams, Datum, ForwardBackwardOutput, Json, LossFn, OptimStepOutput, SamplingParams
from runner.algos.rl_config import RL, Async, PythonLoss, ReferenceKL, Stream
from runner.data.position import check_resume
from runner.engine.context import AlgorithmBase, Context, FinalContext
from runner.engine.spec import AlgoSpec, BuildArgs, Settings
from runner.recipe.schema import Recipe
from runner.recipe.targets import import_object
from runner.renderers import Renderer
from runner.renderers.chat import ChatRenderer, context_window
from runner.rl import transcripts
from runner.rl.advantages import compute_advantages, remove_constant_reward_groups
from runner.rl.datums import assemble_datums
from runner.rl.envs import EnvContext, build_datasets, get_batch, headline_of
from runner.rl.envs.preference_config import ModelJudge, Preference
from runner.rl.gate import Gate, dlogprob_metrics, on_policy
from runner.rl.kl import apply_kl_penalty, kl_sample_train, reference_logprobs
from runner.rl.metrics import trajectory_metrics
from runner.rl.rollouts import RolloutBatch, collect, guarded_group_rollout, rollout_batch
from runner.rl.types import EnvGroupBuilder, RLDataset, TrajectoryGroup

# Evals sample with their own seeds: (step, group) coordinates repeat between the train and test splits.
EVAL_SEED_OFFSET = 1 << 40


def loss_of(cfg: RL) -> tuple[LossFn, dict[str, float] | None]:
    """The recipe's loss as a registered loss_fn name (backends/losses.py) and its loss_fn_config. A user's loss
    (`kind = "python"`) is registered here; UserError when its target is not a LossSpec or its args do not fit."""
    loss = cfg.loss
    if isinstance(loss, PythonLoss):
        where = f"algo.loss.target {loss.target!r}"
        spec = import_object(loss.target)
        if not isinstance(spec, losses.LossSpec):
            raise UserError(f"{where} is a {type(spec).__name__}, not a backends.losses.LossSpec")
        try:
            losses.register(spec)
            return spec.name, spec.resolve(loss.args) or None
        except ValueError as e:
            raise UserError(f"{where}: {e}") from None
    spec = losses.get(str(loss.__struct_config__.tag))
    return spec.name, {f.key: float(getattr(loss, f.recipe)) for f in spec.fields} or None


def chunks(data_D: list[Datum], n: int) -> list[list[Datum]]:
    """min(n, len) contiguous, nearly equal chunks (the cookbook's substeps)."""
    n = min(n, len(data_D))
    bounds = [int(x) for x in np.linspace(0, len(data_D), n + 1).round()] if n else []
    return [data_D[a:b] for a, b in itertools.pairwise(bounds)]


@dataclass
class Prepared:
    """A step's rollouts, made into datums."""

    step: int
    batch: RolloutBatch
    data_D: list[Datum]
    sampler: SamplingClient
    metrics: dict[str, float]
    sampler_step: int = -1  # the weights that sampled it (after that many optimizer steps)


@dataclass
class Part:
    """What prepare() yields: the whole batch (sync, async), or in stream mode one minibatch, submitted the moment
    its groups finish; `optim`: an optim_step follows it (the last minibatch of a substep); `last`: the step's
    last part, behind which the next sampler snapshot is queued."""

    prepared: Prepared
    data_D: list[Datum]
    streamed: bool = False
    optim: bool = True
    last: bool = True


@dataclass
class Submitted:
    prepared: Prepared
    fwd_bwd: list[tuple[list[Datum], Future[ForwardBackwardOutput]]]
    optims: list[Future[OptimStepOutput]]
    eval: asyncio.Task[dict[str, float]] | None
    # Clock: when the part was submitted, when its last call (optim_step) and the next snapshot completed.
    times: dict[str, float] = field(default_factory=dict)
    # How many of fwd_bwd were submitted before the first of optims (None: no optim_step; runner/rl/gate.py).
    before_optim: int | None = None


class RLAlgo(AlgorithmBase):
    """`cfg` is an RL table, or one with the same sampling/training fields (runner.algos.distill.DistillAlgo subclasses this
    with its own datasets and KL term)."""

    def __init__(self, cfg: Any, s: Settings):
        seed, max_steps = s.seed, s.max_steps
        self.cfg, self.seed, self.base_model = cfg, seed, s.model
        # A group's rollout time limit (RL's env_timeout_s; a table without the field, as distillation's: none).
        self.env_timeout_s: float | None = getattr(cfg, "env_timeout_s", None)
        # Final sampler weights of the runs the recipe names (a model judge), by reference; opened on demand.
        self.weights = dict(s.weights)
        self._opened: dict[str, SamplingClient] = {}
        self._backend: Backend | None = None
        # The KL penalty's reference: the initial weights (a chained recipe's upstream weights, else the base model).
        self.reference_path = s.reference_path
        self.renderer = ChatRenderer(s.renderer)
        env_ctx = EnvContext(self.renderer, cfg.group_size, cfg.eval.group_size, cfg.groups_per_batch, seed,
                             self.open_weights, self.open_model)
        self.train, self.test = self.build_datasets(env_ctx)
        full = len(self.train) * cfg.epochs
        self.total_steps = min(full, max_steps) if max_steps else full
        self.params = SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature)
        self.max_context = context_window(s.tokenizer, s.model)
        loss_fn, self.loss_config = loss_of(cfg)
        self.loss_fn: LossFn = loss_fn
        # Snapshots by sampler step (weights after that many optimizer steps), oldest first.
        self.samplers: dict[int, Future[SamplingClient]] = {}
        self.reference: SamplingClient | None = None
        self.next_step = 0
        self.gate = Gate(getattr(cfg, "numerics", None))  # the sampler-vs-trainer gate (runner/rl/gate.py)
        # The run dir, for transcripts (set by prepare from the loop's context; None in a dry run).
        self.log_dir: Path | None = None

    def build_datasets(self, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
        return build_datasets(self.cfg.env, ctx)

    async def open_weights(self, ref: str) -> SamplingClient:
        """A sampling client over the final weights of the run `ref` names (resolved by runner/engine/chain.py)."""
        if ref not in self._opened:
            if ref not in self.weights:
                raise UserError(f"{ref!r} was not resolved to weights: run the recipe with `runner run`, which runs it "
                                "first")
            assert self._backend is not None, "open_weights before prepare/final set the backend"
            self._opened[ref] = await self._backend.create_sampling_client(model_path=self.weights[ref])
        return self._opened[ref]

    async def open_model(self, model_path: str | None, base_model: str | None) -> SamplingClient:
        """A sampling client over a checkpoint path, else a base model (None: the recipe's own), opened once."""
        key = f"path:{model_path}" if model_path else f"base:{base_model or self.base_model}"
        if key not in self._opened:
            assert self._backend is not None, "open_model before prepare/final set the backend"
            self._opened[key] = await self._backend.create_sampling_client(
                model_path=model_path, base_model=None if model_path else (base_model or self.base_model))
        return self._opened[key]

    # ---------------------------------------------------------------- data position

    def builders(self, step: int) -> list[EnvGroupBuilder]:
        return get_batch(self.train, step % len(self.train), "train")  # epochs cycle through the same batches

    def state(self) -> Json:
        return {"rl_train_batches": len(self.train), "sampler_step": self.next_step}

    def load_state(self, state: Json, next_step: int) -> None:
        check_resume(state, "rl_train_batches", len(self.train), "the RL training set", " batches")
        self.next_step = next_step

    # ---------------------------------------------------------------- prepare: sample and build datums

    async def sampler_for(self, step: int, ctx: Context) -> tuple[int, SamplingClient]:
        if not self.samplers:  # first step of a session: the weights as they are now
            self.samplers[step] = ctx.snapshot()
        if isinstance(self.cfg.mode, Async):
            allowed = [s for s in self.samplers if s >= step - self.cfg.mode.max_staleness]
            ready = [s for s in allowed if self.samplers[s].done()]
            if self.cfg.mode.fixed_staleness or not ready:
                s = min(allowed)  # FIFO: the oldest allowed snapshot is ready first
            else:
                s = max(ready)
        else:
            s = step
        client = await self.samplers[s]
        for old in [k for k in self.samplers if k < s]:
            del self.samplers[old]  # each local snapshot holds a model copy
        return s, client

    async def prepare(self, step: int, ctx: Context) -> AsyncIterator[Part]:
        self._backend = ctx.backend
        self.next_step = step + 1
        self.log_dir = ctx.log_dir
        t0 = time.monotonic()
        sampler_step, sampler = await self.sampler_for(step, ctx)
        t1 = time.monotonic()
        builders = self.builders(step)
        prepared = Prepared(step, RolloutBatch([], []), [], sampler, {}, sampler_step)
        if isinstance(self.cfg.mode, Stream):
            async for part in self._stream(prepared, builders, ctx):
                yield part
        else:
            prepared.batch = await rollout_batch(builders, sampler, self.params, seed=self.seed, step=step,
                                                 max_context=self.max_context, timeout_s=self.env_timeout_s)
            prepared.data_D, prepared.metrics = await self._datums(prepared.batch.groups, ctx.backend)
        batch = prepared.batch
        m = prepared.metrics
        m.update(trajectory_metrics(batch.groups))
        m.update(batch.error_metrics())
        m["progress/batch"] = step
        m.update(_stats("sampling_client/step", [sampler_step] * len(batch.groups)))
        if isinstance(self.cfg.mode, Async):
            m.update(_stats("async/staleness", [step - sampler_step] * len(batch.groups)))
        m["time/sampler_wait"] = t1 - t0
        m["time/sampling"] = time.monotonic() - t1
        self._write_transcripts("train", step, batch, sampler_step)
        if not isinstance(self.cfg.mode, Stream):
            yield Part(prepared, prepared.data_D)

    async def _datums(self, groups: list[TrajectoryGroup], backend: Backend) -> tuple[list[Datum], dict[str, float]]:
        """Advantages, datums and the KL penalty for some groups of one step (a subclass adds its own terms)."""
        metrics: dict[str, float] = {}
        if self.cfg.remove_constant_reward_groups:
            kept = remove_constant_reward_groups(groups)
            metrics["env/all/groups_dropped_constant"] = float(len(groups) - len(kept))
            groups = kept
        data_D, _ = assemble_datums(groups, compute_advantages(groups, self.cfg.normalize_std))
        if isinstance(self.cfg.kl, ReferenceKL) and data_D:
            reference = self.reference
            if reference is None:
                reference = self.reference = await backend.create_sampling_client(
                    model_path=self.reference_path, base_model=None if self.reference_path else self.base_model)
            t = time.monotonic()
            ref_D = await reference_logprobs(reference, data_D)
            data_D, kl = apply_kl_penalty(data_D, ref_D, self.cfg.kl.coef)
            metrics.update(kl)
            metrics["time/kl_vs_base"] = time.monotonic() - t
        return data_D, metrics

    async def _stream(self, prepared: Prepared, builders: list[EnvGroupBuilder], ctx: Context) -> AsyncIterator[Part]:
        """Rollouts as tasks; every `per_minibatch` finished groups become a part (a forward_backward, submitted by
        the loop at once), and the last minibatch of each substep carries its optim_step."""
        assert isinstance(self.cfg.mode, Stream)
        per_substep = len(builders) // self.cfg.num_substeps
        per_minibatch = per_substep // self.cfg.mode.minibatches
        if per_minibatch == 0:  # a python env's dataset may make fewer groups per batch than groups_per_batch
            raise UserError(
                f"stream mode: batch {prepared.step % len(self.train)} of the train dataset has {len(builders)} groups, "
                f"fewer than num_substeps × minibatches = {self.cfg.num_substeps * self.cfg.mode.minibatches}"
            )
        done: asyncio.Queue[tuple[int, TrajectoryGroup | Exception]] = asyncio.Queue()

        async def rollout(i: int, builder: EnvGroupBuilder) -> None:
            try:
                outcome = await guarded_group_rollout(builder, prepared.sampler, self.params, seed=self.seed,
                                                      step=prepared.step, group_idx=i, max_context=self.max_context,
                                                      timeout_s=self.env_timeout_s)
            except (UserError, BackendError) as e:  # handed over, so the consumer raises it instead of waiting
                outcome = e
            done.put_nowait((i, outcome))

        tasks = [asyncio.ensure_future(rollout(i, b)) for i, b in enumerate(builders)]
        results: list[tuple[int, TrajectoryGroup | Exception]] = []
        pending: list[TrajectoryGroup] = []
        parts: list[dict[str, float]] = []
        try:
            while len(results) < len(tasks):
                i, outcome = await done.get()
                if isinstance(outcome, (UserError, BackendError)):
                    raise outcome
                results.append((i, outcome))
                if isinstance(outcome, TrajectoryGroup):
                    pending.append(outcome)
                # A failed group still counts towards its minibatch (which then comes out smaller).
                last = len(results) == len(tasks)
                if len(results) % per_minibatch and not last:
                    continue
                data_D: list[Datum] = []
                if pending:
                    data_D, metrics = await self._datums(pending, ctx.backend)
                    parts.append(metrics)
                    pending = []
                    prepared.data_D += data_D
                optim = len(results) % per_substep == 0 or last
                if data_D or optim or last:
                    yield Part(prepared, data_D, streamed=True, optim=optim, last=last)
        finally:
            for t in tasks:
                t.cancel()
        prepared.metrics = _merge(parts)
        prepared.batch = collect(sorted(results, key=lambda r: r[0]), f"step {prepared.step}")

    # ---------------------------------------------------------------- submit and finish

    def submit(self, tc: TrainingClient, step: int, part: Part, adam: AdamParams, evaluate: bool) -> Submitted:
        prepared = part.prepared
        ev = None
        if evaluate and self.test is not None:
            ev = asyncio.ensure_future(self._evaluate(step, prepared.sampler))
        fwd_bwd, optims = [], []
        if part.streamed:
            if part.data_D:
                fwd_bwd.append((part.data_D, tc.forward_backward(part.data_D, self.loss_fn, self.loss_config)))
            if part.optim:
                optims.append(tc.optim_step(adam))
        else:
            for chunk in chunks(part.data_D, self.cfg.num_substeps):
                fwd_bwd.append((chunk, tc.forward_backward(chunk, self.loss_fn, self.loss_config)))
                optims.append(tc.optim_step(adam))
        times = {"submitted": time.monotonic()}
        before_optim = (len(fwd_bwd) if part.streamed else 1) if optims else None
        if optims:
            _stamp(optims[-1], times, "trained")
        if part.last and (step + 1 < self.total_steps or self.cfg.compute_post_kl):
            self.samplers[step + 1] = tc.save_weights_and_get_sampling_client()
            _stamp(self.samplers[step + 1], times, "snapshot")
        return Submitted(prepared, fwd_bwd, optims, ev, times, before_optim)

    async def finish(self, step: int, subs: list[Submitted]) -> dict[str, float]:
        sub = Submitted(subs[0].prepared, [fb for s in subs for fb in s.fwd_bwd], [o for s in subs for o in s.optims],
                        next((s.eval for s in subs if s.eval is not None), None))
        metrics = dict(sub.prepared.metrics)
        outs = [await f for _, f in sub.fwd_bwd]
        opts = [await f for f in sub.optims]
        metrics.update(self._train_times(subs))
        data_D = [d for chunk, _ in sub.fwd_bwd for d in chunk]
        train_lps = [lp for out in outs for lp in out.logprobs]
        metrics.update(kl_sample_train(data_D, train_lps))
        if sub.prepared.sampler_step == step:  # sampled by the weights the step trains (not so in async mode)
            metrics.update(dlogprob_metrics(*on_policy(await self._parts(subs))))
        metrics.update(self.gate.check(step, metrics))  # "stop": raises before the row and checkpoint are written
        metrics["optim/loss:sum"] = float(sum(out.metrics.get("loss:sum", 0.0) for out in outs))
        norms = [o.metrics["grad_norm:mean"] for o in opts if "grad_norm:mean" in o.metrics]
        if norms:
            metrics["optim/grad_norm"] = float(np.mean(norms))
        metrics["optim/num_datums"] = float(len(data_D))
        metrics["optim/num_substeps"] = float(len(opts))
        if self.cfg.compute_post_kl and data_D:
            post = await reference_logprobs(await self.samplers[step + 1], data_D)
            metrics.update({k.replace("kl_sample_train", "kl_pre_post"): v for k, v in kl_sample_train(data_D, post).items()
                            if "kl_sample_train" in k})
        if sub.eval is not None:
            metrics.update(await sub.eval)
        return metrics

    @staticmethod
    async def _parts(subs: list[Submitted]) -> list[tuple[int | None, list[Datum], list[np.ndarray]]]:
        """Per submission: (its datums before its first optim_step, None: all; its datums; their trainer logprobs),
        for runner/rl/gate.on_policy."""
        out = []
        for s in subs:
            outs = [await f for _, f in s.fwd_bwd]
            before = None if s.before_optim is None else sum(len(chunk) for chunk, _ in s.fwd_bwd[: s.before_optim])
            out.append((before, [d for chunk, _ in s.fwd_bwd for d in chunk], [lp for o in outs for lp in o.logprobs]))
        return out

    _fifo_free = 0.0

    def _train_times(self, subs: list[Submitted]) -> dict[str, float]:
        """time/train: from when the FIFO reached the step (its submission, or the previous step's last call) to its
        last optim_step; time/snapshot: from there to the next sampler snapshot. Both from completion callbacks, so
        they are the backend's times, not the loop's waits (time/sampler_wait mixes the two)."""
        first, last = subs[0].times, subs[-1].times
        if "trained" not in last:
            return {}
        out = {"time/train": last["trained"] - max(first["submitted"], self._fifo_free)}
        self._fifo_free = last["trained"]
        if "snapshot" in last:
            out["time/snapshot"] = last["snapshot"] - last["trained"]
            self._fifo_free = last["snapshot"]
        return out

    async def _evaluate(self, step: int, sampler: SamplingClient) -> dict[str, float]:
        """Mean test-set reward on the weights that sampled `step` (test/env/all/reward/total, ...)."""
        assert self.test is not None
        builders = [b for i in range(len(self.test)) for b in get_batch(self.test, i, "test")][: self.cfg.eval.max_groups]
        params = replace(self.params, temperature=self.cfg.eval.temperature)
        t = time.monotonic()
        batch = await rollout_batch(builders, sampler, params, seed=self.seed + EVAL_SEED_OFFSET, step=step,
                                    max_context=self.max_context, what=f"the test set (eval at step {step})",
                                    timeout_s=self.env_timeout_s)
        out = {f"test/{k}": v for k, v in {**trajectory_metrics(batch.groups), **batch.error_metrics()}.items()}
        out["time/eval"] = time.monotonic() - t
        self._write_transcripts("test", step, batch, None)
        return out

    # ---------------------------------------------------------------- after the last step: the final eval


    def final_plan(self, evaluate: bool) -> str | None:
        if not evaluate or not self.test:
            return None
        return f"final eval (the test set on the final weights), logged at step {self.total_steps}"

    async def final(self, ctx: FinalContext, evaluate: bool) -> dict[str, float]:
        """The test-set eval on the final weights (ctx: runner.engine.loop.FinalContext)."""
        self.log_dir = ctx.log_dir  # a session resumed for the final eval alone prepared no step
        self._backend = ctx.backend
        self.samplers.clear()  # all older than the final weights (each local one holds a model copy)
        sampler = await ctx.backend.create_sampling_client(model_path=ctx.sampler_path)
        metrics = await self._evaluate(self.total_steps if ctx.step is None else ctx.step, sampler)
        metrics.update(await self._win_rate_vs_init(sampler, ctx.backend))
        return metrics

    async def _win_rate_vs_init(self, sampler: SamplingClient, backend: Backend) -> dict[str, float]:
        """A chained preference recipe with a model judge: test/win_rate_vs_init, the final policy's replies to the
        test prompts against the initial (init_from) policy's, judged by the reward model."""
        env = getattr(self.cfg, "env", None)
        if not (isinstance(env, Preference) and isinstance(env.judge, ModelJudge) and env.test_prompts
                and self.reference_path):
            return {}
        from runner.rl.envs.preference import ModelJudgeFn, win_rate

        init = await backend.create_sampling_client(model_path=self.reference_path)
        ctx = EnvContext(self.renderer, 1, 1, 1, self.seed, self.open_weights)
        rate = await win_rate(env.test_prompts, sampler, init, ModelJudgeFn(ctx, env.judge.init_from), self.renderer,
                              replace(self.params, temperature=self.cfg.eval.temperature), self.seed + EVAL_SEED_OFFSET)
        return {"test/win_rate_vs_init": rate}

    # ---------------------------------------------------------------- transcripts

    def env_label(self) -> str:
        return str(type(self.cfg.env).__struct_config__.tag)

    def transcript_due(self, split: str, step: int) -> bool:
        """Train transcripts on steps 0, N, 2N, ... (N = transcript_every) and the last step; eval transcripts
        (periodic and final) always; none at all when transcript_every or groups_to_log is 0."""
        cfg = self.cfg
        if self.log_dir is None or cfg.transcript_every == 0 or cfg.groups_to_log == 0:
            return False
        return split == "test" or step % cfg.transcript_every == 0 or step == self.total_steps - 1

    def _write_transcripts(self, split: str, step: int, batch: RolloutBatch, sampler_step: int | None) -> None:
        if not self.transcript_due(split, step):
            return
        assert self.log_dir is not None  # set by prepare / final before any rollout
        where = Path(self.log_dir) / f"iteration_{step:06d}"
        transcripts.write_html(where / f"{split}.html", batch.groups, self.renderer.decode,
                               title=f"{split} rollouts, step {step}", group_indices=batch.group_indices,
                               max_groups=self.cfg.groups_to_log)
        transcripts.write_rollout_summaries(where / f"{split}_rollout_summaries.jsonl", batch.groups, split=split,
                                            iteration=step, group_indices=batch.group_indices,
                                            sampling_client_step=sampler_step)

    # ---------------------------------------------------------------- dry run

    def describe(self) -> list[str]:
        cfg = self.cfg
        env = self.env_label()
        mode = type(cfg.mode).__struct_config__.tag
        test = f"{len(self.test)} test batches (eval group size {cfg.eval.group_size})" if self.test else "no test set"
        lines = [
            (f"env: {env}; {len(self.train)} train batches of {cfg.groups_per_batch} groups x {cfg.group_size} "
             f"episodes, x {cfg.epochs} epochs; {test}"),
            f"sampling: max_tokens {cfg.max_tokens}, temperature {cfg.temperature:g}; mode {mode}",
            (f"calls per step: {cfg.num_substeps} x (forward_backward({self.loss_fn}) + optim_step) "
             "+ save_weights_and_get_sampling_client"),
        ]
        if isinstance(getattr(cfg, "kl", None), ReferenceKL):
            lines.append(f"KL penalty vs the base model, coef {cfg.kl.coef:g}: compute_logprobs per datum")
        if (gate := getattr(cfg, "numerics", None)) is not None:
            lines.append(f"numerics gate ({gate.action}) from step {gate.after_steps}: max_kl {gate.max_kl:g}"
                         + (f", max_abs_dlogprob {gate.max_abs_dlogprob:g}" if gate.max_abs_dlogprob else ""))
        if cfg.transcript_every and cfg.groups_to_log:
            lines.append(f"transcripts (iteration_NNNNNN/): every {cfg.transcript_every} steps and the last step "
                         f"({cfg.groups_to_log} groups each), and every eval")
        else:
            lines.append("transcripts: none")
        return lines


def _stamp(fut: Future[object], times: dict[str, float], key: str) -> None:
    """times[key] = the time `fut` completes (a callback on the backend's thread; dict writes are atomic)."""
    fut.future().add_done_callback(lambda _: times.__setitem__(key, time.monotonic()))


def _stats(prefix: str, xs: Sequence[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {f"{prefix}_max": float(max(xs)), f"{prefix}_min": float(min(xs)), f"{prefix}_mean": float(np.mean(xs))}


def _merge(parts: list[dict[str, float]]) -> dict[str, float]:
    """Minibatch metrics into the step's: times and drop counts add up, the rest (KL) is averaged."""
    keys = {k for p in parts for k in p}
    return {k: float((np.sum if k.startswith("time/") or "dropped" in k else np.mean)([p[k] for p in parts if k in p]))
            for k in keys}


# ---------------------------------------------------------------- the registry entry (runner/engine/spec.py)

def build(cfg: RL, args: BuildArgs) -> Callable[[Tokenizer], RLAlgo]:
    loss_of(cfg)  # a user's loss: imported and registered before any model loads
    return lambda tokenizer: RLAlgo(cfg, Settings.of(args, tokenizer))


def env_headline(cfg: RL) -> list[tuple[str, str]]:
    """The env's own progress-line metrics (its module's `ENV`, runner/rl/envs/__init__.py)."""
    return headline_of(cfg.env)


def show(cfg: RL, recipe: Recipe, renderer: Renderer, n: int) -> list[Json]:
    """`runner render`: the first prompt of each of the first `n` training groups, built by the env itself (the
    group's first env). The groups are built at the recipe's group sizes: a builder may need them (tictactoe
    self-play makes group_size/2 games, none at a size of 1)."""
    ctx = EnvContext(ChatRenderer(renderer), cfg.group_size, cfg.eval.group_size, cfg.groups_per_batch, recipe.seed)
    train, _ = build_datasets(cfg.env, ctx)

    async def first() -> list[Json]:
        out: list[Json] = []
        for batch in range(len(train)):
            for group, builder in enumerate(get_batch(train, batch, "train")):
                if len(out) >= n:
                    return out
                envs = await builder.make_envs()
                if not envs:  # a user's builder that makes none: nothing of it to show
                    continue
                ob = await envs[0].initial_observation()
                if ob is not None:
                    tokens = list(ob[0])
                    out.append({"where": f"env {type(cfg.env).__struct_config__.tag} batch {batch} group {group}",
                                "tokens": tokens, "weights": [0.0] * len(tokens)})
        return out

    return asyncio.run(first())


SPEC = AlgoSpec(build=build, show=show, headline=[("env/all/reward/total", "reward"), ("test/env/all/reward/total", "test/reward")],
                compare=["test/env/all/reward/total", "env/all/reward/total"], headline_for=env_headline)
