"""Trajectories -> training datums (the cookbook's trajectory_to_data / assemble_training_data).

The turns of an episode are merged into one sequence for as long as each observation starts with the
previous observation plus its action (the "extension property" of ChatML-style re-rendering); when one does
not, the sequence so far becomes a datum and a new one starts. Along the full sequence:
  observation tokens: mask 0, logprob 0, advantage 0;
  action tokens: mask 1, the sampler's logprob, the trajectory's advantage.
A transition whose metrics carry parse_error_masked=1 keeps its tokens but gets mask 0 and advantage 0.
Then Tinker alignment: model_input = seq[:-1] and every per-token array is cut to [1:] (position i predicts
token i+1), so the first action token's logprob sits at the position of the last observation token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from backends.types import Datum
from runner.rl.types import Trajectory, TrajectoryGroup

PARSE_ERROR_MASKED = "parse_error_masked"


@dataclass(frozen=True)
class DatumSource:
    group_idx: int
    traj_idx: int


def trajectory_to_datums(traj: Trajectory, advantage: float) -> list[Datum]:
    data_D: list[Datum] = []
    seq_T: list[int] = []
    logprobs_T: list[float] = []
    advantages_T: list[float] = []
    mask_T: list[float] = []

    def flush() -> None:
        # A datum needs two tokens and at least one trained position.
        if len(seq_T) >= 2 and any(mask_T[1:]):
            data_D.append(
                Datum(
                    model_input=seq_T[:-1],
                    target_tokens=np.asarray(seq_T[1:], dtype=np.int64),
                    logprobs=np.asarray(logprobs_T[1:], dtype=np.float32),
                    advantages=np.asarray(advantages_T[1:], dtype=np.float32),
                    mask=np.asarray(mask_T[1:], dtype=np.float32),
                )
            )
        for buf in (seq_T, logprobs_T, advantages_T, mask_T):
            buf.clear()

    for tr in traj.transitions:
        ob = list(tr.ob)
        if seq_T and ob[: len(seq_T)] == seq_T:
            delta = ob[len(seq_T) :]
        else:
            flush()
            delta = ob
        seq_T += delta
        logprobs_T += [0.0] * len(delta)
        advantages_T += [0.0] * len(delta)
        mask_T += [0.0] * len(delta)
        trained = not tr.metrics.get(PARSE_ERROR_MASKED)
        n = len(tr.ac.tokens)
        seq_T += list(tr.ac.tokens)
        logprobs_T += [float(x) for x in tr.ac.logprobs]
        advantages_T += [float(advantage) if trained else 0.0] * n
        mask_T += [1.0 if trained else 0.0] * n
    flush()
    return data_D


def assemble_datums(
    groups: Sequence[TrajectoryGroup], advantages_P_G: Sequence[Sequence[float] | np.ndarray]
) -> tuple[list[Datum], list[DatumSource]]:
    """All datums of a batch and, for each, the (group, trajectory) it came from."""
    data_D: list[Datum] = []
    sources_D: list[DatumSource] = []
    for gi, (g, advantages_G) in enumerate(zip(groups, advantages_P_G, strict=True)):
        for ti, (traj, adv) in enumerate(zip(g.trajectories_G, advantages_G, strict=True)):
            for datum in trajectory_to_datums(traj, float(adv)):
                data_D.append(datum)
                sources_D.append(DatumSource(gi, ti))
    return data_D, sources_D
