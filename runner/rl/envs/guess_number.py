"""`guess_number`: the env holds a secret integer; each turn the policy guesses and hears "higher", "lower" or
"correct" (the cookbook's multiplayer_rl/guess_number, with the policy's turns stored as "assistant").

reward = 1 − (guesses − 1)/max_turns when found (1 at the first guess), 0 when out of turns, −1 (and the
episode ends) for a reply that is not an integer. All of it is paid on the last step."""

from __future__ import annotations

import functools

from runner.renderers.chat import ChatRenderer
from runner.rl.envs.arithmetic import INTEGER
from runner.rl.envs.common import (
    ChatEnv,
    EnvContext,
    EnvKind,
    RepeatGroupBuilder,
    check_train_size,
    group_datasets,
    split_problems,
)
from runner.rl.envs.guess_number_config import GuessNumber
from runner.rl.types import Observation, RLDataset, StepResult, StopCondition


class GuessNumberEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, secret: int, low: int, high: int, max_turns: int):
        intro = (
            f"I'm thinking of an integer from {low} to {high}. You have {max_turns} guesses. "
            "Reply with just a number; I'll answer higher, lower or correct."
        )
        super().__init__(renderer, [{"role": "user", "content": intro}])
        self.secret, self.max_turns = secret, max_turns
        self.guesses = 0

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        reply = self.take_reply(action_tokens)
        self.guesses += 1
        text = reply.text.strip()
        if INTEGER.fullmatch(text) is None:
            return self._end(-1.0, found=False, format_ok=False, feedback="not a number")
        guess = int(text)
        if guess == self.secret:
            reward = 1.0 - (self.guesses - 1) / self.max_turns
            return self._end(reward, found=True, format_ok=True, feedback="correct")
        feedback = "higher" if self.secret > guess else "lower"
        if self.guesses >= self.max_turns:
            return self._end(0.0, found=False, format_ok=True, feedback=feedback)
        self.say(feedback)
        ob, stop = self.observe()
        return StepResult(0.0, False, ob, stop, logs={"guess": guess, "feedback": feedback})

    def _end(self, reward: float, found: bool, format_ok: bool, feedback: str) -> StepResult:
        metrics = {"correct": float(found), "format": float(format_ok), "guesses": float(self.guesses)}
        return StepResult(reward, True, metrics=metrics, logs={"secret": self.secret, "feedback": feedback})


def build(cfg: GuessNumber, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    check_train_size(cfg.train_size, ctx.groups_per_batch, "guess_number")
    train, test = split_problems(
        ctx.seed,
        lambda rng: rng.randint(cfg.low, cfg.high),
        cfg.train_size,
        cfg.test_size,
        cfg.high - cfg.low + 1,
        "guess_number",
    )

    def builder(secret: object, group_size: int) -> RepeatGroupBuilder:
        assert isinstance(secret, int)
        env = functools.partial(GuessNumberEnv, ctx.renderer, secret, cfg.low, cfg.high, cfg.max_turns)
        return RepeatGroupBuilder(env, group_size, ["guess_number"])

    return group_datasets(train, test, ctx, builder, "guess_number")


ENV = EnvKind(build)
