"""What the policy saw and did, for people: an HTML transcript per logged iteration, and the cookbook's
rollout-summary JSONL (one row per trajectory, cookbook §5.2 shape) for scripts.

HTML: one section per group (tags, rewards), one per trajectory, one block per turn with the observation
(only the part new since the previous turn when the turns extend each other), the sampled action, its
reward and the env's metrics/logs. Every piece of model or env text is escaped; nothing is loaded from the
network, so the file opens anywhere.
"""

from __future__ import annotations

import errno
import html
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from backends.errors import UserError
from runner.rl.types import Trajectory, TrajectoryGroup

Decode = Callable[[list[int]], str]

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }
section.group { border-top: 2px solid #888; margin-top: 2em; }
div.traj { margin: 1em 0 1em 1em; }
pre { white-space: pre-wrap; word-break: break-word; padding: .4em; margin: .2em 0; }
pre.ob { background: #f2f2f2; }
pre.ac { background: #e3f5e1; }
table { border-collapse: collapse; font-size: 90%; }
td, th { border: 1px solid #ccc; padding: .1em .5em; text-align: left; }
.meta { color: #555; font-size: 90%; }
"""


def write_html(
    path: str | Path,
    groups: Sequence[TrajectoryGroup],
    decode: Decode,
    *,
    title: str,
    group_indices: Sequence[int] | None = None,
    max_groups: int | None = None,
) -> None:
    indices = list(group_indices) if group_indices is not None else list(range(len(groups)))
    shown = list(zip(indices, groups))[:max_groups]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        f"<p class='meta'>{len(shown)} of {len(groups)} groups</p>",
    ]
    for gi, g in shown:
        totals = g.total_rewards_G()
        parts.append(f"<section class='group'><h2>Group {gi}</h2>")
        parts.append(
            f"<p class='meta'>tags: {_e(', '.join(g.tags) or '-')}; total rewards: "
            f"{_e(', '.join(f'{r:.3g}' for r in totals))}</p>"
        )
        for ti, traj in enumerate(g.trajectories_G):
            parts.append(_trajectory_html(ti, traj, g.final_rewards_G[ti], g.metrics_G[ti], totals[ti], decode))
        parts.append("</section>")
    parts.append("</body></html>\n")
    _write(Path(path), "".join(parts))


def _trajectory_html(
    ti: int, traj: Trajectory, final_reward: float, final_metrics: dict, total: float, decode: Decode
) -> str:
    parts = [f"<div class='traj'><h3>Trajectory {ti}: total reward {total:.4g}</h3>"]
    if not traj.transitions:
        parts.append("<p class='meta'>no turns</p>")
    prev: list[int] = []
    for k, tr in enumerate(traj.transitions):
        ob = list(tr.ob)
        extends = bool(prev) and ob[: len(prev)] == prev
        new = ob[len(prev) :] if extends else ob
        label = "observation (new part)" if extends else "observation"
        parts.append(f"<h4>Turn {k}</h4><div class='meta'>{label}, {len(ob)} tokens</div>")
        parts.append(f"<pre class='ob'>{_e(decode(new))}</pre>")
        parts.append(f"<div class='meta'>action, {len(tr.ac.tokens)} tokens, stop: {_e(tr.ac.stop_reason)}</div>")
        parts.append(f"<pre class='ac'>{_e(decode(list(tr.ac.tokens)))}</pre>")
        parts.append(_table({"reward": tr.reward, "episode_done": tr.episode_done, **tr.metrics, **tr.logs}))
        prev = ob + list(tr.ac.tokens)
    parts.append("<div class='meta'>episode totals</div>")
    parts.append(
        _table(
            {
                "turns": len(traj.transitions),
                "sum_step_rewards": traj.total_step_reward,
                "final_group_reward": final_reward,
                **final_metrics,
                "total_return": total,
            }
        )
    )
    parts.append("</div>")
    return "".join(parts)


def _table(row: dict) -> str:
    cells = "".join(f"<tr><th>{_e(k)}</th><td>{_e(_fmt(v))}</td></tr>" for k, v in row.items())
    return f"<table>{cells}</table>"


def _fmt(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _e(s: object) -> str:
    return html.escape(str(s), quote=True)


def rollout_summary_rows(
    groups: Sequence[TrajectoryGroup],
    *,
    split: str,
    iteration: int,
    group_indices: Sequence[int] | None = None,
    sampling_client_step: int | None = None,
) -> list[dict]:
    indices = list(group_indices) if group_indices is not None else list(range(len(groups)))
    rows = []
    for gi, g in zip(indices, groups, strict=True):
        totals = g.total_rewards_G()
        for ti, traj in enumerate(g.trajectories_G):
            metrics: dict[str, float] = {}
            for tr in traj.transitions:
                metrics.update(tr.metrics)
            metrics.update(g.metrics_G[ti])
            rows.append(
                {
                    "schema_version": 1,
                    "split": split,
                    "iteration": iteration,
                    "group_idx": gi,
                    "traj_idx": ti,
                    "tags": list(g.tags),
                    "sampling_client_step": sampling_client_step,
                    "total_reward": totals[ti],
                    "final_reward": g.final_rewards_G[ti],
                    "trajectory_metrics": metrics,
                    "final_ob_len": len(traj.final_ob),
                    "steps": [
                        {
                            "step_idx": k,
                            "ob_len": len(tr.ob),
                            "ac_len": len(tr.ac.tokens),
                            "reward": tr.reward,
                            "episode_done": tr.episode_done,
                            "metrics": tr.metrics,
                            "logs": tr.logs,
                        }
                        for k, tr in enumerate(traj.transitions)
                    ],
                }
            )
    return rows


def write_rollout_summaries(path: str | Path, groups: Sequence[TrajectoryGroup], **kwargs) -> None:
    """`rollout_summary_rows` as JSONL (keyword arguments are passed on)."""
    _write(Path(path), "".join(json.dumps(row) + "\n" for row in rollout_summary_rows(groups, **kwargs)))


def _write(path: Path, text: str) -> None:
    """Write a transcript file in the run dir, never through a link planted there (docs/reliability.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link; runner does not write through links in a run dir: replace "
                            "it with a file") from None
        raise
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
