"""The loss registry: one entry per loss, read by everything that knows losses.

A loss is a `LossSpec`: its name (Tinker's `loss_fn`), the Datum inputs it reads besides target_tokens, its
`loss_fn_config` keys with their defaults (and the recipe's names for them), a cross-key rule, and the torch
function giving its per-token loss from the learner's logprobs. Readers:
  - the recipe schema (runner/recipe/schema.py): one `algo.loss` variant per entry offered to RL, its fields from
    the entry's `fields`; a user's own loss is `loss = {kind = "python", target = "pkg.mod:NAME", args = {...}}`
    naming a LossSpec in their module (`runner check` imports it and checks `args` against its keys);
  - RL (runner/algos/rl.py): the recipe's variant -> (name, loss_fn_config);
  - the local backend (backends/local/loss_math.py), the fake (backends/fake.py) and `runner serve` (through the
    local backend; backends/serve/sequence_losses.py adds the two losses that need the server's own records): the function;
  - the Tinker backend: a loss the hosted service knows goes by name, any other runs through forward_backward_custom
    with the same function.
Adding a loss: one `register(LossSpec(...))` (here for a built-in, in any module for a user's own).

Formulas (docs/losses.md "Formulas"), per token, SUMMED over tokens and datums (never averaged). lp = learner logprob of
the target, q = sampler logprob (`Datum.logprobs`), A = advantage, r = exp(lp - q), sg = stop-gradient. Our Datum
may carry `mask` (Tinker has none): every per-token loss is multiplied by it (the backends do that, not the
functions here), which matters for dro, whose quadratic term does not multiply by A (docs/losses.md).

Torch is not imported here (validating a recipe must not load it): the functions use tensor methods only.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Tensor = Any  # torch.Tensor, without importing torch at runtime


@dataclass(frozen=True)
class LossInputs:
    """A datum's (or a batch's, concatenated) loss inputs as tensors on the learner's device; None when absent."""

    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    mask: torch.Tensor | None = None


# (lp, inputs, config) -> the per-token loss, shaped like lp, before the mask.
TokenLoss = Callable[[Tensor, LossInputs, Mapping[str, float]], Tensor]
INPUT_NAMES = ("weights", "logprobs", "advantages")


@dataclass(frozen=True)
class LossField:
    """One loss_fn_config key: its recipe name (`algo.loss.<recipe>`), Tinker's key, default and lower bound."""

    recipe: str
    key: str
    default: float
    # The value must be > gt (or >= ge); None: no bound.
    gt: float | None = None
    ge: float | None = None
    doc: str = ""

    def constraints(self) -> dict[str, Any]:
        """The bounds as msgspec.Meta keywords (the recipe schema's field type; a description there would replace
        the bound in error messages)."""
        return {k: v for k, v in (("gt", self.gt), ("ge", self.ge)) if v is not None}


@dataclass(frozen=True)
class LossSpec:
    """A loss. `spec(**config)` is its resolved loss_fn_config: defaults overlaid, keys and rule checked (ValueError),
    so `runner check` checks a recipe's `args` against the signature that call has."""

    name: str
    token_loss: TokenLoss
    # Datum fields it reads besides target_tokens (from INPUT_NAMES).
    inputs: tuple[str, ...] = ("logprobs", "advantages")
    fields: tuple[LossField, ...] = ()
    # A rule over the resolved config: the problem as one line, or None.
    rule: Callable[[Mapping[str, float]], str | None] | None = None
    # Shown by `runner show`/help for the recipe variant.
    doc: str = ""
    # Accepts (N, K) target_tokens (top-K / soft-target cross entropy); otherwise 1-D only.
    multi_target: bool = False
    # Offered as an RL loss in recipes (`algo.loss.kind`).
    in_rl: bool = True
    # The hosted Tinker service computes it by name; any other loss runs there through forward_backward_custom.
    tinker_builtin: bool = False
    # The recipe variant's class name (default: from the name).
    title: str = ""
    # A Datum input (from `inputs`) where the per-token loss is identically zero, whatever the logprob, at
    # every position where that input is 0 (cross_entropy: weights; the policy-gradient losses: advantages).
    # The local backend skips those positions' gradient work (backends/local/logprobs.py). None: no such input.
    zero_where: str | None = None
    _signature: inspect.Signature = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in self.inputs:
            if name not in INPUT_NAMES:
                raise ValueError(f"loss {self.name!r}: unknown input {name!r} (expected one of {INPUT_NAMES})")
        if self.zero_where is not None and self.zero_where not in self.inputs:
            raise ValueError(f"loss {self.name!r}: zero_where {self.zero_where!r} is not one of its inputs {self.inputs}")
        params = [inspect.Parameter(f.key, inspect.Parameter.KEYWORD_ONLY, default=f.default) for f in self.fields]
        object.__setattr__(self, "_signature", inspect.Signature(params))

    @property
    def __signature__(self) -> inspect.Signature:
        return self._signature

    @property
    def defaults(self) -> dict[str, float]:
        return {f.key: f.default for f in self.fields}

    def __call__(self, **config: float) -> dict[str, float]:
        return self.resolve(config)

    def resolve(self, config: Mapping[str, Any] | None) -> dict[str, float]:
        """Defaults overlaid with `config`; ValueError on an unknown key (a typo must not be ignored), a value out of
        bounds, or a broken rule."""
        out = self.defaults
        for key, value in (config or {}).items():
            if key not in out:
                raise ValueError(f"loss {self.name!r} takes no config key {key!r} (accepted: {', '.join(out) or 'none'})")
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"loss {self.name!r}: config key {key!r} must be a number, got {value!r}") from None
        for f in self.fields:
            v = out[f.key]
            if (f.gt is not None and not v > f.gt) or (f.ge is not None and not v >= f.ge):
                bound = f"> {f.gt:g}" if f.gt is not None else f">= {f.ge:g}"
                raise ValueError(f"loss {self.name!r}: {f.key} must be {bound}, got {v:g}")
        if problem := self.problem(out):
            raise ValueError(f"loss {self.name!r}: {problem}")
        return out

    def problem(self, config: Mapping[str, float]) -> str | None:
        """What the rule says about a full config (one line), or None."""
        return self.rule(config) if self.rule is not None else None

    def check_datum(self, datum: Any) -> None:
        """ValueError if `datum` (a backends.types.Datum) lacks an input this loss reads."""
        for key in self.inputs:
            if getattr(datum, key) is None:
                raise ValueError(f"loss {self.name!r} needs loss input {key!r}")
        if not self.multi_target and datum.target_tokens.ndim != 1:
            raise ValueError(f"loss {self.name!r} needs 1-D target_tokens")

    def masked_sum(self, lp: Tensor, inputs: LossInputs, config: Mapping[str, float]) -> Tensor:
        """Scalar: the per-token losses times the mask (if any), summed."""
        per_token = self.token_loss(lp, inputs, config)
        if inputs.mask is not None:
            per_token = per_token * (inputs.mask if per_token.ndim == 1 else inputs.mask[:, None])
        return per_token.sum()


