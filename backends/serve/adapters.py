"""Loss adapters: a forward_backward request's loss_fn and inputs as an op on the training client.

Built-in losses (backends.types.LOSS_FNS) go to the engine as they are; the server-side extras
(backends/serve/sequence_losses.py: gspo, stable_reinforce) run as custom losses over the engine's logprobs, with
stable_reinforce's sampler logprobs taken from the sequences recorded at sampling time (Stability).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from backends.base import CustomLossFn, Future
from backends.serve import sequence_losses as extra_losses
from backends.serve import wire
from backends.serve.replies import Reply
from backends.serve.sessions import Op
from backends.types import LOSS_FNS, Datum, ForwardBackwardOutput, SampleOutput

if TYPE_CHECKING:
    import torch

    from backends.local.backend import LocalTrainingClient

STABILITY_TTL_S = 86400.0  # recorded sequences for stable_reinforce (the service keeps them a day)
STABILITY_MAX = 200_000
FbOp = Op[ForwardBackwardOutput]  # a forward_backward request's op: its reply is the output as protobuf


class Stability:
    """Sampled sequences recorded with record_stability_info=True: sequence id -> (tokens, logprobs, last use)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: collections.OrderedDict[str, tuple[np.ndarray, np.ndarray, float]] = collections.OrderedDict()

    def record(self, seq_ids: list[str], out: SampleOutput) -> None:
        t = time.monotonic()
        with self._lock:
            for sid, s in zip(seq_ids, out.sequences, strict=True):
                self._records[sid] = (np.asarray(s.tokens, np.int64), np.asarray(s.logprobs, np.float32), t)
            while len(self._records) > STABILITY_MAX:
                self._records.popitem(last=False)

    def use(self, seq_id: str) -> tuple[np.ndarray, np.ndarray] | None:
        with self._lock:
            rec = self._records.get(seq_id)
            if rec is None:
                return None
            self._records[seq_id] = (rec[0], rec[1], time.monotonic())  # each use restarts its day
            return rec[0], rec[1]

    def forget_old(self, t: float) -> None:
        with self._lock:
            while self._records and t - next(iter(self._records.values()))[2] > STABILITY_TTL_S:
                self._records.popitem(last=False)

    def __len__(self) -> int:
        return len(self._records)


def fb_reply(out: ForwardBackwardOutput) -> Reply:
    return Reply(200, wire.fb_proto(out), dict(wire.PROTO))


def loss_op(loss_fn: str, wds: list[wire.WireDatum], cfg: dict[str, float | str], forward_only: bool,
            stability: Stability) -> FbOp:
    """The op for a forward_backward request; ValueError (the client's fault) when it cannot run."""
    if not wds:
        raise ValueError("no data")
    data = [w.datum for w in wds]
    if loss_fn in LOSS_FNS:
        numbers = {}
        for k, v in cfg.items():
            if isinstance(v, str):
                raise ValueError(f"loss_fn_config {k!r} must be a number for {loss_fn!r}, not {v[:40]!r}")
            numbers[k] = float(v)
        if forward_only:
            return lambda tc: (tc.forward(data, loss_fn, numbers or None), fb_reply)
        return lambda tc: (tc.forward_backward(data, loss_fn, numbers or None), fb_reply)
    if loss_fn not in extra_losses.EXTRA_LOSSES:
        raise ValueError(f"unknown loss_fn {loss_fn[:60]!r}; runner serve offers "
                         f"{', '.join([*LOSS_FNS, *extra_losses.EXTRA_LOSSES])} "
                         "(custom losses run on the client: forward_backward_custom)")
    conf = extra_losses.resolve(loss_fn, cfg)
    per_datum = [rl_inputs(loss_fn, w, stability) for w in wds]
    fn = _custom_loss(loss_fn, per_datum, conf)
    if forward_only:
        probe = [dataclasses.replace(d, weights=np.zeros(d.target_tokens.shape, np.float32)) for d in data]

        def fwd(tc: LocalTrainingClient) -> tuple[Future[ForwardBackwardOutput], Callable[[ForwardBackwardOutput], Reply]]:
            return tc.forward(probe, "cross_entropy"), lambda out: fb_reply(_forward_value(out, fn, data))

        return fwd
    return lambda tc: (tc.forward_backward_custom(data, fn), lambda out: fb_reply(_builtin_metrics(out)))


