"""Pieces every built-in environment shares: what its module declares (`EnvKind`), the build context, a
message-keeping env base, a group builder that repeats one problem, a fixed-list dataset, seeded train/test splits
(drawn problems: `split_problems`; a dataset's rows: `split`), and the train/test datasets of groups
(`group_datasets`)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from backends.base import SamplingClient
from backends.errors import UserError
from runner.recipe.common import EnvBase
from runner.renderers.chat import ChatRenderer, Message, ParsedReply, Prompt
from runner.rl.types import Env, EnvGroupBuilder, Observation, RLDataset, StopCondition

T = TypeVar("T", bound=Hashable)
P = TypeVar("P")
C = TypeVar("C", bound=EnvBase)


@dataclass(frozen=True)
class EnvKind(Generic[C]):
    """What an env's module declares (`ENV = EnvKind(build, headline)`): build(cfg, ctx) -> (train, test), and the
    (metric, label) pairs the progress line shows besides the reward: a number that moves where the mean reward
    cannot (pairwise judging: the group's win rate is 0.5 by construction; self-play: wins and losses cancel)."""

    build: Callable[[C, EnvContext], tuple[RLDataset, RLDataset | None]]  # C: the env's config struct
    headline: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class EnvContext:
    """What a dataset builder gets besides its own settings (also the contract for user `python` envs)."""

    renderer: ChatRenderer
    # Envs per group for training, and for the test split.
    group_size: int
    test_group_size: int
    # Groups per get_batch(i).
    groups_per_batch: int
    seed: int
    # A sampling client over another run's final weights, by the recipe's reference to it (a model judge's
    # init_from); set by the RL algorithm, which owns the backend. None outside a run.
    open_weights: Callable[[str], Awaitable[SamplingClient]] | None = None
    # A sampling client over a checkpoint path, else a base model (None: the recipe's): open_model(path, base_model);
    # set by the RL algorithm (a rubric judge). None outside a run.
    open_model: Callable[[str | None, str | None], Awaitable[SamplingClient]] | None = None


class ChatEnv(Env):
    """An env that keeps the conversation as messages and re-renders it for every turn; the new prompt
    reuses the sampled tokens of the last reply where the template allows (ChatRenderer.extend)."""

    def __init__(self, renderer: ChatRenderer, messages: list[Message]):
        self.renderer = renderer
        self.messages = list(messages)
        self._prompt: Prompt | None = None
        self._last_reply: tuple[list[int], ParsedReply] | None = None

    def observe(self) -> tuple[Observation, StopCondition]:
        if self._prompt is not None and self._last_reply is not None:
            self._prompt = self.renderer.extend(self._prompt, *self._last_reply, self.messages)
        else:
            self._prompt = self.renderer.render(self.messages)
        self._last_reply = None
        return list(self._prompt.tokens), self.renderer.stop

    def take_reply(self, action_tokens: list[int]) -> ParsedReply:
        """Parse the sampled reply and append it to the conversation."""
        reply = self.renderer.parse(action_tokens)
        self.messages.append({"role": "assistant", "content": reply.text})
        self._last_reply = (list(action_tokens), reply)
        return reply

    def say(self, content: str) -> None:
        self.messages.append({"role": "user", "content": content})


class RepeatGroupBuilder(EnvGroupBuilder):
    """group_size fresh envs on the same problem: the group-relative baseline compares attempts at one task."""

    def __init__(self, make_env: Callable[[], Env], group_size: int, tags: Sequence[str]):
        self.make_env = make_env
        self.group_size = group_size
        self.tags = list(tags)

    async def make_envs(self) -> Sequence[Env]:
        return [self.make_env() for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return self.tags


class ListDataset(RLDataset, Generic[P]):
    """Builders made from a fixed list of problems, groups_per_batch per batch.

    drop_last (training): a partial last batch is dropped, so every step has the same number of groups;
    the test split keeps it."""

    def __init__(
        self,
        items: Sequence[P],
        make_builder: Callable[[P], EnvGroupBuilder],
        groups_per_batch: int,
        drop_last: bool = True,
    ):
        self.items = list(items)
        self.make_builder = make_builder
        self.groups_per_batch = groups_per_batch
        n = len(self.items)
        self.n_batches = n // groups_per_batch if drop_last else -(-n // groups_per_batch)

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if not 0 <= index < self.n_batches:
            raise IndexError(f"batch {index} out of range (dataset has {self.n_batches})")
        chunk = self.items[index * self.groups_per_batch : (index + 1) * self.groups_per_batch]
        return [self.make_builder(item) for item in chunk]

    def __len__(self) -> int:
        return self.n_batches


def split_problems(
    seed: int, draw: Callable[[random.Random], T], n_train: int, n_test: int, space: int, what: str
) -> tuple[list[T], list[T]]:
    """n_test distinct test problems, then n_train training problems (with repeats) that are never test ones.

    One seeded generator draws both, so the split is a function of the seed alone. `space` is the number
    of distinct problems; the test split may take at most half of it so that rejection stays cheap."""
    if n_test * 2 > space:
        raise UserError(f"{what}: test_size {n_test} is more than half of the {space} distinct problems")
    rng = random.Random(seed)
    test: list[T] = []
    held: set[T] = set()
    while len(test) < n_test:
        item = draw(rng)
        if item not in held:
            held.add(item)
            test.append(item)
    train: list[T] = []
    while len(train) < n_train:
        item = draw(rng)
        if item not in held:
            train.append(item)
    return train, test


def check_train_size(n_train: int, groups_per_batch: int, what: str) -> None:
    if n_train < groups_per_batch:
        raise UserError(f"{what}: train_size {n_train} is smaller than groups_per_batch {groups_per_batch}")


def split(problems: list[P], test: list[P] | None, cfg: EnvBase, seed: int, what: str) -> tuple[list[P], list[P]]:
    """A dataset env's (train, test): `test` when given (capped at test_size), else test_size problems held out of a
    seeded shuffle; train capped at train_size."""
    order = list(problems)
    random.Random(seed).shuffle(order)
    if test is None:
        if cfg.test_size >= len(order):
            raise UserError(f"{what}: test_size {cfg.test_size} leaves no training problems of {len(order)}")
        test, order = order[: cfg.test_size], order[cfg.test_size :]
    else:
        test = test[: cfg.test_size]
    return order[: cfg.train_size], test


def group_datasets(train: Sequence[P], test: Sequence[P], ctx: EnvContext,
                   make: Callable[[P, int], EnvGroupBuilder], what: str, *,
                   make_test: Callable[[P, int], EnvGroupBuilder] | None = None,
                   test_group_size: int | None = None) -> tuple[RLDataset, RLDataset | None]:  # fmt: skip
    """Every env's (train, test) datasets: `make(problem, group_size)` is one group; training batches are
    groups_per_batch groups of ctx.group_size (a partial last batch dropped), the test split's groups of
    ctx.test_group_size (or `test_group_size`; `make_test` when it differs) all kept; no test split when `test` is
    empty."""
    if len(train) < ctx.groups_per_batch:
        raise UserError(f"{what}: {len(train)} training problems, fewer than groups_per_batch {ctx.groups_per_batch}")
    make_test = make_test or make
    size = ctx.test_group_size if test_group_size is None else test_group_size
    train_ds = ListDataset(train, lambda p: make(p, ctx.group_size), ctx.groups_per_batch)
    test_ds = ListDataset(test, lambda p: make_test(p, size), ctx.groups_per_batch, drop_last=False)
    return train_ds, (test_ds if test else None)
