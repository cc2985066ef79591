"""The one training loop: asynchronous, pipelined, resumable; the same for every algorithm and backend.

Per step k:
  1. prepare:  algo.prepare(k) builds the batch (SFT: tokenized datums; RL: rollouts, may await);
  2. submit:   algo.submit queues [forward on held-out data, on eval steps] + forward_backward +
               optim_step back to back, and a checkpoint step queues save_state (+ sampler weights)
               right behind them in the same FIFO, so the saved state is exactly "after step k";
  3. finish:   step k - depth: await its futures, log its metrics row, then its checkpoint row.
depth 0 is fully synchronous; depth d keeps d steps queued on the backend while the next batch is
prepared, so the backend never idles waiting for the client (cookbook `submit_ahead`; the service runs one
forward_backward + optim_step per model per clock cycle, and a request that arrives before a tick joins it).
After the last step, algo.final runs on the final checkpoint's weights (RL: one eval of the test set, as
the cookbook's "after the loop") and its metrics are one more row at step = total_steps (the cookbook's
end_batch). A run killed between its last step and that row resumes for final() alone; a run that has
the row (or whose algorithm has no final()) is finished.

An algorithm is anything with the `Algorithm` interface (runner/engine/context.py; SFT: runner/algos/sft.py);
`make_algo` (runner/engine/spec.py) is the one place a recipe's algo variant becomes one. Nothing here knows which backend runs.
Ctrl-C (the first stops after the submitted steps and a checkpoint, the second quits) is runner/engine/interrupt.py's.
"""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic

from backends.base import Backend, BackendError, Future, TrainingClient
from backends.errors import UserError
from backends.tokenizer import load_tokenizer
from backends.types import AdamParams, LoraSpec
from runner.engine.checkpoints import Checkpoint
from runner.engine.context import Algorithm, Context, FinalContext, InitWeights, Part, Sub
from runner.engine.cost import STEP as COST_STEP
from runner.engine.cost import BudgetReached, Ledger
from runner.engine.evals import names as eval_names
from runner.engine.evals import pinned_metrics
from runner.engine.interrupt import Interrupted as Interrupted  # runner/cli.py's, the tests'
from runner.engine.interrupt import StopFlag, until_stopped
from runner.engine.log import Progress, disk_error
from runner.engine.rundir import RunDir, open_run_dir, remove_own_state
from runner.engine.schedule import adam_at
from runner.engine.spec import make_algo, spec_of
from runner.recipe.common import Json
from runner.recipe.schema import Recipe


def lora_spec(recipe: Recipe) -> LoraSpec:
    lora = recipe.lora
    return LoraSpec(base_model=recipe.model, rank=lora.rank, seed=recipe.seed, train_attn=lora.train_attn,
                    train_mlp=lora.train_mlp, train_unembed=lora.train_unembed)


# ---------------------------------------------------------------- entry point

