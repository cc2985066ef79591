"""Clock cycles per step of the training loop under a simulated Tinker clock, and RL async vs sync speed.

Tinker's service runs in clock cycles (its docs' "Clock cycles" page): a worker pool runs one forward_backward +
optim_step per model per cycle in lock step, and a request that arrives before a tick joins that cycle.
A client that awaits each call before submitting the next pays a cycle per round trip; the docs call that
naive pattern about 3 cycles per RL step. `ClockBackend(inner, period_s)` simulates the clock around any
backend (the fake one by default, so compute is negligible next to the period):

  - every call is delegated to the inner backend at once, but its Future completes only at the first tick
    after it was submitted, once the inner result is ready, and never before the calls ahead of it in its
    client's FIFO;
  - per training client, a cycle holds any forward / forward_backward calls, then at most one optim_step;
    a forward or forward_backward queued behind that optim_step needs the updated weights, so it waits for
    the next cycle (so does a second optim_step). Saves and sampler snapshots queued right behind the
    optim_step share its cycle (they read the weights the cycle ends with);
  - sampling calls complete at the next tick (per sampling client, in order);
  - creating clients is setup, not a cycle: it completes at once.

Cycles per step = ticks from the first request's submission to the last optim_step's completion, / steps
("steady": between the first and last steps' optim_steps, / (steps - 1), leaving the start out). The SFT
rows tick every 50 ms; the RL rows every 500 ms, because the fake sampler itself spends 0.1-0.2 s of CPU on
an rl_basic batch (64 samples) on a busy 2-core machine, and a batch that is not ready at its tick slips a
cycle. Sampling calls run on a helper thread, so submitting them is instant, as with the real service.

Part 1 (cycles/step): the naive loops written here (SFT: await forward_backward, then await optim_step;
RL: await samples, then forward_backward, then optim_step), and the project's loop (runner.engine.loop.run) on an
SFT recipe at depth 0/1/2 and on the RL recipe in sync / stream / async mode.
Part 2 (steps/s): RL async (max_staleness 1) vs sync on the LOCAL backend with the tiny model, the
rl_basic recipe, interleaved repeated runs, medians and their ratio; also the per-step sampling (S) and
training (T) times of sync mode, which bound what overlapping them can give: (S + T) / max(S, T).

    OMP_NUM_THREADS=1 python bench/bench_loop.py              # both parts (~4 minutes)
    python bench/bench_loop.py --quick                        # fewer steps and rounds
    python bench/bench_loop.py --part cycles --period 0.05 --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import json
import os
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from backends.base import Backend, CustomLossFn, Future
from backends.errors import UserError
from backends.fake import FakeBackend
from backends.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoraSpec,
    LossFn,
    OptimStepOutput,
    SampleOutput,
    SamplingParams,
)
from runner.recipe.load import load_recipe
from runner.recipe.schema import Recipe
from runner.threads import prefer_passive_openmp

# As `runner run` does, before anything imports torch (OMP_WAIT_POLICY=ACTIVE in the environment overrides).
prefer_passive_openmp()

ROOT = Path(__file__).resolve().parent.parent
SFT_REF = str(ROOT / "examples" / "sft_tiny.toml") + "#sft_tiny"
RL_REF = str(ROOT / "recipes.toml") + "#rl_basic"

# Until recipes.toml has rl_basic, a stand-in with the same shape (arithmetic on the tiny model) is used.
FALLBACK_RL = """
[recipes.rl_basic]
lr = 1e-3
max_steps = 20

