"""Group rollouts: run every env of a group concurrently against one sampling client, then add group rewards.

Reproducibility: every sample gets an explicit seed derived from (recipe seed, step, group, member, turn),
so a rerun (or a resume) samples the same tokens from the same weights, whatever order the coroutines run in.

One request per group: when a group's members open with the same prompt (a problem sampled group_size times),
their first turn goes out as ONE request with num_samples = the run of members (_FirstTurn), rather than one
request each. Members' seeds are consecutive (sample_seed), and a backend samples sample k of a request seeded s
as it samples a one-sample request seeded s + k (backends/local/sampler.py), so the tokens are the same whichever
way they were sent: grouping is only fewer requests (over HTTP, 8x fewer for rl_basic), never other samples.

Errors: UserError and BackendError stop the run (the user must fix something, or the service gave up).
An env that breaks the contract in runner/rl/types.py (a step that returns something other than a
StepResult, a reward that is not a finite number, metrics that are not numbers, a bad observation) is a
UserError. Any other exception from an episode (typically a bug in env code) drops that whole group, since
a group with a missing member has no fair baseline, and is counted in `rollout_errors/*`; if every group of
a batch fails, that is a UserError naming the first failure (where in the env's code it was raised), rather
than training on nothing.

Timeouts: with `timeout_s` (the RL recipe's env_timeout_s), a group whose rollout (its envs' steps and the
sampling they wait for) has not finished within it is cancelled and dropped like a failed one, counted as
`rollout_errors/EnvTimeout`. That covers an env awaiting something that never comes, and (runner/rl/loopwatch.py) an env that blocks the
event loop's thread in a synchronous call: its call is interrupted with EnvTimeout. Ctrl-C stops a run whatever an
env does (runner/engine/loop.py StopFlag).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import traceback
from collections import Counter
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from backends.base import BackendError, SamplingClient
from backends.errors import UserError
from backends.types import SampleOutput, SamplingParams
from runner.rl import loopwatch
from runner.rl.types import Env, EnvGroupBuilder, StepResult, Trajectory, TrajectoryGroup, Transition

log = logging.getLogger(__name__)

# A guard against envs that never end; the built-in envs stop themselves long before.
MAX_TURNS = 256


class EpisodeTooLong(RuntimeError):
    pass


class EnvTimeout(RuntimeError):
    """A group's rollout took longer than env_timeout_s: cancelled, its group dropped and counted."""


class ContextOverflow(RuntimeError):
    """An observation left no room to sample in the model's context. Counted and its group dropped (rather
    than truncating the episode), because a truncated seat of a self-play game would leave the other waiting."""


@dataclass(frozen=True)
class RolloutBatch:
    groups: list[TrajectoryGroup]
    # Index in the batch of each kept group (failed groups are absent).
    group_indices: list[int]
    # Exception type name -> groups it dropped.
    errors: Counter[str] = field(default_factory=Counter)

    def error_metrics(self) -> dict[str, float]:
        out = {f"rollout_errors/{name}": float(n) for name, n in sorted(self.errors.items())}
        out["rollout_errors/total"] = float(sum(self.errors.values()))
        out["rollout_errors/groups_skipped"] = float(sum(self.errors.values()))
        return out


# How long a group's first member waits for its siblings' first prompts before sending what it has (a
# self-play seat's first prompt waits for the other seat's move, so not every member comes at once).
FIRST_TURN_WAIT_S = 0.005


def sample_seed(seed: int, step: int, group: int, member: int, turn: int) -> int:
    """A 31-bit seed: a hash of (seed, step, group, turn) (so neighbouring coordinates are unrelated) plus the
    member, so a group's members have consecutive seeds and can share one request (see the module docstring).
    Member 0's seed is the hash alone (a group of one samples as it did before groups shared requests); past
    2**31 the seeds wrap, which only splits that group's request in two."""
    words = [x % 2**32 for x in (seed, seed >> 32, step, group, 0, turn)]
    return (int(np.random.SeedSequence(words).generate_state(1)[0]) + member) & 0x7FFFFFFF