def run(recipe: Recipe, name: str, *, dry_run: bool = False, backend: Backend | None = None,
        init: InitWeights | None = None, weights: Mapping[str, str] | None = None, force: bool = False) -> None:
    """Train `recipe` in its run dir (resuming it when it holds the same recipe). `backend` replaces
    the recipe's (tests pass backends.fake.FakeBackend). `init`: start from another run's final weights
    (runner/engine/chain.py, which runs the upstream first). `force`: resume although the data changed."""
    if recipe.init_from is not None and init is None:
        raise UserError(f"{name}: init_from = {recipe.init_from!r} needs its upstream's weights: run it with "
                        "`runner run` (runner.engine.chain.run_chain), which runs the chain")
    build_algo = make_algo(recipe, init, weights)
    run_dir = open_run_dir(recipe, name, dry_run=dry_run, init=init.record() if init is not None else None,
                           force=force)
    if dry_run:
        tokenizer = backend.get_tokenizer() if backend is not None else load_tokenizer(recipe.tokenizer or recipe.model)
        print_plan(recipe, name, run_dir, build_algo(tokenizer))
        return
    status = "error"
    try:
        if backend is None:
            # Saved states live in the run dir, next to the checkpoints.jsonl rows that point at them.
            backend = recipe.backend.make(recipe.model, recipe.tokenizer, run_dir.path / "checkpoints", recipe.seed)
            if (where := recipe.backend.describe(recipe.model)) is not None:
                print(where, file=sys.stderr)
    except BaseException:
        run_dir.end(status)
        raise
    try:
        algo = build_algo(backend.get_tokenizer())
        if run_dir.resume is not None:
            algo.load_state(run_dir.resume.row, run_dir.start_step)
        final = final_plan(recipe, algo)
        if run_dir.start_step >= algo.total_steps and not final_due(run_dir, algo, final):
            print(f"{name}: already finished ({run_dir.start_step} steps in {run_dir.path}); nothing to do",
                  file=sys.stderr)
        else:
            if (warning := short_data_warning(recipe, algo)) is not None:
                print(f"warning: {warning}", file=sys.stderr)
            has_final = algo.final_plan(recipe.eval_every > 0) is not None
            for reload in range(MAX_RELOADS + 1):
                try:
                    asyncio.run(train(recipe, run_dir, backend, algo, has_final, init))
                    break
                except BackendError as e:
                    if not e.state_lost or reload == MAX_RELOADS:
                        raise
                    algo = reload_after_lost_state(run_dir, build_algo(backend.get_tokenizer()), e)
        status = "success"
    except BackendError as e:
        if e.user_error:
            raise UserError(str(e)) from None  # the message already names the request
        if (err := disk_error(e, run_dir.path / "checkpoints")) is not None:  # a save that hit a full disk
            raise err from None
        raise
    except Interrupted:
        status = "interrupted"
        raise
    except BudgetReached:  # stopped cleanly at the recipe's budget, like Ctrl-C
        status = "interrupted"
        raise
    finally:
        run_dir.end(status)
        backend.close(status)


MAX_RELOADS = 5  # server restarts one `runner run` rides out


def reload_after_lost_state(run: RunDir, algo: Algorithm, error: BackendError) -> Algorithm:
    """The service no longer holds the run's training client (a restarted `runner serve`, docs/serve.md): the
    steps since the run dir's last checkpoint are lost, the run is not. Set `run` up to resume from that
    checkpoint (as a new session of the run dir: the rows after it are set aside, the steps retrained) and
    return the fresh `algo` at its data position."""
    if run.tracker is not None:
        tracker, run.tracker = run.tracker, None
        tracker.finish("error")
    states = [r for r in run.checkpoints() if r.state_path]
    run.candidates, run.resume = states[::-1], states[-1] if states else None
    if run.resume is not None:
        algo.load_state(run.resume.row, run.start_step)
    where = (f"checkpoint {run.resume.name!r} (after {run.resume.next_step} steps)" if run.resume
             else "step 0 (no checkpoint yet)")
    print(f"{error}\nthe server lost the run's training state (restarted?): resuming from {where}", file=sys.stderr)
    return algo