[recipes.rl_basic.algo]
kind = "rl"
env = { kind = "arithmetic", max_value = 20 }
group_size = 4
groups_per_batch = 8
max_tokens = 8
"""

# Ops that compute on the current weights: they cannot share a cycle with an optim_step ahead of them.
_NEEDS_WEIGHTS = {"forward", "forward_backward"}
# The "slow prep" rows: prepare() takes this many clock periods.
SLOW_PREPARE = 1.5


# ================================================================ the simulated clock


@dataclasses.dataclass
class Call:
    """One request, from submission to the tick it completed at."""

    client: int
    op: str  # forward | forward_backward | optim_step | save | sample
    inner: Future[Any]
    outer: concurrent.futures.Future[Any]
    submitted: float  # time.monotonic() at submission
    submit_tick: int  # ticks elapsed at submission: the call can join tick submit_tick + 1 at the earliest
    wrap: Callable[[Any], Any] | None = None  # e.g. wrap a sampling client made by a snapshot
    done_tick: int = -1


class ClockBackend:
    """Any Backend, behind a simulated Tinker clock of period `period_s` (see the module docstring).

    `ticks` counts the ticks so far; `log` holds every completed Call (op, submit_tick, done_tick)."""

    def __init__(self, inner: Backend, period_s: float = 0.05):
        self.inner, self.period = inner, period_s
        self.ticks = 0
        self.log: list[Call] = []
        self._queues: list[deque[Call]] = []  # one FIFO per client; index = client id
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="clock", daemon=True)
        self._thread.start()
        # The fake backend samples inside sample() itself: on the caller's thread, a cost the service would
        # not charge the client. Calls go through this thread so submitting stays instant, as with Tinker.
        self._sampler = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="clock-sampler")

    def offload(self, call: Callable[..., Future[Any]], *args: Any) -> Future[Any]:
        """call(*args) on the sampling thread; a Future of its result."""
        return Future(self._sampler.submit(lambda: call(*args).result()))

    # --- the Backend protocol

    def checkpoint_ttl_seconds(self) -> int | None:
        return self.inner.checkpoint_ttl_seconds()

    def get_tokenizer(self) -> Any:
        return self.inner.get_tokenizer()

    def create_training_client(self, spec: LoraSpec) -> Future[ClockTrainingClient]:
        return self.inner.create_training_client(spec).map(lambda tc: ClockTrainingClient(self, tc))

    def create_training_client_from_state(
        self, path: str, spec: LoraSpec, with_optimizer: bool = True
    ) -> Future[ClockTrainingClient]:
        fut = self.inner.create_training_client_from_state(path, spec, with_optimizer)
        return fut.map(lambda tc: ClockTrainingClient(self, tc))

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> Future[ClockSamplingClient]:
        fut = self.inner.create_sampling_client(model_path, base_model)
        return fut.map(lambda sc: ClockSamplingClient(self, sc))

    def close(self, status: str = "success") -> None:
        if self._stop.is_set():  # closed already (runner.engine.loop.run closes its backend)
            return
        self._stop.set()
        self._thread.join()
        self._sampler.shutdown(wait=True)
        self.inner.close(status)

    # --- the clock

    def new_queue(self) -> int:
        with self._lock:
            self._queues.append(deque())
            return len(self._queues) - 1

    def submit(self, client: int, op: str, inner: Future[Any], wrap: Callable[[Any], Any] | None = None) -> Future[Any]:
        outer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:  # the timestamp is taken under the lock, so a tick sees the call or it is too late
            self._queues[client].append(Call(client, op, inner, outer, time.monotonic(), self.ticks, wrap))
        return Future(outer)

    def _run(self) -> None:
        # Ticks are on an absolute grid, so a late thread catches up tick by tick instead of drifting.
        while True:
            at = self._t0 + (self.ticks + 1) * self.period
            delay = at - time.monotonic()
            if delay > 0 and self._stop.wait(delay):
                return
            if self._stop.is_set():
                return
            self._tick(at)

    def _tick(self, at: float) -> None:
        done: list[Call] = []
        with self._lock:
            self.ticks += 1
            for q in self._queues:
                optimized = False  # this client's cycle already ran its optim_step
                while q:
                    c = q[0]
                    if c.submitted >= at or not c.inner.done():
                        break
                    if optimized and (c.op == "optim_step" or c.op in _NEEDS_WEIGHTS):
                        break
                    optimized = optimized or c.op == "optim_step"
                    c.done_tick = self.ticks
                    done.append(q.popleft())
            self.log.extend(done)
        for c in done:  # outside the lock: completing a future runs its callbacks (asyncio wake-ups)
            try:
                value = c.inner.result()
                c.outer.set_result(c.wrap(value) if c.wrap is not None else value)
            except Exception as e:  # noqa: BLE001 - the inner failure is the request's own result
                c.outer.set_exception(e)

    def cycles(self, steps: int) -> tuple[float, float]:
        """(total, steady) cycles per step. total: ticks from the first submission to the last optim_step's
        completion, / steps; steady: ticks between the first and the last step's final optim_step, / (steps - 1),
        which leaves out the start (first snapshot, first samples)."""
        start = min(c.submit_tick for c in self.log)
        optims = sorted(c.done_tick for c in self.log if c.op == "optim_step")
        ends = optims[len(optims) // steps - 1 :: len(optims) // steps]  # each step's last optim_step
        return (optims[-1] - start) / steps, (ends[-1] - ends[0]) / max(steps - 1, 1)


class ClockTrainingClient:
    def __init__(self, clock: ClockBackend, inner: Any):
        self.clock, self.inner, self.qid = clock, inner, clock.new_queue()

    def forward(
        self, data: list[Datum], loss_fn: LossFn, loss_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]:
        return self.clock.submit(self.qid, "forward", self.inner.forward(data, loss_fn, loss_config))

    def forward_backward(
        self, data: list[Datum], loss_fn: LossFn, loss_config: dict[str, float] | None = None
    ) -> Future[ForwardBackwardOutput]:
        return self.clock.submit(self.qid, "forward_backward", self.inner.forward_backward(data, loss_fn, loss_config))

    def forward_backward_custom(self, data: list[Datum], loss_fn: CustomLossFn) -> Future[ForwardBackwardOutput]:
        return self.clock.submit(self.qid, "forward_backward", self.inner.forward_backward_custom(data, loss_fn))

    def optim_step(self, params: AdamParams) -> Future[OptimStepOutput]:
        return self.clock.submit(self.qid, "optim_step", self.inner.optim_step(params))

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return self.clock.submit(self.qid, "save", self.inner.save_state(name, ttl_seconds))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Future[str]:
        return self.clock.submit(self.qid, "save", self.inner.save_weights_for_sampler(name, ttl_seconds))

    def save_weights_and_get_sampling_client(self) -> Future[ClockSamplingClient]:
        return self.clock.submit(
            self.qid,
            "save",
            self.inner.save_weights_and_get_sampling_client(),
            wrap=lambda sc: ClockSamplingClient(self.clock, sc),
        )


class ClockSamplingClient:
    def __init__(self, clock: ClockBackend, inner: Any):
        self.clock, self.inner, self.qid = clock, inner, clock.new_queue()

    def sample(self, prompt: list[int], num_samples: int, params: SamplingParams) -> Future[SampleOutput]:
        return self.clock.submit(self.qid, "sample", self.clock.offload(self.inner.sample, prompt, num_samples, params))

    def compute_logprobs(self, tokens: list[int]) -> Future[list[float | None]]:
        return self.clock.submit(self.qid, "sample", self.clock.offload(self.inner.compute_logprobs, tokens))


# ================================================================ loops under the clock


def recipe_for(ref: str, run_dir: Path, overrides: Sequence[str]) -> Recipe:
    # No evals and only the final checkpoint: the bench measures the step pipeline, not the extras.
    _, recipe = load_recipe(
        ref, [f'log_dir="{run_dir}"', "eval_every=0", "save_every=0", 'if_exists="overwrite"', *overrides]
    )
    return recipe


def quiet_run(recipe: Recipe, backend: Backend) -> None:
    """runner.engine.loop.run without its progress lines (they would interleave with the tables)."""
    from runner.engine.loop import run

    with contextlib.redirect_stderr(io.StringIO()):
        run(recipe, "bench", backend=backend)


async def first_part(parts: Any) -> Any:
    """The one part an SFT prepare() yields."""
    async for part in parts:
        return part


def naive_sft(backend: ClockBackend, recipe: Recipe, steps: int) -> None:
    """Submit forward_backward, await it, submit optim_step, await it: one round trip per call."""
    from runner.engine.loop import lora_spec, make_algo

    algo = make_algo(recipe)(backend.get_tokenizer())
    tc = backend.create_training_client(lora_spec(recipe)).result()
    for step in range(steps):
        batch = asyncio.run(first_part(algo.prepare(step, None)))
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(AdamParams(learning_rate=recipe.lr)).result()


def naive_rl(backend: ClockBackend, steps: int, groups: int = 4, group_size: int = 4) -> None:
    """Sample the batch and await it, then forward_backward and await it, then optim_step and await it.
    The sampler snapshot for the next step is queued right behind optim_step (it shares that cycle), so
    the three round trips are sample, forward_backward and optim_step (the docs' ~3 cycles per step)."""
    tok = backend.get_tokenizer()
    tc = backend.create_training_client(LoraSpec(base_model="tiny", seed=0)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    params = SamplingParams(max_tokens=8, stop=[])
    prompts = [tok.encode(f"What is {i} + {2 * i}?") for i in range(groups)]
    for step in range(steps):
        futures = [sampler.sample(p, group_size, dataclasses.replace(params, seed=step)) for p in prompts]
        data_D: list[Datum] = []
        for prompt, fut in zip(prompts, futures, strict=True):
            seqs_G = fut.result().sequences
            # A toy reward (the share of even token ids) stands in for an environment: the bench times calls.
            rewards_G = np.array([np.mean([t % 2 == 0 for t in s.tokens]) for s in seqs_G])
            for s, adv in zip(seqs_G, rewards_G - rewards_G.mean(), strict=True):
                data_D.append(rl_datum(prompt, s.tokens, s.logprobs, float(adv)))
        tc.forward_backward(data_D, "importance_sampling").result()
        opt = tc.optim_step(AdamParams(learning_rate=1e-3))
        snapshot = tc.save_weights_and_get_sampling_client()
        opt.result()
        sampler = snapshot.result()


def rl_datum(prompt: list[int], tokens_T: list[int], logprobs_T: list[float], advantage: float) -> Datum:
    seq = prompt + tokens_T
    n = len(seq) - 1
    lp, adv, mask = np.zeros(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    lp[len(prompt) - 1 :], adv[len(prompt) - 1 :], mask[len(prompt) - 1 :] = logprobs_T, advantage, 1.0
    return Datum(model_input=seq[:-1], target_tokens=np.asarray(seq[1:]), logprobs=lp, advantages=adv, mask=mask)


@dataclasses.dataclass
class CycleRow:
    name: str
    period: float
    steps: int
    cycles: float
    steady: float
    wall_s: float


def measure(name: str, steps: int, period: float, body: Callable[[ClockBackend], None]) -> CycleRow:
    """Run `body` on a fresh fake backend behind a fresh clock."""
    from backends.local.tiny import build_tokenizer

    clock = ClockBackend(FakeBackend(build_tokenizer()), period)
    t = time.monotonic()
    try:
        body(clock)
    finally:
        clock.close()  # run() closes it itself; a second close does nothing
    return CycleRow(name, period, steps, *clock.cycles(steps), time.monotonic() - t)


def rl_ref(scratch: Path) -> tuple[str, str]:
    """(recipe ref, note): recipes.toml#rl_basic, or the stand-in FALLBACK_RL written under `scratch`."""
    try:
        load_recipe(RL_REF)
        return RL_REF, "recipes.toml#rl_basic"
    except UserError:
        path = scratch / "rl_fallback.toml"
        path.write_text(FALLBACK_RL)
        return f"{path}#rl_basic", "bench stand-in for rl_basic (recipes.toml has none yet)"


def rl_available(ref: str) -> str | None:
    """None when the RL loop can run `ref` here, else why not."""
    from runner.engine.loop import make_algo

    try:
        with tempfile.TemporaryDirectory() as d:
            make_algo(recipe_for(ref, Path(d), []))
    except (UserError, TypeError) as e:
        return f"the loop cannot run {ref} ({e})"
    return None


def rl_mode_overrides(mode: str) -> list[str]:
    return {
        "sync": ['algo.mode={kind="sync"}'],
        "stream": ['algo.mode={kind="stream"}'],
        "async": ['algo.mode={kind="async", max_staleness=1}'],
    }[mode]


@contextlib.contextmanager
def slow_prepare(seconds: float) -> Iterator[None]:
    """SFTAlgo.prepare sleeps `seconds` first: data preparation that costs more than a cycle."""
    from runner.algos.sft import SFTAlgo

    fast = SFTAlgo.prepare

    async def prepare(self: SFTAlgo, step: int, ctx: Any) -> Any:
        await asyncio.sleep(seconds)
        async for part in fast(self, step, ctx):
            yield part

    SFTAlgo.prepare = prepare  # type: ignore[method-assign]
    try:
        yield
    finally:
        SFTAlgo.prepare = fast  # type: ignore[method-assign]


def cycles_table(steps: int, period: float, rl_period: float, only: Collection[str] | None = None) -> list[CycleRow]:
    """The rows of the cycles table; `only`: just the rows of these names (tests/test_bench.py's claims)."""
    rows: list[CycleRow] = []

    def wanted(name: str) -> bool:
        return only is None or name in only

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)

        def loop(name: str, ref: str, overrides: list[str], clock_period: float) -> None:
            if not wanted(name):
                return
            recipe = recipe_for(ref, tmp / f"run{len(rows)}", [f"max_steps={steps}", *overrides])
            rows.append(measure(name, steps, clock_period, lambda b: quiet_run(recipe, b)))

        sft = recipe_for(SFT_REF, tmp / "naive", [f"max_steps={steps}"])
        if wanted(name := "SFT naive (await fb, await optim)"):
            rows.append(measure(name, steps, period, lambda b: naive_sft(b, sft, steps)))
        for depth in (0, 1, 2):
            loop(f"SFT runner.engine.loop depth={depth}", SFT_REF, [f"depth={depth}"], period)
        # A prepare() slower than a cycle (as RL sampling is): depth > 0 hides it behind the queued step.
        for depth in (0, 1):
            with slow_prepare(SLOW_PREPARE * period):
                loop(f"SFT runner.engine.loop depth={depth}, slow prep", SFT_REF, [f"depth={depth}"], period)
        if wanted(name := "RL naive (await sample, fb, optim)"):
            rows.append(measure(name, steps, rl_period, lambda b: naive_rl(b, steps)))
        ref, note = rl_ref(tmp)
        why = rl_available(ref)
        if why is not None:
            print(f"RL loop: NOT MEASURED: {why}")
            return rows
        print(f"RL recipe: {note}")
        for mode in ("sync", "stream", "async"):
            label = "async K=1" if mode == "async" else mode
            loop(f"RL runner.engine.loop {label}", ref, rl_mode_overrides(mode), rl_period)
    return rows


def print_cycles(rows: list[CycleRow]) -> None:
    print("\ncycles per step (simulated Tinker clock, fake inner backend)")
    print(f"{'loop':<38} {'period':>6} {'steps':>5} {'cycles/step':>11} {'steady':>6} {'wall s':>7}")
    for r in rows:
        print(
            f"{r.name:<38} {r.period * 1000:>4.0f}ms {r.steps:>5} {r.cycles:>11.2f} {r.steady:>6.2f} {r.wall_s:>7.2f}"
        )


# ================================================================ RL async vs sync on the local backend


@dataclasses.dataclass
class LocalRun:
    steady: float  # steps/s finish-to-finish after the first step (the loop's time/total)
    whole: float  # steps/s of the whole run(), model load included
    prepare_s: float  # median per step (after the first) of the loop's time/prepare ...
    sampler_wait_s: float  # ... of the RL algo's time/sampler_wait (waiting for the step's snapshot) ...
    wait_s: float  # ... and of the loop's time/wait (awaiting the step's training calls)
    cpu_s: float  # process CPU seconds per step over the whole run (all threads; model load included)


def rl_local_once(ref: str, mode: str, steps: int, run_dir: Path, overrides: Sequence[str]) -> LocalRun:
    """One run of the RL recipe on the local backend (the model load is inside `whole` only)."""
    from runner.engine.loop import run
    from runner.engine.rundir import METRICS

    recipe = recipe_for(
        ref, run_dir, [f"max_steps={steps}", 'backend={kind="local"}', *rl_mode_overrides(mode), *overrides]
    )
    t, cpu = time.monotonic(), time.process_time()
    with contextlib.redirect_stderr(io.StringIO()):
        run(recipe, "bench")
    whole, cpu = steps / (time.monotonic() - t), (time.process_time() - cpu) / steps
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line.strip()]
    ends = [r["time/total"] for r in rows]
    later = rows[1:]

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in later)

    steady = (len(ends) - 1) / (ends[-1] - ends[0])
    return LocalRun(steady, whole, med("time/prepare"), med("time/sampler_wait"), med("time/wait"), cpu)


