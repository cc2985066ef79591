"""`preference`: single-turn replies to a prompt, scored against each other by a judge.

Every pair in the group is judged round-robin in both orders (which cancels a judge's position bias), and
a reply's reward is its win fraction, plus format_coef·(ended_on_stop − 1). The judge is a plain function
judge(prompt, a, b) -> P(a is better) in [0, 1]; the default prefers the shorter reply (the cookbook's
`shorter` recipe, a pure-Python preference model that makes a good smoke test)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

from backends.errors import UserError
from runner.recipe import Preference
from runner.rl.envs.common import ChatEnv, EnvContext, ListDataset, check_train_size
from runner.rl.renderer import ChatRenderer
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
from runner.targets import import_target

Judge = Callable[[str, str, str], float]


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


class PreferenceGroupBuilder(EnvGroupBuilder):
    def __init__(self, renderer: ChatRenderer, prompt: str, group_size: int, judge: Judge, format_coef: float):
        self.renderer, self.prompt, self.group_size = renderer, prompt, group_size
        self.judge, self.format_coef = judge, format_coef

    async def make_envs(self) -> Sequence[Env]:
        return [PromptEnv(self.renderer, self.prompt) for _ in range(self.group_size)]

    async def compute_group_rewards(
        self, trajectories_G: list[Trajectory], envs_G: Sequence[Env]
    ) -> list[tuple[float, Metrics]]:
        replies = [env.reply or "" for env in envs_G]  # type: ignore[attr-defined]
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
    judge: Judge = shorter_wins if cfg.judge is None else import_target(cfg.judge)
    rng = random.Random(ctx.seed)
    train = [rng.choice(cfg.prompts) for _ in range(cfg.train_size)]

    def builder(group_size: int, prompt: object) -> EnvGroupBuilder:
        return PreferenceGroupBuilder(ctx.renderer, str(prompt), group_size, judge, cfg.format_coef)

    train_ds = ListDataset(train, functools.partial(builder, ctx.group_size), ctx.groups_per_batch)
    # A pairwise reward needs at least two replies, whatever the eval group size says.
    test_group = max(2, ctx.test_group_size)
    test_ds = ListDataset(
        cfg.test_prompts, functools.partial(builder, test_group), ctx.groups_per_batch, drop_last=False
    )
    return train_ds, (test_ds if cfg.test_prompts else None)
