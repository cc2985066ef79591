"""Group-relative advantages (the cookbook's compute_advantages; GRPO without the std by default).

A_i = R_i − mean(R_group), with R = Σ step rewards + group reward: one scalar per trajectory, spread over
its action tokens by datums.py. Dividing by the group std (normalize_std) is off by default, as in the
cookbook: with token-sum losses it changes the effective step size per group, and a group whose rewards
barely differ gets its noise amplified to unit scale.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runner.rl.types import TrajectoryGroup

STD_EPS = 1e-6


def compute_advantages(groups: Sequence[TrajectoryGroup], normalize_std: bool = False) -> list[np.ndarray]:
    """advantages_G (float32) for each group, in order."""
    out = []
    for g in groups:
        rewards_G = np.asarray(g.total_rewards_G(), dtype=np.float64)
        advantages_G = rewards_G - rewards_G.mean()
        if normalize_std:
            advantages_G /= rewards_G.std() + STD_EPS
        out.append(advantages_G.astype(np.float32))
    return out


def remove_constant_reward_groups(groups: Sequence[TrajectoryGroup]) -> list[TrajectoryGroup]:
    """Groups whose total rewards are not all equal (equal rewards give zero advantages: no signal).
    Keeps the first group if that would drop everything, as the cookbook does, so a step still has data."""
    kept = [g for g in groups if len(set(g.total_rewards_G())) > 1]
    return kept if kept or not groups else [groups[0]]