def rl_inputs(loss_fn: str, w: wire.WireDatum, stability: Stability) -> dict[str, np.ndarray]:
    d = w.datum
    n = d.length
    if d.target_tokens.ndim != 1:
        raise ValueError(f"loss {loss_fn!r} needs 1-D target_tokens")
    if d.advantages is None:
        raise ValueError(f"loss {loss_fn!r} needs loss input 'advantages'")
    if loss_fn == "gspo":
        if d.logprobs is None:
            raise ValueError("loss 'gspo' needs loss input 'logprobs'")
        mask = w.extra.get("sequence_ratio_mask")
        if mask is None:
            raise ValueError("loss 'gspo' needs loss input 'sequence_ratio_mask'")
        return {"q": d.logprobs, "adv": d.advantages, "mask": mask.reshape(n)}
    # stable_reinforce: the sampler's logprobs come from the recorded sequences the spans name.
    if w.target_spans is None:
        raise ValueError("loss 'stable_reinforce' needs provenance on every datum (Datum.with_provenance) naming "
                         "sequences sampled with record_stability_info=True")
    q = np.zeros(n, np.float32) if d.logprobs is None else d.logprobs.copy()
    sampled = np.zeros(n, np.float32)
    pos = 0
    for span in w.target_spans:
        if span.sampled:
            rec = stability.use(span.sequence_id)
            if rec is None:
                raise ValueError(f"sequence {span.sequence_id[:80]} has no stability record (sample with "
                                 "record_stability_info=True; records are kept one day)")
            tokens, lps = rec
            end = span.offset + span.length
            if end > len(tokens) or pos + span.length > n:
                raise ValueError(f"provenance span of {span.sequence_id} runs past its sequence or the datum")
            if not np.array_equal(tokens[span.offset:end], d.target_tokens[pos:pos + span.length]):
                raise ValueError(f"datum targets do not match the tokens of sequence {span.sequence_id}")
            q[pos:pos + span.length] = lps[span.offset:end]
            sampled[pos:pos + span.length] = 1
        pos += span.length
    if pos != n:
        raise ValueError(f"provenance spans cover {pos} positions, the datum has {n}")
    return {"q": q, "adv": d.advantages, "sampled": sampled}


def _builtin_metrics(out: ForwardBackwardOutput) -> ForwardBackwardOutput:
    """A built-in loss run through the custom path reports like the others: loss:sum only."""
    return ForwardBackwardOutput(out.logprobs, {k: v for k, v in out.metrics.items() if k != "surrogate_loss:sum"})


def _custom_loss(loss_fn: str, per_datum: list[dict[str, np.ndarray]], conf: dict[str, float]) -> CustomLossFn:
    import torch

    def fn(data: list[Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.zeros((), dtype=torch.float32)
        for lp, x in zip(logprobs, per_datum, strict=True):
            t = {k: torch.as_tensor(v, dtype=lp.dtype) for k, v in x.items()}
            if loss_fn == "gspo":
                total = total + extra_losses.gspo(lp, t["q"], t["adv"], t["mask"], conf)
            else:
                total = total + extra_losses.stable_reinforce(lp, t["q"], t["adv"], t["sampled"], conf)
        return total, {}

    return fn


def _forward_value(out: ForwardBackwardOutput, fn: CustomLossFn, data: list[Datum]) -> ForwardBackwardOutput:
    import torch

    with torch.no_grad():
        loss, _ = fn(data, [torch.as_tensor(lp) for lp in out.logprobs])
    return ForwardBackwardOutput(out.logprobs, {"loss:sum": float(loss)})
