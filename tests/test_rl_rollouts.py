"""Rollouts (seeds, logprobs, error handling), trajectory metrics and advantages.
Run: pytest tests/test_rl_rollouts.py"""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

from backends.errors import UserError
from backends.local.tiny import build_tokenizer
from backends.types import SampledSequence, SamplingParams
from runner.renderers.chat import ChatRenderer
from runner.rl.advantages import compute_advantages, remove_constant_reward_groups
from runner.rl.envs.arithmetic import ArithmeticEnv
from runner.rl.envs.common import RepeatGroupBuilder
from runner.rl.envs.guess_number import GuessNumberEnv
from runner.rl.metrics import trajectory_metrics
from runner.rl.rollouts import do_group_rollout, rollout_batch, run_episode, sample_seed
from runner.rl.testing import ScriptedSampler, fake_logprob
from runner.rl.types import Env, StepResult, Trajectory, TrajectoryGroup, Transition

TOK = build_tokenizer()
R = ChatRenderer(TOK)
PARAMS = SamplingParams(max_tokens=16, temperature=0.7)


def arith_builder(x: int, y: int, group_size: int = 3, tags=("arithmetic",)) -> RepeatGroupBuilder:
    return RepeatGroupBuilder(functools.partial(ArithmeticEnv, R, x, y), group_size, list(tags))


def test_sample_seed_is_deterministic_and_distinct():
    coords = [(s, st, g, m, t) for s in (0, 1) for st in (0, 1) for g in (0, 1) for m in (0, 1) for t in (0, 1)]
    seeds = [sample_seed(*c) for c in coords]
    assert len(set(seeds)) == len(seeds)
    assert seeds == [sample_seed(*c) for c in coords]
    assert all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(-1, 0, 0, 0, 0) != sample_seed(2**32 - 1, 0, 0, 0, 0)


def test_group_rollout_records_seeds_params_and_logprobs():
    sampler = ScriptedSampler(TOK, lambda p, s: "12")
    group = asyncio.run(do_group_rollout(arith_builder(5, 7), sampler, PARAMS, seed=3, step=4, group_idx=2))
    assert group.total_rewards_G() == [1.0, 1.0, 1.0] and group.tags == ["arithmetic"]
    # The three members open with the same prompt: one request for the three, seeded as member 0 (member m's
    # seed is member 0's + m, and sample k of a request is sampled as a one-sample request seeded seed + k).
    assert [p.seed for _, p in sampler.calls] == [sample_seed(3, 4, 2, 0, 0)] and sampler.num_samples == [3]
    assert [sample_seed(3, 4, 2, m, 0) for m in range(3)] == [sample_seed(3, 4, 2, 0, 0) + m for m in range(3)]
    _, params = sampler.calls[0]
    assert (params.max_tokens, params.temperature, params.stop) == (16, 0.7, R.stop_tokens)
    ac = group.trajectories_G[0].transitions[0].ac
    assert ac.logprobs == [fake_logprob(t, i) for i, t in enumerate(ac.tokens)]
    assert ac.tokens[-1] == R.stop_tokens[0] and ac.stop_reason == "stop"


def test_multiturn_seeds_vary_by_turn():
    builder = RepeatGroupBuilder(functools.partial(GuessNumberEnv, R, 3, 0, 9, 4), 2, ["guess_number"])
    sampler = ScriptedSampler(TOK, lambda p, s: "0")
    asyncio.run(do_group_rollout(builder, sampler, PARAMS, seed=0, step=1, group_idx=0))
    # The first turn of both members is one request (num_samples=2); the later turns one each.
    assert sampler.num_samples == [2] + [1] * 6
    want = {sample_seed(0, 1, 0, m, t) for m in range(2) for t in range(4)} - {sample_seed(0, 1, 0, 1, 0)}
    assert {p.seed for _, p in sampler.calls} == want


class Boom(Env):
    async def initial_observation(self):
        return R.build_prompt([{"role": "user", "content": "x"}]), R.stop_tokens

    async def step(self, action_tokens, stop_reason):
        raise KeyError("env bug")


class BadObservation(Boom):
    async def initial_observation(self):
        return [], None


def test_rollout_batch_counts_errors_and_drops_group():
    builders = [arith_builder(1, 1), RepeatGroupBuilder(Boom, 2, []), arith_builder(2, 2)]
    batch = asyncio.run(rollout_batch(builders, ScriptedSampler(TOK, lambda p, s: "2"), PARAMS))
    assert batch.group_indices == [0, 2]
    assert [g.total_rewards_G() for g in batch.groups] == [[1.0] * 3, [0.0] * 3]
    assert batch.error_metrics() == {
        "rollout_errors/KeyError": 1.0,
        "rollout_errors/total": 1.0,
        "rollout_errors/groups_skipped": 1.0,
    }


