"""`arithmetic`: "What is x + y?", one turn (the cookbook's math_rl arithmetic env, ProblemEnv reward)."""

from __future__ import annotations

import functools
import re

from runner.renderers.chat import ChatRenderer, Message
from runner.rl.envs.arithmetic_config import Arithmetic
from runner.rl.envs.common import (
    ChatEnv,
    EnvContext,
    EnvKind,
    RepeatGroupBuilder,
    check_train_size,
    group_datasets,
    split_problems,
)
from runner.rl.types import Observation, RLDataset, StepResult, StopCondition

FORMAT_COEF = 0.1
INTEGER = re.compile(r"[+-]?\d+")
FEW_SHOT: list[Message] = [
    {"role": "user", "content": "What is 4 + 5?"},
    {"role": "assistant", "content": "9"},
]


class ArithmeticEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, x: int, y: int, few_shot: bool = True):
        prefix = FEW_SHOT if few_shot else []
        super().__init__(renderer, [*prefix, {"role": "user", "content": f"What is {x} + {y}?"}])
        self.x, self.y = x, y

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        answer = reply.text.strip()
        is_int = INTEGER.fullmatch(answer) is not None
        format_ok = is_int and reply.ended_on_stop
        correct = is_int and int(answer) == self.x + self.y
        reward = float(correct) + FORMAT_COEF * (float(format_ok) - 1.0)
        return StepResult(
            reward=reward,
            episode_done=True,
            metrics={"format": float(format_ok), "correct": float(correct)},
            logs={"question": f"{self.x} + {self.y}", "expected": self.x + self.y, "reply": answer},
        )


def build(cfg: Arithmetic, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    check_train_size(cfg.train_size, ctx.groups_per_batch, "arithmetic")
    lo, hi = cfg.min_value, cfg.max_value
    span = hi - lo + 1
    train, test = split_problems(
        ctx.seed,
        lambda rng: (rng.randint(lo, hi), rng.randint(lo, hi)),
        cfg.train_size,
        cfg.test_size,
        span * span,
        "arithmetic",
    )

    def builder(item: object, group_size: int) -> RepeatGroupBuilder:
        x, y = item  # type: ignore[misc]
        env = functools.partial(ArithmeticEnv, ctx.renderer, x, y, cfg.few_shot)
        return RepeatGroupBuilder(env, group_size, ["arithmetic"])

    return group_datasets(train, test, ctx, builder, "arithmetic")


ENV = EnvKind(build, [("env/all/correct", "correct")])