class _FirstTurn:
    """A group's first-turn sample requests, gathered: once every member has asked (or ended without asking),
    or FIRST_TURN_WAIT_S after the first asked, each run of consecutive members with the same prompt and
    parameters (and consecutive seeds) is sent as one request with num_samples = its length; a member that asks
    later samples alone. The result is the same tokens as one request per member (module docstring)."""

    def __init__(self, client: SamplingClient, size: int):
        self.client, self.size = client, size
        self.asked: dict[int, tuple[list[int], SamplingParams, asyncio.Future[SampleOutput]]] = {}
        self.counted: set[int] = set()
        self.open = True
        self.timer: asyncio.TimerHandle | None = None
        self.deliveries: set[asyncio.Task[None]] = set()

    async def sample(self, member: int, ob: list[int], params: SamplingParams) -> SampleOutput:
        if not self.open or member in self.counted:
            return await self.client.sample(ob, 1, params)
        fut: asyncio.Future[SampleOutput] = asyncio.get_running_loop().create_future()
        self.asked[member] = (ob, params, fut)
        self._count(member)
        return await fut

    def leave(self, member: int) -> None:
        """The member ended (or failed) without asking for its first turn: stop waiting for it."""
        if self.open:
            self._count(member)

    def _count(self, member: int) -> None:
        self.counted.add(member)
        if len(self.counted) >= self.size:
            self._send()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(FIRST_TURN_WAIT_S, self._send)

    def _send(self) -> None:
        if not self.open:
            return
        self.open = False
        if self.timer is not None:
            self.timer.cancel()
        runs: list[list[int]] = []
        for m in sorted(self.asked):
            if runs and self._joins(runs[-1], m):
                runs[-1].append(m)
            else:
                runs.append([m])
        for run in runs:
            ob, params, _ = self.asked[run[0]]
            futs = [self.asked[m][2] for m in run]
            task = asyncio.ensure_future(self._deliver(ob, params, futs))
            self.deliveries.add(task)
            task.add_done_callback(self.deliveries.discard)

    def _joins(self, run: list[int], m: int) -> bool:
        ob0, p0, _ = self.asked[run[0]]
        ob, p, _ = self.asked[m]
        return (m == run[-1] + 1 and ob == ob0 and p0.seed is not None and p.seed == p0.seed + len(run)
                and replace(p, seed=p0.seed) == p0)

    async def _deliver(self, ob: list[int], params: SamplingParams, futs: list[asyncio.Future[SampleOutput]]) -> None:
        try:
            out = await self.client.sample(ob, len(futs), params)
            if len(out.sequences) != len(futs):
                raise RuntimeError(f"sampler returned {len(out.sequences)} samples for num_samples={len(futs)}")
        except Exception as e:  # noqa: BLE001 - raised in every member that waits for it
            for f in futs:
                if not f.done():
                    f.set_exception(e)
            return
        for f, seq in zip(futs, out.sequences, strict=True):
            if not f.done():
                f.set_result(SampleOutput(sequences=[seq]))