def test_rollout_batch_raises_when_every_group_fails_and_on_user_error():
    sampler = ScriptedSampler(TOK, lambda p, s: "2")
    # One line naming the error and where the env raised it (the CLI prints it, exit 2), not the raw KeyError.
    with pytest.raises(UserError, match=r"all 2 groups of step 3 failed; the first error: KeyError: 'env bug' "
                                        r"\(in step, .*test_rl_rollouts.py:\d+\)"):
        asyncio.run(rollout_batch([RepeatGroupBuilder(Boom, 2, [])] * 2, sampler, PARAMS, step=3))
    with pytest.raises(UserError, match="BadObservation"):
        asyncio.run(rollout_batch([arith_builder(1, 1), RepeatGroupBuilder(BadObservation, 1, [])], sampler, PARAMS))


class Returns(Env):
    """An env whose step returns `result` (or whose initial_observation returns `first`)."""

    def __init__(self, result=None, first=None):
        self.result, self.first = result, first

    async def initial_observation(self):
        if self.first is not None:
            return self.first
        return R.build_prompt([{"role": "user", "content": "x"}]), R.stop_tokens

    async def step(self, action_tokens, stop_reason):
        return self.result


@pytest.mark.parametrize(
    "env, message",
    [
        (Returns(StepResult(float("nan"), True)), r"Returns.step returned reward float nan, expected a finite number"),
        (Returns(StepResult(float("inf"), True)), "reward float inf, expected a finite number"),
        (Returns(StepResult("1.0", True)), "reward str '1.0', expected a finite number"),
        (Returns(StepResult(None, True)), "reward None, expected a finite number"),
        (Returns((1.0, True)), r"Returns.step returned tuple \(1.0, True\), expected a runner.rl.types.StepResult"),
        (Returns(None), "Returns.step returned None, expected a runner.rl.types.StepResult"),
        (Returns(StepResult(1.0, "yes")), "episode_done str 'yes', expected True or False"),
        (Returns(StepResult(1.0, True, metrics={"x": "hi"})), "metric 'x' = str 'hi', expected a number"),
        (Returns(StepResult(1.0, True, metrics=[1.0])), "metrics list"),
        (Returns(StepResult(0.0, False, [], None)), r"Returns.step \(turn 0\) next_observation is list \[\]"),
        (Returns(first=[1, 2, 3]), "Returns.initial_observation returned list \\[1, 2, 3\\], expected \\(obs"),
        (Returns(first=("abc", None)), "Returns.initial_observation is str 'abc', expected a non-empty list"),
        (Returns(first=([1, 2], "\n")), r"Returns.initial_observation stop condition is str '\\n', expected None or a "),
        (Returns(first=([1, 2], ["a", 3])), r"stop condition is list \['a', 3\], expected None or a list of strings"),
        (Returns(StepResult(0.0, False, [1, 2], "stop")), r"Returns.step \(turn 0\) next_stop stop condition is str"),
    ],
)
def test_env_contract_violations_are_user_errors(env, message):
    """A user env that breaks the StepResult contract stops the run with one line naming the env and the field
    (before: NaN rewards trained NaN weights, a str reward or a tuple result crashed with a traceback)."""
    sampler = ScriptedSampler(TOK, lambda p, s: "2")
    with pytest.raises(UserError, match=message):
        asyncio.run(rollout_batch([RepeatGroupBuilder(lambda: env, 2, [])], sampler, PARAMS))


class GroupRewards(RepeatGroupBuilder):
    def __init__(self, rewards):
        super().__init__(functools.partial(ArithmeticEnv, R, 1, 1), 2, [])
        self.rewards = rewards

    async def compute_group_rewards(self, trajectories_G, envs_G):
        return self.rewards


@pytest.mark.parametrize(
    "rewards, message",
    [
        ([1.0, 0.0], r"GroupRewards.compute_group_rewards returned float 1.0 for a trajectory, expected a \(finite"),
        ([(1.0, {})], r"returned 1 rewards for 2 trajectories, expected a list of \(reward, metrics\) pairs"),
        (None, r"returned None for 2 trajectories"),
        ([(float("nan"), {}), (0.0, {})], r"returned tuple \(nan, \{\}\) for a trajectory"),
        ([(1.0, {"m": "x"}), (0.0, {})], r"compute_group_rewards returned metric 'm' = str 'x'"),
    ],
)
def test_group_rewards_contract(rewards, message):
    sampler = ScriptedSampler(TOK, lambda p, s: "2")
    with pytest.raises(UserError, match=message):
        asyncio.run(rollout_batch([GroupRewards(rewards)], sampler, PARAMS))
    ok = asyncio.run(rollout_batch([GroupRewards([(0.5, {"m": 1}), (np.float64(1), {})])], sampler, PARAMS))
    assert ok.groups[0].final_rewards_G == [0.5, 1.0] and ok.groups[0].metrics_G == [{"m": 1.0}, {}]


