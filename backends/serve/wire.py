"""Tinker's binary wire formats (docs/serve.md's layout): forward/backward requests in, forward/backward and
sample results out, as protobuf (`tinker.proto.tinker_public_pb2`, which ships with the SDK).

Everything else on the wire is JSON. The service (backends/serve/service.py) uses these codecs; the tests' fault
layer in front of it (tests/tinker_mock.py) reads requests with them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from backends.types import Datum, ForwardBackwardOutput, SampleOutput

PROTO = {"content-type": "application/x-protobuf"}
# Loss inputs the service knows (tinker.types.datum's typed keys); anything else is refused, as the
# service has no `mask` (the client must fold a mask into advantages / weights).
KNOWN_INPUTS = frozenset({"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask",
                          "clip_low_threshold", "clip_high_threshold"})
# The SDK's sentinel for an empty top-k cell.
TOPK_EMPTY = (0, -99999.0)


@dataclass(frozen=True)
class Span:
    """A provenance run (tinker.types.provenance_spans): `length` datum positions that are positions
    [offset, offset + length) of a sequence's prompt (sampled=False) or of its sampled tokens."""

    sequence_id: str
    offset: int
    length: int
    sampled: bool


@dataclass(frozen=True)
class WireDatum:
    """A decoded datum: our Datum plus the inputs our backend protocol has no field for."""

    datum: Datum
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. sequence_ratio_mask
    target_spans: tuple[Span, ...] | None = None  # provenance of the loss_fn_inputs positions


def _tensor(msg: pb.Tensor) -> np.ndarray:
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype == pb.DTYPE_BFLOAT16:
        raw = np.frombuffer(msg.dense, dtype=np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(list(msg.shape) or [-1])
    if msg.dtype not in dtypes:
        raise ValueError(f"unsupported tensor dtype {msg.dtype}")
    dtype = dtypes[msg.dtype]
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        vals = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        dense = np.zeros(shape, dtype=dtype)
        for i in range(shape[0]):
            dense[i, col[crow[i]:crow[i + 1]]] = vals[crow[i]:crow[i + 1]]
        return dense
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()  # writable, as an engine may hand it to torch
    return arr.reshape(shape) if shape else arr


def _spans(msgs: Iterable[pb.ProvenanceSpan]) -> tuple[Span, ...] | None:
    out = []
    for s in msgs:
        arm = s.WhichOneof("span")
        if arm is None:
            continue
        inner = getattr(s, arm)
        out.append(Span(inner.sequence_id, int(inner.offset), int(inner.length), arm == "sampled_tokens"))
    return tuple(out) if out else None


def decode_wire_datum(d: pb.Datum) -> WireDatum:
    tokens: list[int] = []
    for c in d.model_input:
        kind = c.WhichOneof("chunk") if hasattr(c, "WhichOneof") else "encoded_text"
        if kind not in (None, "encoded_text"):
            raise ValueError(f"model_input chunks of type {kind!r} are not supported (text tokens only)")
        tokens.extend(int(t) for t in np.frombuffer(c.encoded_text.tokens, dtype=np.int32))
    inputs = {k: _tensor(v) for k, v in d.loss_fn_inputs.items()}
    unknown = set(inputs) - KNOWN_INPUTS
    if unknown:  # the service has no `mask` (or other) input: the client must not send one
        raise ValueError(f"unknown loss_fn_inputs {sorted(unknown)}")
    if "target_tokens" not in inputs:
        raise ValueError("loss_fn_inputs has no target_tokens")
    datum = Datum(model_input=tokens, target_tokens=inputs["target_tokens"], weights=inputs.get("weights"),
                  logprobs=inputs.get("logprobs"), advantages=inputs.get("advantages"))
    extra = {k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()
             if k in ("sequence_ratio_mask", "clip_low_threshold", "clip_high_threshold")}
    return WireDatum(datum, extra, _spans(d.loss_fn_input_spans))


def decode_forward_backward(body: bytes, content_encoding: str | None = None) -> pb.ForwardBackwardRequest:
    if content_encoding == "zstd":
        import zstandard

        body = zstandard.ZstdDecompressor().decompress(body)
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    return msg


def loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    """loss_fn_config_v2 (numbers and strings), else the legacy float map."""
    out: dict[str, float | str] = {}
    for k, v in msg.loss_fn_config_v2.items():
        out[k] = v.number if v.WhichOneof("value") == "number" else v.text
    return out or dict(msg.loss_fn_config)


def fb_proto(out: ForwardBackwardOutput) -> bytes:
    """ForwardBackwardOutput as protobuf: one ArrayRecord per run of datums with the same trailing shape."""
    records = []
    for trailing, group in itertools.groupby(out.logprobs, key=lambda a: tuple(a.shape[1:])):
        arrays = [np.ascontiguousarray(a, dtype=np.float32) for a in group]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        records.append(pb.ArrayRecord(
            type_tag="ArrayRecord", num_datums=len(arrays),
            fields={"logprobs": pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(),
                                                 dtype=pb.DTYPE_FLOAT32, trailing_shape=list(trailing))}))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=records,
                                   metrics={k: float(v) for k, v in out.metrics.items()})
    return msg.SerializeToString()


def topk_proto(ids: np.ndarray, lps: np.ndarray) -> pb.TopkLogprobs:
    """An (N, K) top-k table as TopkLogprobs (row-major int32 ids and float32 logprobs)."""
    ids = np.ascontiguousarray(ids, dtype=np.int32)
    lps = np.ascontiguousarray(lps, dtype=np.float32)
    n, k = ids.shape if ids.ndim == 2 else (0, 0)
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=n)


def sample_proto(out: SampleOutput, prompt_lps: list[float | None] | None = None,
                 topk_prompt: tuple[np.ndarray, np.ndarray] | None = None,
                 topk_sampled: list[tuple[np.ndarray, np.ndarray]] | None = None) -> bytes:
    seqs = []
    for i, s in enumerate(out.sequences):
        seq = pb.SampledSequence(stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                                 tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                                 logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes())
        if topk_sampled is not None:
            seq.topk_sampled_logprobs.CopyFrom(topk_proto(*topk_sampled[i]))
        seqs.append(seq)
    msg = pb.SampleResponse(sequences=seqs)
    if prompt_lps is not None:
        msg.prompt_logprobs = np.asarray([np.nan if x is None else x for x in prompt_lps], dtype=np.float32).tobytes()
    if topk_prompt is not None:
        msg.topk_prompt_logprobs.CopyFrom(topk_proto(*topk_prompt))
    return msg.SerializeToString()
