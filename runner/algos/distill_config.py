"""The `distill` algorithm's recipe table (on-policy distillation, `algo = {kind = "distill", ...}`), implemented by
runner/algos/distill.py; and Teacher, which `generate` shares."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from runner.algos.rl_config import OnPolicy
from runner.recipe.common import Base, DataSource, NonNegInt, PosFloat, PosInt, RecipeRef

# ---------------------------------------------------------------- on-policy distillation


class Teacher(Base):
    """Whose logprobs the student learns from: a chained run's final weights (init_from), a saved sampler checkpoint
    (a local adapter folder or a tinker:// path), or else the base model `model` (default: the recipe's model)."""

    init_from: RecipeRef | None = None
    checkpoint: str | None = None
    # The teacher's base model. It must share the student's tokenizer (checked by `runner check`).
    model: str | None = None

    def __post_init__(self) -> None:
        if self.init_from is not None and self.checkpoint is not None:
            raise ValueError("give init_from or checkpoint, not both")


class DistillSet(Base):
    """A prompt set and its teacher (several sets = the cookbook's multi-teacher distillation)."""

    # Rows {"messages": [...]}: the conversation the student continues (its last message is the user's).
    prompts: DataSource
    teacher: Teacher = Teacher()
    # Groups of this set per step.
    groups_per_batch: PosInt = 8
    # Prompts held out for evals (test/teacher_kl).
    test_size: NonNegInt = 0


class Distill(OnPolicy, kw_only=True):
    """On-policy distillation (cookbook distillation/train_on_policy.py): the student samples, each teacher scores the
    student's own tokens (compute_logprobs), and the per-token reverse KL student_lp − teacher_lp is a penalty on the
    advantages (no centring; optionally discounted). Trained with a built-in ratio loss like RL, in any RL mode."""


    datasets: Annotated[list[DistillSet], Meta(min_length=1)]
    # Samples per prompt (their reward is 0: only the KL term carries signal).
    group_size: PosInt = 4
    kl_coef: PosFloat = 1.0
    # 0: each token pays its own KL; γ > 0: a token also pays the discounted KL of the tokens after it.
    kl_discount: Annotated[float, Meta(ge=0, lt=1)] = 0.0

    @property
    def groups_per_batch(self) -> int:
        return sum(d.groups_per_batch for d in self.datasets)
