"""The numerics gate's table, `numerics = {...}` on an RL or distill algo (runner/rl/gate.py acts on it).

It sits on the algorithm, not the recipe: only the algorithms that train on their own samples (rl, distill) have
sampler logprobs to compare with the trainer's; SFT, DPO and the reward model never sample.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from backends.backend_config import ConfigStruct

# Defaults from tinker-cookbook's rl_numerics_check README: healthy runs log kl_sample_train_v1 of 0.0002 (dense)
# to 0.002 (MoE); a long-context trainer bug it caught showed 0.02-0.16.
DEFAULT_MAX_KL = 0.01


class Numerics(ConfigStruct):  # pyright: ignore[reportGeneralTypeIssues] (see ConfigStruct)
    """A step fails the gate when |optim/kl_sample_train_v1| or optim/kl_sample_train_v2 is over max_kl, or
    numerics/max_abs_dlogprob is over max_abs_dlogprob (when given). Only at temperature = 1: the sampler reports
    temperature-scaled logprobs, the trainer's forward does not (docs/numerics.md)."""

    max_kl: Annotated[float, Meta(gt=0)] = DEFAULT_MAX_KL
    # The largest |sampler − trainer| logprob on any sampled token of the step; None = not gated (one token in a
    # large bf16 batch can be far off in a healthy run).
    max_abs_dlogprob: Annotated[float, Meta(gt=0)] | None = None
    # warn: one line per failing step (at most one per warn_every_s seconds); stop: end the run (exit 2) before the
    # failing step is checkpointed, so the last checkpoint is the last step that passed.
    action: Literal["warn", "stop"] = "warn"
    # Steps before the gate acts (the metrics are logged from step 0).
    after_steps: Annotated[int, Meta(ge=0)] = 0


def check_temperature(numerics: Numerics | None, temperature: float) -> None:
    """The recipe-time rule, raised as the algo's ValueError (so `runner check` names the field)."""
    if numerics is not None and temperature != 1.0:
        raise ValueError(f"numerics: the gate compares sampler and trainer logprobs, which agree only at "
                         f"temperature = 1 (the sampler's are scaled by 1/T); this algo samples at {temperature:g}: "
                         "drop the numerics table or sample at 1 (docs/numerics.md)")
