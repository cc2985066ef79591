"""Per-step trajectory metrics, with the cookbook's names (rl/metric_util.compute_trajectory_metrics).

Under env/all/ and, for a logging tag that covers a strict subset of the groups, env/<tag>/:
  total_episodes, total_turns, total_ac_tokens, total_ob_tokens, ac_tokens_per_turn, ob_tokens_per_turn,
  turns_per_episode, reward/total (mean total return), turns_truncated_frac (ours: turns that hit
  max_tokens), every env metric (transition metrics and compute_group_rewards metrics, each averaged over
  the entries that report it), and by_group/frac_mixed | frac_all_good | frac_all_bad (a group is mixed
  when its rewards differ; otherwise all good when they are >= 0.5, else all bad).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from runner.rl.types import TrajectoryGroup

GOOD_REWARD = 0.5


def trajectory_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    out = _metrics(groups, "env/all")
    tags = sorted({tag for g in groups for tag in g.tags})
    for tag in tags:
        subset = [g for g in groups if tag in g.tags]
        if len(subset) < len(groups):
            out.update(_metrics(subset, f"env/{tag}"))
    return out


def _metrics(groups: Sequence[TrajectoryGroup], prefix: str) -> dict[str, float]:
    trajectories = [t for g in groups for t in g.trajectories_G]
    transitions = [tr for t in trajectories for tr in t.transitions]
    turns = len(transitions)
    ac_tokens = sum(len(tr.ac.tokens) for tr in transitions)
    ob_tokens = sum(len(tr.ob) for tr in transitions)
    episodes = len(trajectories)
    rewards = [r for g in groups for r in g.total_rewards_G()]
    m: dict[str, float] = {
        "total_episodes": float(episodes),
        "total_turns": float(turns),
        "total_ac_tokens": float(ac_tokens),
        "total_ob_tokens": float(ob_tokens),
        "ac_tokens_per_turn": ac_tokens / turns if turns else 0.0,
        "ob_tokens_per_turn": ob_tokens / turns if turns else 0.0,
        "turns_per_episode": turns / episodes if episodes else 0.0,
        "turns_truncated_frac": sum(tr.ac.stop_reason == "length" for tr in transitions) / turns if turns else 0.0,
        "reward/total": float(np.mean(rewards)) if rewards else 0.0,
    }
    # Env metrics: each averaged over the entries that have it (a metric only some turns report is not diluted).
    values: dict[str, list[float]] = defaultdict(list)
    for entry in [tr.metrics for tr in transitions] + [mg for g in groups for mg in g.metrics_G]:
        for k, v in entry.items():
            values[k].append(float(v))
    for k, vs in values.items():
        m.setdefault(k, float(np.mean(vs)))
    m.update(_by_group(groups))
    return {f"{prefix}/{k}": v for k, v in m.items()}


def _by_group(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    n = len(groups)
    mixed = good = bad = 0
    for g in groups:
        rewards = g.total_rewards_G()
        if len(set(rewards)) > 1:
            mixed += 1
        elif rewards and rewards[0] >= GOOD_REWARD:
            good += 1
        else:
            bad += 1
    if n == 0:
        return {}
    return {"by_group/frac_mixed": mixed / n, "by_group/frac_all_good": good / n, "by_group/frac_all_bad": bad / n}