# ---------------------------------------------------------------- the registry

_LOCK = threading.Lock()
_REGISTRY: dict[str, LossSpec] = {}


def register(spec: LossSpec) -> LossSpec:
    """Add a loss (idempotent for the same spec); ValueError when another loss has its name."""
    with _LOCK:
        old = _REGISTRY.get(spec.name)
        if old is not None and old is not spec and old != spec:
            raise ValueError(f"a different loss is already registered as {spec.name!r}")
        _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> LossSpec:
    """The loss named `name`; ValueError naming the known ones."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise ValueError(f"unknown loss_fn {name!r}; expected one of: {', '.join(_REGISTRY)}")
    return spec


def names() -> list[str]:
    return list(_REGISTRY)


def specs() -> list[LossSpec]:
    return list(_REGISTRY.values())


class _LiveNames(Sequence[str]):
    """The registered names as a sequence that follows later registrations (`name in LOSS_FNS`)."""

    def __getitem__(self, i: Any) -> Any:
        return names()[i]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __repr__(self) -> str:
        return repr(tuple(names()))


LOSS_NAMES: Sequence[str] = _LiveNames()


# ---------------------------------------------------------------- Tinker's built-ins (docs/losses.md)


def _need(x: Tensor | None) -> Tensor:
    assert x is not None  # the backends check the datum's inputs (LossSpec.check_datum) first
    return x


def _cross_entropy(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    return -_need(inp.weights) * lp


def _ratio(lp: Tensor, inp: LossInputs) -> Tensor:
    return (lp - _need(inp.logprobs)).exp()


def _importance_sampling(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    return -_ratio(lp, inp) * _need(inp.advantages)


def _ppo(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    ratio, adv = _ratio(lp, inp), _need(inp.advantages)
    clipped = ratio.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(ratio * adv).minimum(clipped * adv)


def _cispo(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    clipped = _ratio(lp, inp).clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -clipped.detach() * lp * _need(inp.advantages)


def _dro(lp: Tensor, inp: LossInputs, cfg: Mapping[str, float]) -> Tensor:
    return -(lp * _need(inp.advantages) - 0.5 * cfg["beta"] * (lp - _need(inp.logprobs)) ** 2)


def _clips_ordered(cfg: Mapping[str, float]) -> str | None:
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    return "clip_low must be < clip_high" if lo >= hi else None


def _clip_fields(lo: float, hi: float) -> tuple[LossField, ...]:
    return (LossField("clip_low", "clip_low_threshold", lo, ge=0.0, doc="lower bound on the ratio r itself"),
            LossField("clip_high", "clip_high_threshold", hi, gt=0.0, doc="upper bound on the ratio r itself"))


CROSS_ENTROPY = register(LossSpec(
    "cross_entropy", _cross_entropy, inputs=("weights",), multi_target=True, zero_where="weights", in_rl=False, tinker_builtin=True,
    doc="−Σ w·lp (SFT; (N, K) targets: top-K / soft-target cross entropy)."))
IMPORTANCE_SAMPLING = register(LossSpec(
    "importance_sampling", _importance_sampling, tinker_builtin=True, zero_where="advantages", title="ImportanceSampling",
    doc="−Σ r·A, r = exp(lp − lp_sampler)."))
PPO = register(LossSpec(
    "ppo", _ppo, fields=_clip_fields(0.8, 1.2), rule=_clips_ordered, tinker_builtin=True, zero_where="advantages", title="PPO",
    doc="−Σ min(r·A, clip(r, lo, hi)·A). The bounds are on the ratio itself, not epsilons."))
CISPO = register(LossSpec(
    "cispo", _cispo, fields=_clip_fields(0.0, 4.0), rule=_clips_ordered, tinker_builtin=True, zero_where="advantages", title="CISPO",
    doc="−Σ sg(clip(r, lo, hi))·lp·A. Default one-sided (Tinker's)."))
# dro's beta follows the docs' example; Tinker states no default.
DRO = register(LossSpec(
    "dro", _dro, fields=(LossField("beta", "beta", 0.05, gt=0.0, doc="weight of the quadratic penalty"),),
    tinker_builtin=True, title="DRO", doc="−Σ (lp·A − ½·β·(lp − lp_sampler)²)."))

# Tinker's built-ins, as registered above (the recipe schema offers these by name; user losses by target).
BUILTINS: tuple[LossSpec, ...] = tuple(specs())