def short_data_warning(recipe: Recipe, algo: Algorithm) -> str | None:
    """max_steps is a cap: when the data runs out first, say so (and how to get the steps) instead of silently
    running fewer."""
    if recipe.max_steps is None or algo.total_steps >= recipe.max_steps:
        return None
    epochs = getattr(recipe.algo, "epochs", 1)
    per_epoch = max(1, algo.total_steps // max(1, epochs))
    need = -(-recipe.max_steps // per_epoch)
    return (f"max_steps = {recipe.max_steps}, but the data gives {algo.total_steps} steps ({per_epoch} batches per "
            f"epoch x {epochs} epochs); running {algo.total_steps}. Set algo.epochs = {need} for {recipe.max_steps}.")


# ---------------------------------------------------------------- the loop

@dataclass
class Pending(Generic[Sub]):
    """A submitted step, until finish()."""

    step: int
    submitted: list[Sub]  # what the algorithm's submit() returned for each part
    lr: float
    prepare_s: float
    # The algorithm's state after preparing this step: the data position of step + 1.
    state: Json
    # Checkpoint name and save futures, when this step is a checkpoint step.
    save: tuple[str, Future[str], Future[str]] | None = None
    # Pinned evals run before this step (runner/engine/evals.py), logged in its row.
    pinned: dict[str, float] = field(default_factory=dict)


@dataclass
class Clock:
    """time/step (finish to finish: the pipelined throughput) and time/total (across sessions)."""

    before: float  # time/total spent by earlier sessions of this run
    start: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def lap(self) -> dict[str, float]:
        now = time.monotonic()
        times = {"time/step": now - self.last, "time/total": self.before + now - self.start}
        self.last = now
        return times


def final_plan(recipe: Recipe, algo: Algorithm) -> str | None:
    """What the row after the last step holds: the algorithm's final() and the recipe's pinned evals."""
    parts = [p for p in (algo.final_plan(recipe.eval_every > 0),) if p is not None]
    if recipe.evals:
        parts.append(f"pinned evals ({', '.join(eval_names(recipe.evals))}) on the final weights")
    return "; ".join(parts) or None


def final_due(run: RunDir, algo: Algorithm, final: str | None) -> bool:
    """Whether final() is still to run: after steps still to train, or for a run that trained every step but
    was stopped before its final row. A run past total_steps (max_steps lowered) has no final weights to log."""
    total, start = algo.total_steps, run.start_step
    return final is not None and (start < total or (start == total and not run.has_row(total)))


async def train(recipe: Recipe, run: RunDir, backend: Backend, algo: Algorithm, final: bool,
                init: InitWeights | None = None) -> None:
    """The steps from run.start_step on, then (when `final`) algo.final's row at step total_steps."""
    total, start = algo.total_steps, run.start_step
    ledger = Ledger.start(recipe, run.resume)  # tokens and cost, continuing the checkpoint's totals
    backend = ledger.wrap(backend)
    tc: TrainingClient | None = None
    if start < total:  # a run resumed for final() alone creates no training client
        if run.resume is not None:  # weights, optimizer moments and Adam's step count
            tc = await resume_client(recipe, run, backend, algo)
            start = run.start_step
        elif init is not None:  # a chained recipe: the upstream's final weights, a fresh optimizer
            tc = await backend.create_training_client_from_state(init.state_path, lora_spec(recipe),
                                                                with_optimizer=False)
        else:
            tc = await backend.create_training_client(lora_spec(recipe))
    clock = Clock(before=run.begin())
    progress = Progress(total, start, keys=spec_of(recipe.algo).progress_keys(recipe.algo))
    if run.resume is not None:
        where = f"at step {start}" if tc is not None else "after its last step, for the final row only"
        progress.message(f"resuming {run.path} {where} (checkpoint {run.resume.name})")
    elif run.announce:
        progress.message(f"{run.path}: {run.note}")
    if init is not None and run.resume is None:
        progress.message(f"starting from #{init.name}'s checkpoint {init.checkpoint} (weights only, step 0)")
    last_ckpt = run.resume
    with StopFlag(progress) as stop:
        if tc is not None:
            last_ckpt = await train_steps(recipe, run, backend, tc, algo, progress, clock, stop, ledger) or last_ckpt
        if stop.set:
            done = last_ckpt.next_step if last_ckpt else 0
            if stop.budget is not None:
                line = (f"{stop.budget}; stopped after {done} of {total} steps, checkpoint "
                        f"{last_ckpt.name if last_ckpt else '-'} in {run.path}; raise the budget and rerun to continue")
                progress.message(line)
                raise BudgetReached(line)
            progress.message(f"interrupted after {done} of {total} steps: checkpoint "
                             f"{last_ckpt.name if last_ckpt else '-'} saved in {run.path}; "
                             "run the same command to resume")
            raise Interrupted()
        # Pinned evals ([[evals]]) run on the final weights too, in the final row (a row of their own when the
        # algorithm has no final()).
        pinned = bool(recipe.evals)
        if final or pinned:
            assert last_ckpt is not None and last_ckpt.next_step == total  # the last step always checkpoints
            sampler = str(last_ckpt.sampler_path)
            metrics = await algo.final(FinalContext(backend, sampler, run.path),
                                       recipe.eval_every > 0) if final else {}
            if pinned:
                metrics.update(await pinned_metrics(
                    recipe.evals, backend.create_sampling_client(sampler), backend.get_tokenizer(),
                    recipe.renderer, recipe.model))
            row = {"step": total, **metrics, **ledger.row(ledger.take()), "time/total": clock.lap()["time/total"]}
            run.log_metrics(row)
            progress.final(row)
    progress.close()
    progress.message(f"done: {total} steps in {run.path}")


async def resume_client(recipe: Recipe, run: RunDir, backend: Backend, algo: Algorithm) -> TrainingClient:
    """A training client from the newest checkpoint that loads; a newer one that does not (a corrupt or missing
    state) is skipped with one line, and run.resume (with the algorithm's data position) moves back to the one
    that loaded."""
    assert run.resume is not None
    candidates = run.candidates or [run.resume]
    first_error: str | None = None
    for i, row in enumerate(candidates):
        path = str(row.state_path)
        try:
            if "://" not in path and not os.path.exists(path):
                raise BackendError(f"{path} does not exist")
            tc = await backend.create_training_client_from_state(path, lora_spec(recipe))
        except BackendError as e:
            reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            first_error = first_error or f"checkpoint {row.name!r}: {reason}"
            after = candidates[i + 1] if i + 1 < len(candidates) else None
            print(f"checkpoint {row.name!r} does not load ({reason}); "
                  + (f"trying {after.name!r} (after {after.next_step} steps)" if after else "no older one"),
                  file=sys.stderr)
            continue
        if row is not run.resume:
            run.resume = row
            algo.load_state(row.row, run.start_step)
            print(f"resuming from checkpoint {row.name!r} (after {row.next_step} steps), the newest that "
                  "loads", file=sys.stderr)
        return tc
    raise UserError(f"no checkpoint in {run.path} loads ({first_error}); set if_exists = \"overwrite\" to start "
                    "over (moves it aside)")


async def train_steps(recipe: Recipe, run: RunDir, backend: Backend, tc: TrainingClient,
                      algo: Algorithm[Part, Sub], progress: Progress, clock: Clock, stop: StopFlag, ledger: Ledger) -> Checkpoint | None:
    """Steps start_step .. total_steps - 1, pipelined `depth` deep; returns the last checkpoint row. When `stop`
    is set, no further step is started: the submitted ones finish and the last of them is checkpointed."""
    ttl = backend.checkpoint_ttl_seconds()  # periodic checkpoints only; the final one never expires
    ctx = Context(backend, backend.get_tokenizer(), run.path, tc.save_weights_and_get_sampling_client)
    pending: deque[Pending[Sub]] = deque()
    try:
        return await _steps(recipe, run, tc, algo, progress, clock, stop, ctx, ttl, pending, ledger)
    except NonFinite as e:  # the states saved after the weights went bad: none is kept
        e.saves += [p.save for p in pending if p.save is not None]
        await discard_non_finite(run, e)
        raise


async def _steps(recipe: Recipe, run: RunDir, tc: TrainingClient, algo: Algorithm[Part, Sub], progress: Progress,
                 clock: Clock, stop: StopFlag, ctx: Context, ttl: int | None,
                 pending: deque[Pending[Sub]], ledger: Ledger) -> Checkpoint | None:
    total, start = algo.total_steps, run.start_step
    ckpt: Checkpoint | None = None
    for step in range(start, total):
        if step == start and (why := ledger.exhausted()) is not None:  # resumed with the same budget
            stop.set, stop.budget = True, why
        if stop.set:
            break
        t = time.monotonic()
        adam = adam_at(recipe, step, total)
        evaluate = recipe.eval_every > 0 and step % recipe.eval_every == 0
        counted = COST_STEP.set(step)  # this step's backend calls (and the tasks it starts) count as its tokens
        # Pinned evals on the weights before this step (every step submitted so far), logged in its row.
        pinned = (await pinned_metrics(recipe.evals, ctx.snapshot(), ctx.tokenizer, recipe.renderer, recipe.model)
                  if evaluate else {})
        submitted: list[Sub] = []
        try:
            if not await until_stopped(prepare_step(algo, tc, step, ctx, adam, evaluate, submitted), stop, submitted):
                break  # Ctrl-C while preparing, before any of this step was submitted: it is not trained
        finally:
            COST_STEP.reset(counted)
        p = Pending(step, submitted, adam.learning_rate, time.monotonic() - t, algo.state(), pinned=pinned)
        if checkpoint_due(recipe, step, total):  # queued right behind this step's optim_step
            last = step == total - 1
            name = run.checkpoint_name(step, last)
            p.save = (name, tc.save_state(name, None if last else ttl),
                      tc.save_weights_for_sampler(name, None if last else ttl))
        pending.append(p)
        if step < total - 1 and (why := ledger.exhausted()) is not None:  # the budget: this step is the last
            stop.set, stop.budget = True, why
            break
        while len(pending) > recipe.depth:
            ckpt = await finish(pending.popleft(), algo, run, progress, clock, total, ledger) or ckpt
    if stop.set and pending and pending[-1].save is None:
        # Interrupted: checkpoint the last submitted step, right behind it in the FIFO.
        p = pending[-1]
        name = run.checkpoint_name(p.step, False)
        p.save = (name, tc.save_state(name, ttl), tc.save_weights_for_sampler(name, ttl))
    while pending:
        ckpt = await finish(pending.popleft(), algo, run, progress, clock, total, ledger) or ckpt
    return ckpt


async def prepare_step(algo: Algorithm[Part, Sub], tc: TrainingClient, step: int, ctx: Context, adam: AdamParams, evaluate: bool,
                       submitted: list[Sub]) -> None:
    """Build step `step`'s batch and submit its parts as they come (into `submitted`)."""
    async for part in algo.prepare(step, ctx):
        submitted.append(algo.submit(tc, step, part, adam, evaluate and not submitted))


async def finish(p: Pending[Sub], algo: Algorithm[Part, Sub], run: RunDir, progress: Progress, clock: Clock,
                 total: int, ledger: Ledger) -> Checkpoint | None:
    """Await a submitted step; write its metrics row, then (once its save is done) its checkpoint row,
    which it returns."""
    t = time.monotonic()
    metrics = await algo.finish(p.step, p.submitted)
    try:
        check_finite(p, metrics, run)
    except NonFinite as e:
        if p.save is not None:
            e.saves.append(p.save)
        raise
    row = {"step": p.step, **metrics, **p.pinned, "optim/lr": p.lr, "progress/done_frac": (p.step + 1) / total,
           "time/prepare": p.prepare_s, "time/wait": time.monotonic() - t, **ledger.row(ledger.take(p.step)),
           **clock.lap()}
    run.log_metrics(row)
    progress.update(p.step, row)
    if p.save is None:
        return None
    name, state_path, sampler_path = p.save
    ckpt = Checkpoint.of({"name": name, "step": p.step, "next_step": p.step + 1, "state_path": await state_path,
                          "sampler_path": await sampler_path, **p.state, **ledger.checkpoint(), "time": time.time()})
    run.add_checkpoint(ckpt)
    return ckpt


def guarded(key: str) -> bool:
    """The training metrics that must be finite: losses, NLLs and the gradient norm (not test/ ones: an eval on
    a held-out set says nothing about the weights being broken that the training loss would not)."""
    return not key.startswith("test/") and (key == "optim/grad_norm" or "loss" in key or "nll" in key)


class NonFinite(UserError):
    """A step's loss or gradient norm was not finite: the run stops (exit 2). `dropped`: checkpoint rows removed
    (their weights gave it); `saves`: this session's saves queued after the weights went bad."""

    def __init__(self, message: str, dropped: list[Checkpoint]):
        super().__init__(message)
        self.dropped = dropped
        self.saves: list[tuple[str, Future[str], Future[str]]] = []


def check_finite(p: Pending[Sub], metrics: Mapping[str, float], run: RunDir) -> None:
    """Stop the run before logging a step whose batch trains no token (UserError), or whose loss or gradient norm
    is not finite (NonFinite). A non-finite loss at step k was computed with the weights after step k - 1, so
    their checkpoint rows go too: the run dir keeps its last good checkpoint and a resume starts from it."""
    if metrics.get("num_loss_tokens") == 0:
        raise UserError(f"step {p.step}: no token of the batch is trained (num_loss_tokens = 0): every example's "
                        "trained part (the assistant's replies) is cut off by max_length, or there is none; "
                        "raise algo.max_length or check the data's roles")
    bad = [(k, v) for k, v in metrics.items() if guarded(k) and isinstance(v, (int, float)) and not math.isfinite(v)]
    if not bad:
        return
    key, value = bad[0]
    # A non-finite gradient norm with a finite loss: the weights before this step were fine, those after are not.
    loss_bad = any(k != "optim/grad_norm" for k, _ in bad)
    dropped = run.drop_checkpoints(p.step if loss_bad else p.step + 1)
    good = [r for r in run.checkpoints() if r.state_path]
    keep = (f"the last good checkpoint is {good[-1].name!r} (after {good[-1].next_step} steps)" if good
            else "no checkpoint before it is good: a resume starts from step 0")
    drop = (f"; dropped checkpoint(s) {', '.join(repr(r.name) for r in dropped)}, whose weights gave it"
            if dropped else "")
    raise NonFinite(f"step {p.step}: {key} = {value} (not finite; lr {p.lr:g}): stopped, keeping no non-finite "
                    f"checkpoint; {keep}{drop}. Lower lr or check the data", dropped)


async def discard_non_finite(run: RunDir, e: NonFinite) -> None:
    """Delete the saved states with non-finite weights (the dropped rows' and the saves queued after them), when
    they are runner's own files in the run dir's checkpoints/ (a service's checkpoints expire on their own)."""
    paths: list[str] = [p for r in e.dropped for p in (r.state_path, r.sampler_path) if p]
    for _, *futures in e.saves:
        for f in futures:
            try:
                paths.append(await f)
            except BackendError:
                continue
    for p in paths:  # only states runner wrote there, by name, never through a link (rundir.own_state)
        remove_own_state(run.path, p)


def checkpoint_due(recipe: Recipe, step: int, total: int) -> bool:
    """After every save_every steps, and always after the last one."""
    return step == total - 1 or (recipe.save_every > 0 and (step + 1) % recipe.save_every == 0)


# ---------------------------------------------------------------- dry run

def print_plan(recipe: Recipe, name: str, run: RunDir, algo: Algorithm) -> None:
    total, start = algo.total_steps, run.start_step
    final = final_plan(recipe, algo)
    lrs = [adam_at(recipe, s, total).learning_rate for s in range(total)]
    todo = range(start, total)
    saves = [s + 1 for s in todo if checkpoint_due(recipe, s, total)]
    evals = [s for s in todo if recipe.eval_every > 0 and s % recipe.eval_every == 0]
    algo_kind, backend_kind = type(recipe.algo).__name__, type(recipe.backend).__name__.lower()
    resuming = f", resuming at step {start}" if start else ""
    init = run.init
    lines = [
        f"recipe {name}: {algo_kind} on {recipe.model!r}, backend {backend_kind}",
        *([where] if (where := recipe.backend.describe(recipe.model)) is not None else []),
        *([f"init_from: #{init['name']} ({init['ref']}), its checkpoint {init['checkpoint']}: weights only, fresh "
           f"optimizer"] if init else []),
        f"run dir: {run.path} ({run.note})",
        f"steps: {total}{resuming}; depth {recipe.depth} (steps submitted ahead)",
        (f"lr: {type(recipe.schedule).__name__.lower()} schedule, peak {recipe.lr:g}, "
         f"first {lrs[0]:.3g}, last {lrs[-1]:.3g}"),
        *algo.describe(),
    ]
    if (warning := short_data_warning(recipe, algo)) is not None:
        lines.append(f"warning: {warning}")
    if todo:
        lines.append(f"evals before steps: {_short(evals)}" if evals else "evals: none")
        lines.append(f"checkpoints after steps: {_short(saves)} (the last is \"final\": state + sampler weights)")
    if final_due(run, algo, final):
        lines.append(f"after the last step: {final}" if todo else f"every step trained; still to run: {final}")
    elif not todo:
        lines.append("already finished: nothing to do")
    print("\n".join(lines))


def _short(xs: list[int]) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 8 else f"{', '.join(map(str, xs[:6]))}, ..., {xs[-1]}"