async def run_episode(
    env: Env,
    sampling_client: SamplingClient,
    params: SamplingParams,
    *,
    seed: int,
    step: int,
    group: int,
    member: int,
    max_context: int | None = None,
    first_turn: _FirstTurn | None = None,
) -> Trajectory:
    """One episode. first_turn (do_group_rollout's): where its first sample request goes, to be sent with its
    siblings'; None: every request alone."""
    first = await _awaited(env, "initial_observation", env.initial_observation())
    if first is None:
        return Trajectory([])
    if not (isinstance(first, (tuple, list)) and len(first) == 2):
        raise UserError(
            f"env {type(env).__name__}.initial_observation returned {_got(first)}, expected "
            "(observation tokens, stop condition) or None"
        )
    ob, stop = first
    transitions: list[Transition] = []
    for turn in range(MAX_TURNS):
        _check_observation(env, ob, turn)
        _check_stop(env, stop, turn)
        max_tokens = params.max_tokens
        if max_context is not None:
            if len(ob) >= max_context:
                raise ContextOverflow(
                    f"{type(env).__name__}: a {len(ob)}-token prompt at turn {turn} fills the "
                    f"{max_context}-token context"
                )
            # As the cookbook's completer: sample only what still fits.
            max_tokens = min(max_tokens, max_context - len(ob))
        turn_params = replace(
            params, max_tokens=max_tokens, stop=stop, seed=sample_seed(seed, step, group, member, turn)
        )
        if turn == 0 and first_turn is not None:
            out = await first_turn.sample(member, ob, turn_params)
        else:
            out = await sampling_client.sample(ob, 1, turn_params)
        ac = out.sequences[0]
        if len(ac.logprobs) != len(ac.tokens):
            raise RuntimeError(f"sampler returned {len(ac.tokens)} tokens but {len(ac.logprobs)} logprobs")
        res = await _awaited(env, "step", env.step(list(ac.tokens), ac.stop_reason))
        reward, metrics, logs = _check_step_result(env, res)
        transitions.append(Transition(ob, ac, reward, bool(res.episode_done), metrics, logs))
        if res.episode_done:
            return Trajectory(transitions)
        ob, stop = res.next_observation, res.next_stop
    raise EpisodeTooLong(f"{type(env).__name__} did not end its episode within {MAX_TURNS} turns")


T = TypeVar("T")


async def _awaited(owner: object, method: str, value: Awaitable[T]) -> T:
    """await value, or one line saying the user's method is not `async def` (a plain TypeError otherwise)."""
    if not inspect.isawaitable(value):
        raise UserError(f"{type(owner).__name__}.{method} returned a {type(value).__name__}, not a coroutine: "
                        "define it with `async def`")
    return await value


def _check_observation(env: Env, ob: object, turn: int) -> None:
    if not (isinstance(ob, list) and ob and all(isinstance(t, int) for t in ob)):
        where = "initial_observation" if turn == 0 else f"step (turn {turn - 1}) next_observation"
        raise UserError(
            f"env {type(env).__name__}.{where} is {_got(ob)}, expected a non-empty list of token ids"
        )


def _check_stop(env: Env, stop: object, turn: int) -> None:
    """A StopCondition: None, or a list of strings or of token ids (a bare string would stop on each character)."""
    if stop is None or (isinstance(stop, list) and (all(isinstance(s, str) and s for s in stop)
                                                    or all(isinstance(s, int) and not isinstance(s, bool) for s in stop))):
        return
    where = "initial_observation" if turn == 0 else f"step (turn {turn - 1}) next_stop"
    raise UserError(f"env {type(env).__name__}.{where} stop condition is {_got(stop)}, expected None or a list of "
                    "strings or of token ids")


def _check_step_result(env: Env, res: object) -> tuple[float, dict[str, float], dict[str, str | int | float]]:
    """The step's reward, metrics and logs, checked against the contract (runner/rl/types.py): one line naming
    the env and the field rather than a crash (or NaN weights) further on."""
    name = f"env {type(env).__name__}.step"
    if not isinstance(res, StepResult):
        raise UserError(f"{name} returned {_got(res)}, expected a runner.rl.types.StepResult")
    reward = _number(res.reward)
    if reward is None or not math.isfinite(reward):
        raise UserError(f"{name} returned reward {_got(res.reward)}, expected a finite number")
    if not isinstance(res.episode_done, (bool, np.bool_)):
        raise UserError(f"{name} returned episode_done {_got(res.episode_done)}, expected True or False")
    metrics = _check_metrics(name, res.metrics)
    if not isinstance(res.logs, dict):
        raise UserError(f"{name} returned logs {_got(res.logs)}, expected a dict of name -> str, int or float")
    # Logs are only shown (transcripts, rollout summaries): anything else is shown as its repr.
    logs = {str(k): v if isinstance(v, (str, int, float)) else repr(v) for k, v in res.logs.items()}
    return reward, metrics, logs


