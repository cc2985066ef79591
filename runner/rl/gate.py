"""The numerics gate: does the trainer see the sampled tokens as the sampler did?

Every RL and distillation step already has both sides: the sampler's logprob of each sampled token (in the datum)
and the trainer's (forward_backward's output, before the update). With Δ = sampler_lp − trainer_lp over the action
tokens (mask > 0):
  optim/kl_sample_train_v1 = mean(Δ), v2 = ½·mean(Δ²)   over the whole step (runner/rl/kl.py, the cookbook's names)
  numerics/kl_sample_train_v1, _v2, numerics/max_abs_dlogprob, numerics/mean_abs_dlogprob,
  numerics/frac_dlogprob_gt_0.1, numerics/tokens      over the step's on-policy tokens (`on_policy`: the first
                                                       substep, when its sampler is the current weights)
With one substep in sync or stream mode the two KL pairs are equal. No extra forward is made. The recipe's
`numerics = {...}` table (runner/recipe/numerics_table.py) turns the numerics/* ones into a gate (`Gate`): "warn" prints
one line per failing step (rate-limited), "stop" ends the run with a UserError (exit 2) before the failing step's
metrics row and checkpoint row are written, so the run dir's last checkpoint is the last step that passed.

`runner numerics FILE#name` (runner/tools/numerics.py) runs the same comparison alone, with a third side: the
sampling client's compute_logprobs. docs/numerics.md has the thresholds, the temperature caveat and measured values.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from backends.errors import UserError
from backends.types import Datum
from runner.recipe.numerics_table import Numerics

BIG_DLOGPROB = 0.1  # numerics/frac_dlogprob_gt_0.1
FRAC_KEY = f"numerics/frac_dlogprob_gt_{BIG_DLOGPROB:g}"


def action_logprobs(data_D: Sequence[Datum], train_logprobs_D: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(sampler, trainer) logprobs of every action token (mask > 0) of the batch, flattened."""
    sampled_T: list[np.ndarray] = []
    trained_T: list[np.ndarray] = []
    for d, lp in zip(data_D, train_logprobs_D, strict=True):
        assert d.logprobs is not None and d.mask is not None  # runner/rl/datums.py sets both
        on = d.mask > 0
        sampled_T.append(d.logprobs[on])
        trained_T.append(np.asarray(lp, dtype=np.float32)[on])
    if not sampled_T:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate(sampled_T), np.concatenate(trained_T)


def diff_stats(diff: np.ndarray) -> dict[str, float]:
    """kl_v1, kl_v2, mean/max |Δ|, the fraction over BIG_DLOGPROB, and the count, of Δ = sampler − other."""
    if diff.size == 0:
        return {}
    a = np.abs(diff)
    return {"kl_v1": float(diff.mean()), "kl_v2": float(0.5 * (diff**2).mean()), "mean_abs": float(a.mean()),
            "max_abs": float(a.max()), "frac_big": float((a > BIG_DLOGPROB).mean()), "tokens": float(diff.size)}


def dlogprob_metrics(data_D: Sequence[Datum], train_logprobs_D: Sequence[np.ndarray]) -> dict[str, float]:
    """The numerics/* metrics of the on-policy part of a step (see `on_policy`); {} when it has none."""
    sampled, trained = action_logprobs(data_D, train_logprobs_D)
    s = diff_stats(sampled - trained)
    if not s:
        return {}
    return {"numerics/kl_sample_train_v1": s["kl_v1"], "numerics/kl_sample_train_v2": s["kl_v2"],
            "numerics/max_abs_dlogprob": s["max_abs"], "numerics/mean_abs_dlogprob": s["mean_abs"],
            FRAC_KEY: s["frac_big"], "numerics/tokens": s["tokens"]}


def on_policy(parts: Sequence[tuple[int | None, list[Datum], list[np.ndarray]]]) -> tuple[list[Datum], list[np.ndarray]]:
    """The datums (and their trainer logprobs) of a step whose forward_backward ran on the weights that sampled
    them: those submitted before the step's first optim_step. `parts`: the step's submissions in order, each
    (how many of its datums were trained before its first optim_step, None: all, as it has none; its datums in
    order; their trainer logprobs). Later substeps see weights one or more updates on, so their Δ holds the
    policy's change as well as any numerics fault (optim/kl_sample_train_* mixes the two; the gate must not)."""
    data_D: list[Datum] = []
    lps_D: list[np.ndarray] = []
    for before_optim, part_D, part_lps in parts:
        n = len(part_D) if before_optim is None else before_optim
        data_D += part_D[:n]
        lps_D += part_lps[:n]
        if before_optim is not None:
            break
    return data_D, lps_D


def failures(cfg: Numerics, kl_v1: float, kl_v2: float, max_abs: float) -> list[str]:
    """What is over the limits, as 'name value > limit' (empty: passed)."""
    out = []
    if abs(kl_v1) > cfg.max_kl:
        out.append(f"|kl_sample_train_v1| {abs(kl_v1):.3g} > max_kl {cfg.max_kl:g}")
    if kl_v2 > cfg.max_kl:
        out.append(f"kl_sample_train_v2 {kl_v2:.3g} > max_kl {cfg.max_kl:g}")
    if cfg.max_abs_dlogprob is not None and max_abs > cfg.max_abs_dlogprob:
        out.append(f"max_abs_dlogprob {max_abs:.3g} > {cfg.max_abs_dlogprob:g}")
    return out


class Gate:
    """Acts on a step's metrics (RLAlgo.finish calls `check`). `warn_every_s`: at most one warning line per that
    many seconds; the next line counts the failing steps it did not show."""

    def __init__(self, cfg: Numerics | None, warn_every_s: float = 60.0, stream: TextIO | None = None):
        self.cfg, self.warn_every_s, self.stream = cfg, warn_every_s, stream
        self.last_warn = -float("inf")
        self.unshown = 0

    def check(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """{"numerics/gate_failed": 0 or 1} for the row; raises UserError when a failing step must stop the run."""
        cfg = self.cfg
        if cfg is None or step < cfg.after_steps or "numerics/kl_sample_train_v1" not in metrics:
            return {}
        bad = failures(cfg, metrics["numerics/kl_sample_train_v1"], metrics["numerics/kl_sample_train_v2"],
                       metrics["numerics/max_abs_dlogprob"])
        if not bad:
            return {"numerics/gate_failed": 0.0}
        what = f"numerics gate: step {step}: the sampler's and the trainer's logprobs of the sampled tokens disagree: " \
               + ", ".join(bad)
        if cfg.action == "stop":
            raise UserError(f"{what}; run stopped before step {step} was checkpointed (its last checkpoint is the "
                            "last step that passed); see docs/numerics.md")
        now = time.monotonic()
        if now - self.last_warn < self.warn_every_s:
            self.unshown += 1
        else:
            more = f" ({self.unshown} more failing steps since the last warning)" if self.unshown else ""
            _write(f"warning: {what}{more}", self.stream)
            self.last_warn, self.unshown = now, 0
        return {"numerics/gate_failed": 1.0}


def _write(line: str, stream: TextIO | None) -> None:
    """One line on stderr (through tqdm, so a live progress bar is redrawn under it)."""
    from tqdm import tqdm

    tqdm.write(line, file=stream or sys.stderr)
