"""The `rl` algorithm's recipe table (`algo = {kind = "rl", ...}`), implemented by runner/algos/rl.py, and what it
shares with on-policy distillation (runner/algos/distill_config.py): OnPolicy, the loss, KL penalty and mode tables.

The loss variants are the built-in RL losses' (backends/losses/NAME_config.py) and a user's, `kind = "python"`."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, ClassVar, Union

from msgspec import Meta

from backends.losses import LossConfig, rl_variants
from backends.losses.importance_sampling_config import ImportanceSampling
from runner.recipe.common import AlgoBase, Base, NonNegInt, PosFloat, PosInt, Target
from runner.recipe.envs import Env
from runner.recipe.numerics_table import Numerics, check_temperature
from runner.rl.envs.tictactoe_config import TicTacToe

# ---------------------------------------------------------------- RL: losses (the registry: backends/losses/)


class PythonLoss(LossConfig, tag="python"):
    """Your own loss: `target = "pkg.mod:NAME"` names a backends.losses.LossSpec in your module (registered when the
    run starts; the local backend computes it, Tinker runs it as a custom loss); `args` are its loss_fn_config keys,
    checked against the spec by `runner check`."""

    target: Target
    args: dict[str, float] = {}


if TYPE_CHECKING:
    Loss = LossConfig
else:
    Loss = Union[(*rl_variants(), PythonLoss)]  # noqa: UP007 - built from the loss files at import


# ---------------------------------------------------------------- RL: KL penalty


class KLBase(Base, tag_field="kind", tag=str.lower):
    pass


class NoKL(KLBase, tag="none"):
    pass


class ReferenceKL(KLBase, tag="reference"):
    """adv_t += coef·(mean KL − KL_t) on action tokens, KL_t = lp_sampler − lp_reference; the reference is the
    initial weights (cookbook §1.3, centred on the batch mean)."""

    coef: PosFloat


KL = NoKL | ReferenceKL


# ---------------------------------------------------------------- RL: sampling / training overlap


class ModeBase(Base, tag_field="kind", tag=str.lower):
    pass


class Sync(ModeBase):
    """Each step samples its whole batch from the weights after the previous step, then trains: on-policy."""


class Stream(ModeBase):
    """As sync, but a minibatch's forward_backward is submitted as soon as its groups finish sampling, so
    training overlaps the slowest rollouts; one optim_step per substep."""

    minibatches: PosInt = 2


class Async(ModeBase):
    """Off-policy: step k samples from the newest weights already available (at least those after step
    k − max_staleness), so sampling for step k+1 runs while step k trains. Needs depth >= 1."""

    max_staleness: PosInt = 1
    # Step k always samples the weights after step k − max_staleness (the first steps of a session: the
    # weights it started from), never fresher ones that happen to be ready: which weights a step sees no
    # longer depends on timing, so a seeded run on the local backend's CPU repeats exactly.
    fixed_staleness: bool = False


Mode = Sync | Stream | Async


# ---------------------------------------------------------------- RL: the algorithm


class RLEval(Base):
    # Envs per test group (1 is enough for a mean reward; more gives pass@k-style spread).
    group_size: PosInt = 1
    # Cap on test groups per eval (None: the whole test split).
    max_groups: PosInt | None = None
    # The cookbook's test evaluator samples at 1.0.
    temperature: PosFloat = 1.0


class OnPolicy(AlgoBase):
    """What RL and on-policy distillation share: the policy samples groups (max_tokens, temperature), a built-in
    ratio loss trains on them in any mode, transcripts, evals and the numerics gate; and their checks."""

    ABSTRACT: ClassVar[bool] = True  # not a variant itself (variants(), runner/recipe/common.py)

    # ---- Core
    # Sampled tokens per turn.
    max_tokens: PosInt = 64
    temperature: PosFloat = 1.0
    loss: Loss = ImportanceSampling()
    # ---- Advanced
    mode: Mode = Sync()
    # optim_steps per batch (contiguous chunks of the batch; later chunks train slightly off-policy).
    num_substeps: PosInt = 1
    # Passes over the training split.
    epochs: PosInt = 1
    # Groups written to each iteration_NNNNNN/train.html (and test.html); 0 = no transcripts.
    groups_to_log: NonNegInt = 4
    # Steps between transcripts (iteration_NNNNNN/train.html + train_rollout_summaries.jsonl): steps 0, N, 2N, ...
    # and always the last step; evals (periodic and final) always write test.html. 0 = no transcripts at all.
    transcript_every: NonNegInt = 10
    # After each step, the new weights' logprobs of the batch: optim/kl_pre_post_v1/v2 (one more forward).
    compute_post_kl: bool = False
    eval: RLEval = RLEval()
    # The sampler-vs-trainer logprob gate (runner/recipe/numerics_table.py); None: the numerics/* metrics only.
    numerics: Numerics | None = None

    @property
    def batch_groups(self) -> int:
        """Groups per step (RL: groups_per_batch; distillation: the sum over its prompt sets)."""
        return getattr(self, "groups_per_batch")  # noqa: B009 - a field of RL, a property of Distill

    def __post_init__(self) -> None:
        for name, t in (("temperature", self.temperature), ("eval.temperature", self.eval.temperature)):
            if not math.isfinite(t):  # below TEMPERATURE_FLOOR (backends/types.py) the samplers are greedy
                raise ValueError(f"{name} must be finite, got {t}")
        check_temperature(self.numerics, self.temperature)
        if self.num_substeps > self.batch_groups:
            raise ValueError("num_substeps must be <= groups_per_batch")
        if isinstance(self.mode, Stream):
            per_substep, rem = divmod(self.batch_groups, self.num_substeps)
            if rem or per_substep % self.mode.minibatches:
                raise ValueError("stream mode: groups_per_batch must split evenly into num_substeps × minibatches")


class RL(OnPolicy, kw_only=True):
    """Group-relative policy gradient on environments (cookbook rl/train.py): per group, advantage = reward −
    group mean; datums carry sampler logprobs and per-token advantages; a built-in ratio loss."""


    # ---- Core (and OnPolicy's)
    env: Env
    # Episodes per group (the baseline is their mean reward; 1 would make every advantage 0).
    group_size: Annotated[int, Meta(ge=2)] = 4
    groups_per_batch: PosInt = 16
    # ---- Advanced (and OnPolicy's)
    kl: KL = NoKL()
    # Drop groups whose rewards are all equal (they carry no signal, only KL/entropy drift).
    remove_constant_reward_groups: bool = False
    # Divide advantages by the group's reward std (off, as in the cookbook: the std couples reward scale and step size).
    normalize_std: bool = False
    # Seconds a group's rollout (its envs' steps and their sampling) may take; past it the group is cancelled,
    # dropped and counted (rollout_errors/EnvTimeout). None: no limit.
    env_timeout_s: PosFloat | None = None

    def __post_init__(self) -> None:
        if isinstance(self.env, TicTacToe) and self.env.opponent == "self" and self.group_size % 2:
            raise ValueError("tictactoe self-play needs an even group_size (two seats per game)")
        super().__post_init__()