def _check_metrics(name: str, metrics: object) -> dict[str, float]:
    if not isinstance(metrics, dict):
        raise UserError(f"{name} returned metrics {_got(metrics)}, expected a dict of name -> number")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        x = _number(v)
        if not isinstance(k, str) or x is None:
            raise UserError(f"{name} returned metric {k!r} = {_got(v)}, expected a number under a string key")
        out[k] = x
    return out


def _number(v: object) -> float | None:
    """float(v) for a real number (bool, int, float, numpy scalar, 0-d tensor); None for anything else."""
    if v is None or isinstance(v, (str, bytes)):
        return None
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _got(v: object) -> str:
    if v is None:
        return "None"
    text = repr(v)
    return f"{type(v).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


async def do_group_rollout(
    builder: EnvGroupBuilder,
    sampling_client: SamplingClient,
    params: SamplingParams,
    *,
    seed: int = 0,
    step: int = 0,
    group_idx: int = 0,
    max_context: int | None = None,
) -> TrajectoryGroup:
    envs_G = list(await _awaited(builder, "make_envs", builder.make_envs()))
    first_turn = _FirstTurn(sampling_client, len(envs_G))

    async def member(i: int, env: Env) -> Trajectory:
        try:
            return await run_episode(env, sampling_client, params, seed=seed, step=step, group=group_idx, member=i,
                                     max_context=max_context, first_turn=first_turn)
        finally:
            first_turn.leave(i)  # ended or failed before asking: the siblings stop waiting for it (else a no-op)

    # A TaskGroup rather than a bare gather: if one episode fails, its siblings are cancelled instead of
    # left running (a self-play seat would otherwise wait forever for a move that never comes).
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(member(i, env)) for i, env in enumerate(envs_G)]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    trajectories_G = [t.result() for t in tasks]
    rewards = await _awaited(builder, "compute_group_rewards", builder.compute_group_rewards(trajectories_G, envs_G))
    name = f"{type(builder).__name__}.compute_group_rewards"
    if not isinstance(rewards, (list, tuple)) or len(rewards) != len(trajectories_G):
        got = f"{len(rewards)} rewards" if isinstance(rewards, (list, tuple)) else _got(rewards)
        raise UserError(f"{name} returned {got} for {len(trajectories_G)} trajectories, expected a list of "
                        "(reward, metrics) pairs, one per trajectory")
    final_rewards_G: list[float] = []
    metrics_G: list[dict[str, float]] = []
    for item in rewards:
        reward = _number(item[0]) if isinstance(item, (tuple, list)) and len(item) == 2 else None
        if reward is None or not isinstance(item[1], dict) or not math.isfinite(reward):
            raise UserError(f"{name} returned {_got(item)} for a trajectory, expected a (finite reward, metrics dict) pair")
        final_rewards_G.append(reward)
        metrics_G.append(_check_metrics(name, item[1]))
    return TrajectoryGroup(
        trajectories_G=trajectories_G,
        final_rewards_G=final_rewards_G,
        metrics_G=metrics_G,
        tags=list(builder.logging_tags()),
    )


