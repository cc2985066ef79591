"""`preference`: single-turn replies to a prompt, scored against each other by a judge.

Every pair in the group is judged round-robin in both orders (which cancels a judge's position bias), and
a reply's reward is its win fraction, plus format_coef·(ended_on_stop − 1). The judge is a plain function
judge(prompt, a, b) -> P(a is better) in [0, 1]; the default prefers the shorter reply (the cookbook's
`shorter` recipe, a pure-Python preference model that makes a good smoke test)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import replace

from backends.base import SamplingClient
from backends.errors import UserError
from backends.types import SamplingParams
from runner.recipe.targets import import_target
from runner.renderers.chat import ChatRenderer
from runner.rl.envs.common import ChatEnv, EnvContext, EnvKind, check_train_size, group_datasets
from runner.rl.envs.preference_config import ModelJudge, Preference
from runner.rl.types import (
    Env,
    EnvGroupBuilder,
    Metrics,
    Observation,
    RLDataset,
    StepResult,
    StopCondition,
    Trajectory,
)

Judge = Callable[[str, str, str], object]  # user code: what it returns is checked (round_robin)


def shorter_wins(prompt: str, a: str, b: str) -> float:
    return 1.0 if len(a) < len(b) else 0.0 if len(a) > len(b) else 0.5


def round_robin(prompt: str, replies: list[str], judge: Judge) -> list[float]:
    """Each reply's mean win probability against every other reply, judged as both a and b."""
    n = len(replies)
    if n < 2:
        return [0.5] * n
    wins = [0.0] * n
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            out = judge(prompt, replies[i], replies[j])
            p = None if isinstance(out, (str, bytes)) else _as_float(out)
            if p is None or not 0.0 <= p <= 1.0:
                raise UserError(f"preference judge returned {out!r}, expected a probability in [0, 1]")
            wins[i] += p
            wins[j] += 1.0 - p
    return [w / (2 * (n - 1)) for w in wins]


def _as_float(x: object) -> float | None:
    try:
        return float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


class PromptEnv(ChatEnv):
    """One reply to one prompt; the reward comes from the group."""

    def __init__(self, renderer: ChatRenderer, prompt: str):
        super().__init__(renderer, [{"role": "user", "content": prompt}])
        self.prompt = prompt
        self.reply: str | None = None
        self.ended_on_stop = False

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        parsed = self.take_reply(action_tokens)
        self.reply, self.ended_on_stop = parsed.text, parsed.ended_on_stop
        return StepResult(0.0, True, metrics={"reply_chars": float(len(parsed.text))})


class ModelJudgeFn:
    """A reward model's pairwise judgement (runner/rewards/judge.py), on a sampling client over its final weights,
    opened once through the run's backend."""

    def __init__(self, ctx: EnvContext, ref: str):
        self.ctx, self.ref = ctx, ref
        self.client: SamplingClient | None = None

    async def __call__(self, prompt: str, a: str, b: str) -> float:
        from runner.rewards.judge import judge_prob

        if self.client is None:
            if self.ctx.open_weights is None:
                raise UserError(f"preference judge {self.ref!r}: a model judge needs the run's backend")
            self.client = await self.ctx.open_weights(self.ref)
        return await judge_prob(self.client, self.ctx.renderer.tokenizer, prompt, a, b)


async def round_robin_model(prompt: str, replies: list[str], judge: ModelJudgeFn) -> list[float]:
    """As round_robin, for a judge that already averages both orders: each unordered pair once, concurrently."""
    n = len(replies)
    if n < 2:
        return [0.5] * n
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    probs = await asyncio.gather(*(judge(prompt, replies[i], replies[j]) for i, j in pairs))
    wins = [0.0] * n
    for (i, j), p in zip(pairs, probs, strict=True):
        wins[i] += p
        wins[j] += 1.0 - p
    return [w / (n - 1) for w in wins]


async def win_rate(prompts: Sequence[str], policy: SamplingClient, other: SamplingClient, judge: ModelJudgeFn,
                   renderer: ChatRenderer, params: SamplingParams, seed: int) -> float:
    """The mean P(policy's reply better than other's) over the prompts, one seeded sample each."""
    async def reply(client: SamplingClient, prompt: str, i: int) -> str:
        out = await client.sample(renderer.build_prompt([{"role": "user", "content": prompt}]), 1,
                                  replace(params, stop=renderer.stop, seed=seed + i))
        return renderer.parse(out.sequences[0].tokens).text

    mine = await asyncio.gather(*(reply(policy, p, i) for i, p in enumerate(prompts)))
    theirs = await asyncio.gather(*(reply(other, p, i) for i, p in enumerate(prompts)))
    probs = await asyncio.gather(*(judge(p, a, b) for p, a, b in zip(prompts, mine, theirs, strict=True)))
    return sum(probs) / len(probs) if probs else 0.5


class PreferenceGroupBuilder(EnvGroupBuilder):
    def __init__(self, renderer: ChatRenderer, prompt: str, group_size: int, judge: Judge | ModelJudgeFn,
                 format_coef: float):
        self.renderer, self.prompt, self.group_size = renderer, prompt, group_size
        self.judge, self.format_coef = judge, format_coef

    async def make_envs(self) -> Sequence[Env]:
        return [PromptEnv(self.renderer, self.prompt) for _ in range(self.group_size)]

    async def compute_group_rewards(
        self, trajectories_G: list[Trajectory], envs_G: Sequence[Env]
    ) -> list[tuple[float, Metrics]]:
        replies = [env.reply or "" for env in envs_G]  # type: ignore[attr-defined]
        if isinstance(self.judge, ModelJudgeFn):
            wins_G = await round_robin_model(self.prompt, replies, self.judge)
        else:
            wins_G = round_robin(self.prompt, replies, self.judge)
        out = []
        for env, win in zip(envs_G, wins_G, strict=True):
            fmt = float(env.ended_on_stop)  # type: ignore[attr-defined]
            out.append((win + self.format_coef * (fmt - 1.0), {"win_frac": win, "format": fmt}))
        return out

    def logging_tags(self) -> list[str]:
        return ["preference"]


def build(cfg: Preference, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    check_train_size(cfg.train_size, ctx.groups_per_batch, "preference")
    judge: Judge | ModelJudgeFn
    if isinstance(cfg.judge, ModelJudge):
        judge = ModelJudgeFn(ctx, cfg.judge.init_from)
    else:
        judge = shorter_wins if cfg.judge is None else import_target(cfg.judge)
    rng = random.Random(ctx.seed)
    train = [rng.choice(cfg.prompts) for _ in range(cfg.train_size)]

    def builder(prompt: object, group_size: int) -> EnvGroupBuilder:
        return PreferenceGroupBuilder(ctx.renderer, str(prompt), group_size, judge, cfg.format_coef)

    # A pairwise reward needs at least two replies, whatever the eval group size says.
    return group_datasets(train, cfg.test_prompts, ctx, builder, "preference",
                          test_group_size=max(2, ctx.test_group_size))


ENV = EnvKind(build, [("env/all/ac_tokens_per_turn", "reply_tokens"), ("env/all/format", "format")])