class SyncInitial(Returns):
    def initial_observation(self):
        return R.build_prompt([{"role": "user", "content": "x"}]), R.stop_tokens


class SyncStep(Returns):
    def step(self, action_tokens, stop_reason):
        return StepResult(1.0, True)


class SyncMakeEnvs(RepeatGroupBuilder):
    def make_envs(self):
        return [self.make_env() for _ in range(self.group_size)]


@pytest.mark.parametrize(
    "builder, message",
    [
        (RepeatGroupBuilder(SyncInitial, 2, []), "SyncInitial.initial_observation returned a tuple, not a coroutine"),
        (RepeatGroupBuilder(SyncStep, 2, []), "SyncStep.step returned a StepResult, not a coroutine"),
        (SyncMakeEnvs(SyncStep, 2, []), "SyncMakeEnvs.make_envs returned a list, not a coroutine"),
    ],
)
def test_env_methods_that_are_not_async(builder, message):
    """A plain `def` where the contract says `async def`: one line saying so (before: every group failed with
    "TypeError: object tuple can't be used in 'await' expression")."""
    sampler = ScriptedSampler(TOK, lambda p, s: "2")
    with pytest.raises(UserError, match=message + ": define it with `async def`"):
        asyncio.run(rollout_batch([builder], sampler, PARAMS))


def test_env_numbers_and_logs_are_coerced():
    """Rewards and metrics may be any real number (bool, numpy); logs that are not plain values become reprs,
    so rollout summaries stay JSON."""
    result = StepResult(np.float32(0.5), np.bool_(True), metrics={"ok": True, "n": np.int64(3)}, logs={"s": {1, 2}})
    sampler = ScriptedSampler(TOK, lambda p, s: "2")
    batch = asyncio.run(rollout_batch([RepeatGroupBuilder(lambda: Returns(result), 2, [])], sampler, PARAMS))
    tr = batch.groups[0].trajectories_G[0].transitions[0]
    assert (tr.reward, tr.episode_done, tr.metrics, tr.logs) == (0.5, True, {"ok": 1.0, "n": 3.0}, {"s": "{1, 2}"})
    assert type(tr.reward) is float and type(tr.episode_done) is bool


def test_rollout_is_reproducible():
    def policy(prompt, params):  # the reply depends only on the seed, like a seeded sampler
        return str(params.seed % 3)

    async def run():
        return await rollout_batch(
            [arith_builder(0, 1), arith_builder(1, 1)], ScriptedSampler(TOK, policy), PARAMS, seed=9
        )

    a, b = asyncio.run(run()), asyncio.run(run())
    assert [g.total_rewards_G() for g in a.groups] == [g.total_rewards_G() for g in b.groups]


# ---------------------------------------------------------------- metrics


def traj(turns: list[tuple[int, int, float, dict]], stop_reason="stop") -> Trajectory:
    """turns: (ob_len, ac_len, reward, metrics)."""
    out = []
    for i, (ob_len, ac_len, reward, metrics) in enumerate(turns):
        ac = SampledSequence(list(range(ac_len)), [-0.5] * ac_len, stop_reason)
        out.append(Transition(list(range(ob_len)), ac, reward, i == len(turns) - 1, metrics))
    return Trajectory(out)


def group(trajs, final=None, metrics=None, tags=()) -> TrajectoryGroup:
    n = len(trajs)
    return TrajectoryGroup(trajs, final or [0.0] * n, metrics or [{} for _ in range(n)], list(tags))


