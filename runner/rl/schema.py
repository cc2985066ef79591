"""Draft of the RL section of the recipe schema (the integrator moves it into runner/recipe.py).

Only msgspec is imported here, so `runner check` can decode a recipe without torch. Every choice is a
tagged union on `kind`; limits live in the types; cross-field checks in __post_init__ (a ValueError there
comes back from msgspec as a ValidationError with the key path).

    [recipes.arith.algo]
    kind = "rl"
    env = {kind = "arithmetic", max_value = 20}
    group_size = 8
    loss = {kind = "ppo", clip_low = 0.8, clip_high = 1.2}
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Target = Annotated[str, Meta(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]


class Base(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    pass


# ---------------------------------------------------------------- environments


class EnvBase(Base, tag_field="kind", tag=str.lower):
    # Problems in the training split (batches = train_size // groups_per_batch) and held out for evals.
    train_size: PosInt = 10_000
    test_size: NonNegInt = 64


class Arithmetic(EnvBase):
    """Single turn: "What is x + y?". reward = correct + 0.1·(format − 1), format = an integer reply that ended
    on the stop token (the cookbook's math_rl `arithmetic`)."""

    min_value: int = 0
    max_value: int = 99
    # Prepend one solved example ("What is 4 + 5?" → "9") so a small model sees the answer format.
    few_shot: bool = True

    def __post_init__(self) -> None:
        if self.max_value < self.min_value:
            raise ValueError("max_value must be >= min_value")


class GuessNumber(EnvBase, tag="guess_number"):
    """Multi-turn: guess a secret integer in [low, high]; the env answers "higher", "lower" or "correct".
    reward = 1 − (guesses − 1)/max_turns on success, 0 when out of turns, −1 for a reply that is not an integer."""

    low: int = 0
    high: int = 1023
    max_turns: PosInt = 10

    def __post_init__(self) -> None:
        if self.high < self.low:
            raise ValueError("high must be >= low")


class TwentyQuestions(EnvBase, tag="twenty_questions"):
    """Multi-turn: find an object from a fixed table by yes/no questions about its attributes, then
    "Guess: <name>". reward 1 for a correct guess within max_turns, else 0. Test objects are held out."""

    # The table needs about five well-chosen questions; 12 turns keep a byte-level conversation inside the
    # tiny model's 2048-token context at max_tokens 32 (longer prompts drop the group: ContextOverflow).
    max_turns: PosInt = 12
    train_size: PosInt = 2_000
    test_size: NonNegInt = 4


class TicTacToe(EnvBase, tag="tictactoe"):
    """Reply with a cell 1-9. "self": both seats are the policy (group_size/2 games per group); otherwise the
    policy plays a random seat against a fixed opponent. win 1, draw 0, loss −1; an illegal move loses."""

    opponent: Literal["self", "random", "optimal"] = "self"
    test_opponent: Literal["random", "optimal"] = "random"


class Preference(EnvBase):
    """Single turn; the group's replies are judged pairwise, round-robin, both orders; reward = win fraction
    + format_coef·(ended_on_stop − 1). The judge is fn(prompt, a, b) -> P(a better) in [0, 1]."""

    prompts: Annotated[list[str], Meta(min_length=1)] = msgspec.field(default_factory=lambda: ["Who are you?"])
    # Held-out prompts for evals (test_size is not used here).
    test_prompts: list[str] = []
    # None: the shorter reply wins (the cookbook's `shorter` recipe). Else "pkg.mod:fn".
    judge: Target | None = None
    format_coef: NonNegFloat = 0.1


class PythonEnv(EnvBase, tag="python", kw_only=True):
    """User code: target "pkg.mod:fn" is called as fn(**args) and returns a dataset builder, a callable
    builder(ctx: runner.rl.envs.EnvContext) -> (train: RLDataset, test: RLDataset | None).
    train_size / test_size are not used (the builder decides)."""

    target: Target
    args: dict[str, Any] = {}


Env = Arithmetic | GuessNumber | TwentyQuestions | TicTacToe | Preference | PythonEnv


# ---------------------------------------------------------------- losses (Tinker's built-ins; tinker-sdk.md §3)


class LossBase(Base, tag_field="kind", tag=str.lower):
    pass


class ImportanceSampling(LossBase, tag="importance_sampling"):
    """−Σ r·A, r = exp(lp − lp_sampler)."""


class PPO(LossBase):
    """−Σ min(r·A, clip(r, lo, hi)·A). The bounds are on the ratio itself, not epsilons."""

    clip_low: NonNegFloat = 0.8
    clip_high: PosFloat = 1.2

    def __post_init__(self) -> None:
        if self.clip_low >= self.clip_high:
            raise ValueError("clip_low must be < clip_high")


class CISPO(LossBase):
    """−Σ sg(clip(r, lo, hi))·lp·A. Default one-sided (Tinker's)."""

    clip_low: NonNegFloat = 0.0
    clip_high: PosFloat = 4.0

    def __post_init__(self) -> None:
        if self.clip_low >= self.clip_high:
            raise ValueError("clip_low must be < clip_high")


class DRO(LossBase):
    """−Σ (lp·A − ½·β·(lp − lp_sampler)²)."""

    beta: PosFloat = 0.05


Loss = ImportanceSampling | PPO | CISPO | DRO


# ---------------------------------------------------------------- KL penalty


class KLBase(Base, tag_field="kind", tag=str.lower):
    pass


class NoKL(KLBase, tag="none"):
    pass


class ReferenceKL(KLBase, tag="reference"):
    """adv_t += coef·(mean KL − KL_t) on action tokens, KL_t = lp_sampler − lp_reference; the reference is the
    initial weights (cookbook §1.3, centred on the batch mean)."""

    coef: PosFloat


KL = NoKL | ReferenceKL


# ---------------------------------------------------------------- sampling / training overlap


class ModeBase(Base, tag_field="kind", tag=str.lower):
    pass


class Sync(ModeBase):
    """Sample the whole batch, then train on it: fully on-policy."""


class Stream(ModeBase):
    """Train a minibatch (forward_backward) as soon as its groups finish; one optim_step per substep."""

    minibatches: PosInt = 2


class Async(ModeBase):
    """Sample ahead with older weights; a group sampled more than max_staleness steps ago is not used."""

    max_staleness: PosInt = 1


Mode = Sync | Stream | Async


# ---------------------------------------------------------------- the algorithm


class AlgoBase(Base, tag_field="kind", tag=str.lower):
    pass


class RLEval(Base):
    # Envs per test group (1 is enough for a mean reward; more gives pass@k-style spread).
    group_size: PosInt = 1
    # Cap on test groups per eval (None: the whole test split).
    max_groups: PosInt | None = None
    # The cookbook's test evaluator samples at 1.0.
    temperature: PosFloat = 1.0


class RL(AlgoBase):
    """Group-relative policy gradient on environments (cookbook rl/train.py): per group, advantage = reward −
    group mean; datums carry sampler logprobs and per-token advantages; a built-in ratio loss."""

    env: Env
    # ---- Core
    # Episodes per group (the baseline is their mean reward; 1 would make every advantage 0).
    group_size: Annotated[int, Meta(ge=2)] = 4
    groups_per_batch: PosInt = 16
    # Sampled tokens per turn.
    max_tokens: PosInt = 64
    temperature: PosFloat = 1.0
    loss: Loss = ImportanceSampling()
    # ---- Advanced
    kl: KL = NoKL()
    mode: Mode = Sync()
    # optim_steps per batch (contiguous chunks of the batch; later chunks train slightly off-policy).
    num_substeps: PosInt = 1
    # Drop groups whose rewards are all equal (they carry no signal, only KL/entropy drift).
    remove_constant_reward_groups: bool = False
    # Divide advantages by the group's reward std (off, as in the cookbook: the std couples reward scale and step size).
    normalize_std: bool = False
    # Passes over the training split.
    epochs: PosInt = 1
    # Groups written to iteration_NNNNNN/train.html per step; 0 = none.
    groups_to_log: NonNegInt = 4
    eval: RLEval = RLEval()

    def __post_init__(self) -> None:
        if isinstance(self.env, TicTacToe) and self.env.opponent == "self" and self.group_size % 2:
            raise ValueError("tictactoe self-play needs an even group_size (two seats per game)")
        if self.num_substeps > self.groups_per_batch:
            raise ValueError("num_substeps must be <= groups_per_batch")
        if isinstance(self.mode, Stream):
            per_substep, rem = divmod(self.groups_per_batch, self.num_substeps)
            if rem or per_substep % self.mode.minibatches:
                raise ValueError("stream mode: groups_per_batch must split evenly into num_substeps × minibatches")
