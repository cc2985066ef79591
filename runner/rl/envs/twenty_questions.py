"""`twenty_questions`: find a hidden object by yes/no questions, answered by a scripted answerer.

The cookbook's version uses a second LLM as the answerer; here it is a fixed attribute table and keyword
matching, so the game is offline and its answers are exact. The policy is told the candidate objects and
the attributes it may ask about; a question must mention exactly one attribute ("Can it fly?"), anything
else gets a hint instead of an answer. "Guess: <name>" ends the game when right and costs a turn when wrong.
reward 1 for a correct guess within max_turns, else 0 (paid on the last step)."""

from __future__ import annotations

import functools
import re

from runner.renderers.chat import ChatRenderer
from runner.rl.envs.common import (
    ChatEnv,
    EnvContext,
    EnvKind,
    RepeatGroupBuilder,
    check_train_size,
    group_datasets,
    split_problems,
)
from runner.rl.envs.twenty_questions_config import TwentyQuestions
from runner.rl.types import Observation, RLDataset, StepResult, StopCondition

# attribute -> (how the intro names it, words that ask about it)
ATTRIBUTES: dict[str, tuple[str, tuple[str, ...]]] = {
    "alive": ("is it alive", ("alive", "living")),
    "animal": ("is it an animal", ("animal", "animals")),
    "fly": ("can it fly", ("fly", "flies", "flying", "wings")),
    "water": ("does it live in water", ("water", "swim", "swims", "sea", "ocean")),
    "legs": ("does it have legs", ("legs", "leg")),
    "big": ("is it bigger than a person", ("bigger", "big", "large", "larger")),
    "edible": ("can you eat it", ("eat", "edible", "food")),
    "machine": ("is it a machine", ("machine", "engine", "motor")),
    "wood": ("is it made of wood", ("wood", "wooden")),
    "pet": ("is it a pet", ("pet", "pets")),
}

# object -> its true attributes (every other attribute is false). Rows are unique, so the game is solvable.
OBJECTS: dict[str, frozenset[str]] = {
    name: frozenset(attrs.split())
    for name, attrs in {
        "dog": "alive animal legs pet",
        "horse": "alive animal legs big",
        "cow": "alive animal legs big edible",
        "chicken": "alive animal legs edible",
        "eagle": "alive animal fly legs",
        "parrot": "alive animal fly legs pet",
        "duck": "alive animal fly legs water",
        "frog": "alive animal legs water",
        "shark": "alive animal water big",
        "goldfish": "alive animal water pet",
        "salmon": "alive animal water edible",
        "apple": "alive edible",
        "oak tree": "alive big wood",
        "seaweed": "alive water edible",
        "cake": "edible",
        "car": "machine big",
        "airplane": "machine fly big",
        "drone": "machine fly",
        "robot": "machine legs",
        "submarine": "machine water big",
        "computer": "machine",
        "boat": "water big wood",
        "chair": "legs wood",
        "pencil": "wood",
    }.items()
}
GUESS = re.compile(r"\s*guess\s*:\s*(?:(?:a|an|the)\s+)?(.+?)[\s.!?]*", re.IGNORECASE)
_WORDS = re.compile(r"[a-z]+")


def answer(obj: str, question: str) -> str | None:
    """'Yes.' / 'No.' for a question about exactly one attribute of `obj`, else None."""
    words = set(_WORDS.findall(question.lower()))
    asked = [a for a, (_, keys) in ATTRIBUTES.items() if words & set(keys)]
    if len(asked) != 1:
        return None
    return "Yes." if asked[0] in OBJECTS[obj] else "No."


def intro(max_turns: int) -> str:
    names = ", ".join(OBJECTS)
    attrs = "; ".join(label for label, _ in ATTRIBUTES.values())
    return (
        f"Let's play twenty questions. I'm thinking of one of: {names}. "
        f"Ask yes/no questions about one of: {attrs}. "
        f'When you know, reply "Guess: <name>". You have {max_turns} turns.'
    )


class TwentyQuestionsEnv(ChatEnv):
    def __init__(self, renderer: ChatRenderer, obj: str, max_turns: int):
        super().__init__(renderer, [{"role": "user", "content": intro(max_turns)}])
        self.obj, self.max_turns = obj, max_turns
        self.turns = self.understood = 0

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return self.observe()

    async def step(self, action_tokens: list[int], stop_reason: str) -> StepResult:
        text = self.take_reply(action_tokens).text.strip()
        self.turns += 1
        guess = GUESS.fullmatch(text)
        if guess is not None:
            if guess.group(1).lower() == self.obj:
                return self._end(1.0, correct=True)
            reply = "No, that's not it."
        else:
            reply = answer(self.obj, text)
            if reply is None:
                reply = "Ask about one attribute, or guess."
            else:
                self.understood += 1
        if self.turns >= self.max_turns:
            return self._end(0.0, correct=False)
        self.say(reply)
        ob, stop = self.observe()
        return StepResult(0.0, False, ob, stop, logs={"answer": reply})

    def _end(self, reward: float, correct: bool) -> StepResult:
        metrics = {"correct": float(correct), "turns": float(self.turns), "answered": self.understood / self.turns}
        return StepResult(reward, True, metrics=metrics, logs={"object": self.obj})


def build(cfg: TwentyQuestions, ctx: EnvContext) -> tuple[RLDataset, RLDataset | None]:
    check_train_size(cfg.train_size, ctx.groups_per_batch, "twenty_questions")
    names = sorted(OBJECTS)
    train, test = split_problems(
        ctx.seed, lambda rng: rng.choice(names), cfg.train_size, cfg.test_size, len(names), "twenty_questions"
    )

    def builder(obj: object, group_size: int) -> RepeatGroupBuilder:
        assert isinstance(obj, str)
        env = functools.partial(TwentyQuestionsEnv, ctx.renderer, obj, cfg.max_turns)
        return RepeatGroupBuilder(env, group_size, ["twenty_questions"])

    return group_datasets(train, test, ctx, builder, "twenty_questions")


ENV = EnvKind(build)