def test_trajectory_metrics_names_and_values():
    g1 = group(
        [traj([(10, 2, 0.0, {}), (14, 4, 1.0, {"correct": 1.0})]), traj([(10, 6, 0.0, {"correct": 0.0})], "length")],
        tags=["a"],
    )
    g2 = group(
        [traj([(5, 1, 1.0, {"format": 1.0})]), traj([(5, 1, 1.0, {"format": 0.0})])],
        final=[0.5, 0.5],
        metrics=[{"win": 1.0}, {}],
        tags=["b"],
    )
    m = trajectory_metrics([g1, g2])
    assert m["env/all/total_episodes"] == 4
    assert m["env/all/total_turns"] == 5
    assert m["env/all/total_ac_tokens"] == 14 and m["env/all/total_ob_tokens"] == 44
    assert m["env/all/ac_tokens_per_turn"] == pytest.approx(14 / 5)
    assert m["env/all/ob_tokens_per_turn"] == pytest.approx(44 / 5)
    assert m["env/all/turns_per_episode"] == pytest.approx(5 / 4)
    assert m["env/all/turns_truncated_frac"] == pytest.approx(1 / 5)
    assert m["env/all/reward/total"] == pytest.approx((1.0 + 0.0 + 1.5 + 1.5) / 4)
    # env metrics: averaged over the entries that report them
    assert m["env/all/correct"] == 0.5 and m["env/all/format"] == 0.5 and m["env/all/win"] == 1.0
    # g1 mixed (1 vs 0), g2 all good (1.5, 1.5)
    assert (
        m["env/all/by_group/frac_mixed"],
        m["env/all/by_group/frac_all_good"],
        m["env/all/by_group/frac_all_bad"],
    ) == (0.5, 0.5, 0.0)
    # per-tag metrics, since each tag covers a strict subset
    assert m["env/a/total_episodes"] == 2 and m["env/b/reward/total"] == 1.5
    assert "env/a/win" not in m


def test_tag_covering_every_group_is_not_repeated():
    g = group([traj([(3, 1, 0.0, {})])], tags=["only"])
    assert not any(k.startswith("env/only/") for k in trajectory_metrics([g, g]))


# ---------------------------------------------------------------- advantages


def rewards_group(rewards) -> TrajectoryGroup:
    return group([traj([(2, 1, r, {})]) for r in rewards])


def test_advantages_center_and_normalize():
    (adv,) = compute_advantages([rewards_group([1.0, 0.0, 0.0, 1.0])])
    np.testing.assert_allclose(adv, [0.5, -0.5, -0.5, 0.5])
    assert adv.dtype == np.float32
    (adv,) = compute_advantages([rewards_group([1.0, 0.0, 0.0, 1.0])], normalize_std=True)
    np.testing.assert_allclose(adv, [1.0, -1.0, -1.0, 1.0], rtol=1e-5)
    (adv,) = compute_advantages([rewards_group([2.0, 2.0])], normalize_std=True)
    np.testing.assert_array_equal(adv, [0.0, 0.0])
    # the group reward is part of the return
    g = group([traj([(2, 1, 1.0, {})]), traj([(2, 1, 0.0, {})])], final=[0.0, 3.0])
    np.testing.assert_allclose(compute_advantages([g])[0], [-1.0, 1.0])


def test_remove_constant_reward_groups():
    flat, mixed, flat2 = rewards_group([1.0, 1.0]), rewards_group([0.0, 1.0]), rewards_group([0.0, 0.0])
    assert remove_constant_reward_groups([flat, mixed, flat2]) == [mixed]
    assert remove_constant_reward_groups([flat, flat2]) == [flat]  # keeps one so the step has data
    assert remove_constant_reward_groups([]) == []


class Counting:
    """A SamplingClient wrapper that records num_samples of every request."""

    def __init__(self, inner):
        self.inner, self.num_samples = inner, []

    def sample(self, prompt, num_samples, params):
        self.num_samples.append(num_samples)
        return self.inner.sample(prompt, num_samples, params)

    def compute_logprobs(self, tokens):
        return self.inner.compute_logprobs(tokens)


class Problem(Env):
    """An env whose prompt names its problem, so members on different problems differ."""

    def __init__(self, problem: str):
        self.problem = problem

    async def initial_observation(self):
        return R.build_prompt([{"role": "user", "content": self.problem}]), R.stop_tokens

    async def step(self, action_tokens, stop_reason):
        return StepResult(float(len(action_tokens)), True)


class Problems(RepeatGroupBuilder):
    def __init__(self, problems):
        super().__init__(lambda: None, len(problems), [])
        self.problems = problems

    async def make_envs(self):
        return [Problem(p) for p in self.problems]


def _local_sampler(tmp_path):
    from backends.local.backend import LocalBackend
    from backends.local.local_config import Local

    be = LocalBackend(Local(), "tiny", None, tmp_path, seed=0)
    return be, be.create_sampling_client(base_model="tiny").result()


def _fake_sampler(tmp_path):
    from backends.fake import FakeBackend

    be = FakeBackend(TOK)
    return be, be.create_sampling_client().result()