def rl_speed(
    steps: int, rounds: int, overrides: Sequence[str], recipe: str | None = None
) -> tuple[str, dict[str, list[LocalRun]]]:
    """Interleaved sync / async (K = 1) runs of the RL recipe; (recipe note, the runs per mode)."""
    runs: dict[str, list[LocalRun]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref, note = (recipe, recipe) if recipe else rl_ref(tmp)
        why = rl_available(ref)
        if why is not None:
            raise UserError(why)
        rl_local_once(ref, "sync", 2, tmp / "warmup", overrides)  # first-call costs: imports, allocator
        # Interleaved (sync, async, sync, async, ...) so drift in the machine's load hits both alike.
        for i, mode in enumerate(itertools.islice(itertools.cycle(("sync", "async")), 2 * rounds)):
            runs[mode].append(rl_local_once(ref, mode, steps, tmp / f"{mode}{i}", overrides))
    return note, runs


def print_speed(note: str, runs: dict[str, list[LocalRun]], steps: int, overrides: Sequence[str]) -> None:
    extra = f", overrides {' '.join(overrides)}" if overrides else ""
    print(
        f"\nRL steps/s on the local backend ({note}; {steps} steps per run, {len(runs['sync'])} interleaved "
        f"rounds{extra}; load avg {os.getloadavg()[0]:.2f})"
    )
    print(
        f"{'mode':<10} {'steady':>7} {'whole':>7} {'prepare':>8} {'snap wait':>9} {'wait':>6} {'cpu/step':>8}"
        "  steady per run"
    )
    med: dict[str, LocalRun] = {}
    for mode, rs in runs.items():
        med[mode] = LocalRun(*(statistics.median(getattr(r, f.name) for r in rs) for f in dataclasses.fields(LocalRun)))
        m = med[mode]
        label = "async K=1" if mode == "async" else mode
        print(
            f"{label:<10} {m.steady:>7.3f} {m.whole:>7.3f} {m.prepare_s:>7.3f}s {m.sampler_wait_s:>8.3f}s "
            f"{m.wait_s:>5.3f}s {m.cpu_s:>7.3f}s  {' '.join(f'{r.steady:.3f}' for r in rs)}"
        )
    # Round i's async run directly follows its sync run, so their ratio sees nearly the same machine load.
    paired = statistics.median(a.steady / s.steady for s, a in zip(runs["sync"], runs["async"], strict=True))
    # In sync mode a step is T (train + snapshot: the wait for the snapshot) then S (sampling and datums);
    # async overlaps them, so with two free cores a step takes max(S, T): that bounds the ratio.
    train = med["sync"].sampler_wait_s
    sample = med["sync"].prepare_s - train
    print(
        f"ratio async/sync: steady {med['async'].steady / med['sync'].steady:.2f} (median of per-round ratios "
        f"{paired:.2f}), whole run {med['async'].whole / med['sync'].whole:.2f}"
    )
    print(
        f"perfect-overlap bound (S+T)/max(S,T) = {(sample + train) / max(sample, train):.2f} "
        f"(sync: S = {sample:.3f}s sampling + datums, T = {train:.3f}s training + snapshot)"
    )


# ================================================================ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("cycles", "speed", "all"), default="all")
    ap.add_argument("--period", type=float, default=0.05, help="clock period in seconds (default 0.05)")
    ap.add_argument(
        "--rl-period",
        type=float,
        default=0.5,
        help="clock period of the RL rows (default 0.5: the fake sampler spends ~0.1-0.2 s of CPU on an rl_basic batch)",
    )
    ap.add_argument("--steps", type=int, default=20, help="steps per clocked run (default 20)")
    ap.add_argument("--rl-steps", type=int, default=8, help="steps per local RL run (default 8)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved local RL rounds (default 5)")
    ap.add_argument(
        "--rl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra recipe override for the local RL runs (repeatable)",
    )
    ap.add_argument(
        "--rl-recipe", default=None, metavar="FILE#NAME", help="RL recipe of the local runs (default recipes.toml#rl_basic)"
    )
    ap.add_argument("--quick", action="store_true", help="10 clocked steps, 2 rounds of 4 RL steps")
    args = ap.parse_args()
    if args.quick:
        args.steps, args.rl_steps, args.rounds = 10, 4, 2
    print(
        f"load avg at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    if args.part in ("cycles", "all"):
        print_cycles(cycles_table(args.steps, args.period, args.rl_period))
    if args.part in ("speed", "all"):
        try:
            note, runs = rl_speed(args.rl_steps, args.rounds, args.rl_override, args.rl_recipe)
        except UserError as e:
            print(f"\nRL async vs sync on the local backend: NOT MEASURED: {e}")
        else:
            print_speed(note, runs, args.rl_steps, args.rl_override)


if __name__ == "__main__":
    main()
