"""Our nouns to the Tinker SDK's and back, at the backend's boundary (backends/tinker/backend.py calls these): no
other module converts, so what crosses is exactly backends/types.py's types."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tinker

from backends.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    OptimStepOutput,
    SampledSequence,
    SampleOutput,
    SamplingParams,
)


def tensor(arr: np.ndarray) -> tinker.TensorData:
    return tinker.TensorData.from_numpy(np.ascontiguousarray(arr))


def to_tinker_datum(d: Datum, keys: tuple[str, ...]) -> tinker.Datum:
    """Our Datum with the loss inputs in `keys`. Tinker has no mask: it is folded into weights and
    advantages (exact for 0/1 masks and every built-in loss but dro's quadratic term)."""
    inputs: dict[str, tinker.TensorData] = {"target_tokens": tensor(d.target_tokens)}
    for name in keys:
        value = getattr(d, name)
        if value is None:
            continue
        if d.mask is not None and name in ("weights", "advantages"):
            value = value * (d.mask if value.ndim == 1 else d.mask[:, None])
        inputs[name] = tensor(value)
    return tinker.Datum(model_input=tinker.ModelInput.from_ints(list(d.model_input)), loss_fn_inputs=inputs)


def fb_output(data: list[Datum]) -> Callable[[tinker.ForwardBackwardOutput], ForwardBackwardOutput]:
    def convert(out: tinker.ForwardBackwardOutput) -> ForwardBackwardOutput:
        if len(out.loss_fn_outputs) != len(data):
            raise ValueError(f"{len(out.loss_fn_outputs)} outputs for {len(data)} datums")
        logprobs = [
            np.asarray(o["logprobs"].to_numpy(), dtype=np.float32).reshape(d.target_tokens.shape)
            for o, d in zip(out.loss_fn_outputs, data, strict=True)
        ]
        return ForwardBackwardOutput(logprobs=logprobs, metrics={k: float(v) for k, v in out.metrics.items()})

    return convert


def optim_output(out: tinker.OptimStepResponse) -> OptimStepOutput:
    return OptimStepOutput(metrics={k: float(v) for k, v in (out.metrics or {}).items()})


def sample_output(out: tinker.SampleResponse) -> SampleOutput:
    seqs = []
    for s in out.sequences:
        if s.logprobs is None:
            raise ValueError("sample returned no logprobs")
        seqs.append(SampledSequence(tokens=[int(t) for t in s.tokens], logprobs=[float(x) for x in s.logprobs],
                                    stop_reason=s.stop_reason))
    return SampleOutput(sequences=seqs)


def logprobs_output(out: list[float | None]) -> list[float | None]:
    return [None if x is None else float(x) for x in out]


def weights_path(out: tinker.types.SaveWeightsResponse | tinker.types.SaveWeightsForSamplerResponse) -> str:
    return str(out.path)


def to_tinker_sampling(p: SamplingParams) -> tinker.SamplingParams:
    return tinker.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                 top_k=p.top_k, stop=p.stop, seed=p.seed)


def to_tinker_adam(p: AdamParams) -> tinker.AdamParams:
    return tinker.AdamParams(learning_rate=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                             weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm)