@pytest.mark.parametrize("make", [_local_sampler, _fake_sampler], ids=["local", "fake"])
@pytest.mark.parametrize("problems, requests", [(["5+7"] * 4, [4]), (["1+1", "1+1", "2+2", "1+1"], [2, 1, 1])])
def test_grouped_first_turn_samples_what_each_member_would_alone(tmp_path, make, problems, requests):
    """A group's members that open with the same prompt share one request (runs of consecutive members), and
    get the very tokens and logprobs each would have sampled alone with its own seed: grouping only cuts the
    request count (over HTTP), it never changes a run's samples."""
    be, sc = make(tmp_path)
    try:
        params = SamplingParams(max_tokens=6, temperature=2.0)
        counting = Counting(sc)
        group = asyncio.run(do_group_rollout(Problems(problems), counting, params, seed=1, step=2, group_idx=3))
        assert counting.num_samples == requests
        alone = [asyncio.run(run_episode(Problem(p), sc, params, seed=1, step=2, group=3, member=m))
                 for m, p in enumerate(problems)]
        got = [(t.transitions[0].ac.tokens, t.transitions[0].ac.logprobs) for t in group.trajectories_G]
        assert got == [(t.transitions[0].ac.tokens, t.transitions[0].ac.logprobs) for t in alone]
        assert len({tuple(tokens) for tokens, _ in got}) > 1  # the members' samples differ
    finally:
        be.close()


class Waits(Problem):
    """Member 1 opens only after member 0's first step (as a self-play seat waits for the other's move)."""

    def __init__(self, problem, gate: asyncio.Event, first: bool):
        super().__init__(problem)
        self.gate, self.first = gate, first

    async def initial_observation(self):
        if not self.first:
            await self.gate.wait()
        return await super().initial_observation()

    async def step(self, action_tokens, stop_reason):
        self.gate.set()
        return await super().step(action_tokens, stop_reason)


def test_grouped_first_turn_does_not_wait_forever_for_a_member_that_waits_on_another():
    class Gated(RepeatGroupBuilder):
        async def make_envs(self):
            gate = asyncio.Event()
            return [Waits("x", gate, True), Waits("x", gate, False), Waits("x", gate, False)]

    sampler = ScriptedSampler(TOK, lambda p, s: "22")
    group = asyncio.run(asyncio.wait_for(do_group_rollout(Gated(lambda: None, 3, []), sampler, PARAMS), 60))  # ms when it works
    assert group.total_rewards_G() == [3.0, 3.0, 3.0]
    assert sampler.num_samples == [1, 1, 1]  # member 0 was sent alone after the wait; the late ones alone


class Ends(Env):
    async def initial_observation(self):
        return None

    async def step(self, action_tokens, stop_reason):
        raise AssertionError("never stepped")


def test_grouped_first_turn_does_not_wait_for_a_member_that_ends_at_once():
    class Mixed(RepeatGroupBuilder):
        async def make_envs(self):
            return [Problem("x"), Ends(), Problem("x")]

    sampler = ScriptedSampler(TOK, lambda p, s: "2")
    group = asyncio.run(do_group_rollout(Mixed(lambda: None, 3, []), sampler, PARAMS))
    assert [len(t.transitions) for t in group.trajectories_G] == [1, 0, 1]
    assert sampler.num_samples == [1, 1]  # members 0 and 2 are not consecutive: two requests, no wait


def test_member_seeds_are_consecutive_and_a_wrap_splits_the_request():
    """Member 0's seed is the plain hash of (seed, step, group, turn); member m's is it + m (mod 2**31). Members
    whose seeds wrap past 2**31 are not consecutive: their group goes out as two requests."""
    from runner.rl.rollouts import _FirstTurn

    assert [sample_seed(5, 6, 7, m, 1) for m in range(3)] == [(sample_seed(5, 6, 7, 0, 1) + m) % 2**31 for m in range(3)]
    sampler = ScriptedSampler(TOK, lambda p, s: "2")
    first = _FirstTurn(sampler, 3)
    ob = R.build_prompt([{"role": "user", "content": "x"}])

    async def go():
        return await asyncio.gather(*(first.sample(m, ob, SamplingParams(max_tokens=4, seed=seed))
                                      for m, seed in enumerate([2**31 - 2, 2**31 - 1, 0])))

    outs = asyncio.run(go())
    assert [len(o.sequences) for o in outs] == [1, 1, 1]
    assert sampler.num_samples == [2, 1] and [p.seed for _, p in sampler.calls] == [2**31 - 2, 0]