async def guarded_group_rollout(
    builder: EnvGroupBuilder,
    sampling_client: SamplingClient,
    params: SamplingParams,
    *,
    seed: int = 0,
    step: int = 0,
    group_idx: int = 0,
    max_context: int | None = None,
    timeout_s: float | None = None,
) -> TrajectoryGroup | Exception:
    """do_group_rollout, with a failure of the env's own code returned (to be counted) rather than raised, and
    a group that outlasts `timeout_s` cancelled and returned as EnvTimeout."""
    deadline = asyncio.timeout(None)
    try:
        with loopwatch.guard(timeout_s, run_episode.__code__, EnvTimeout) as watch:  # an env blocking the loop
            async with deadline:
                cancel = loopwatch.keep_deadline(deadline, timeout_s, watch)
                try:
                    return await do_group_rollout(
                        builder, sampling_client, params, seed=seed, step=step, group_idx=group_idx,
                        max_context=max_context,
                    )
                finally:
                    cancel()
    except (UserError, BackendError):
        raise
    except TimeoutError as e:
        if not deadline.expired():  # the env's own TimeoutError: a failure like any other
            log.warning("rollout of group %d (step %d) failed: %s", group_idx, step, describe_error(e))
            return e
        log.warning("rollout of group %d (step %d) exceeded env_timeout_s = %g s: dropped", group_idx, step,
                    timeout_s)
        return EnvTimeout(f"group {group_idx} of step {step} did not finish within env_timeout_s = {timeout_s:g} s")
    except Exception as e:  # noqa: BLE001 - counted and skipped; see the module docstring
        log.warning("rollout of group %d (step %d) failed: %s", group_idx, step, describe_error(e))
        return e


def collect(results: Sequence[tuple[int, TrajectoryGroup | Exception]], what: str = "the batch") -> RolloutBatch:
    """(group index, outcome) pairs -> a RolloutBatch; a UserError naming the first error if every group failed
    (`what`: which rollouts, for that message)."""
    errors: Counter[str] = Counter(type(r).__name__ for _, r in results if isinstance(r, Exception))
    kept = [(i, r) for i, r in results if isinstance(r, TrajectoryGroup)]
    if results and not kept:
        lost = next((r for _, r in results if isinstance(r, BackendError) and r.state_lost), None)
        if lost is not None:  # a restarted server: the loop resumes from the last checkpoint (runner/engine/loop.py)
            raise lost
        first = next(r for _, r in results if isinstance(r, Exception))
        n = len(results)
        raise UserError(f"{'the only group' if n == 1 else f'all {n} groups'} of {what} failed; "
                        f"the first error: {describe_error(first)}") from None
    return RolloutBatch([g for _, g in kept], [i for i, _ in kept], errors)


_RUNNER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def describe_error(e: BaseException) -> str:
    """One line: the exception and, when it was raised outside the runner (in env code), where."""
    text = " ".join(str(e).split())
    out = f"{type(e).__name__}: {text}" if text else type(e).__name__
    frames = traceback.extract_tb(e.__traceback__)
    if frames and not os.path.abspath(frames[-1].filename).startswith(_RUNNER_DIR + os.sep):
        f = frames[-1]
        out += f" (in {f.name}, {f.filename}:{f.lineno})"
    return out


async def rollout_batch(
    builders: Sequence[EnvGroupBuilder],
    sampling_client: SamplingClient,
    params: SamplingParams,
    *,
    seed: int = 0,
    step: int = 0,
    max_context: int | None = None,
    what: str | None = None,
    timeout_s: float | None = None,
) -> RolloutBatch:
    """All groups concurrently. Evals should pass a seed distinct from training's (their (step, group) repeat).
    max_context (renderer.context_window(tokenizer)): caps each turn's max_tokens at what fits, and drops a
    group whose prompt outgrows it (counted as rollout_errors/ContextOverflow). timeout_s: each group's time
    limit (dropped and counted as rollout_errors/EnvTimeout past it)."""
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(
                    guarded_group_rollout(
                        b, sampling_client, params, seed=seed, step=step, group_idx=i, max_context=max_context,
                        timeout_s=timeout_s,
                    )
                )
                for i, b in enumerate(builders)
            ]
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
    return collect([(i, t.result()) for i, t in enumerate(tasks)], what or f"step {step}")
