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
Adding a built-in loss: one file, backends/losses/NAME_config.py, that registers its LossSpec and declares its recipe
variant, `NAME = loss_config(register(LossSpec(...)), __name__)` (docs/extending.md); this package finds the files
(backends/configs.py `found`) when it is imported, so nothing lists them. A user's own: `register(LossSpec(...))`
in any module, named by the recipe.

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
from typing import TYPE_CHECKING, Annotated, ClassVar, Protocol, SupportsFloat, SupportsIndex, overload

import msgspec
from msgspec import Meta

from backends.configs import ConfigStruct, config_modules, found

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor
else:
    # torch.Tensor for the type checker; at run time only its name (in the aliases built from it, as base.py's
    # CustomLossFn), so that importing the losses does not load torch (`runner check`, `runner list`).
    Tensor = "torch.Tensor"


class HasLossInputs(Protocol):
    """What a datum carries for the loss (backends/types.py Datum; not imported: it imports this package)."""

    @property
    def weights(self) -> np.ndarray | None: ...
    @property
    def logprobs(self) -> np.ndarray | None: ...
    @property
    def advantages(self) -> np.ndarray | None: ...
    @property
    def mask(self) -> np.ndarray | None: ...


class HasLossData(HasLossInputs, Protocol):
    """A datum as LossSpec.check_datum reads it: its loss inputs and its target tokens."""

    @property
    def target_tokens(self) -> np.ndarray: ...


@dataclass(frozen=True)
class LossInputs:
    """A datum's (or a batch's, concatenated) loss inputs as tensors on the learner's device; None when absent."""

    weights: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @classmethod
    def of(cls, datum: HasLossInputs, tensor: Callable[[np.ndarray], torch.Tensor]) -> LossInputs:
        """The datum's weights, logprobs, advantages and mask, each through `tensor` (None stays None)."""

        def t(x: np.ndarray | None) -> torch.Tensor | None:
            return None if x is None else tensor(x)

        return cls(t(datum.weights), t(datum.logprobs), t(datum.advantages), t(datum.mask))


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

    def meta(self) -> Meta:
        """The bound as the recipe schema's field constraint (a description there would replace the bound in error
        messages); msgspec takes gt or ge, not both."""
        if self.gt is not None and self.ge is not None:
            raise ValueError(f"loss field {self.recipe!r}: cannot specify both gt and ge")
        return Meta(gt=self.gt) if self.gt is not None else Meta(ge=self.ge)


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

    def resolve(self, config: Mapping[str, object] | None) -> dict[str, float]:
        """Defaults overlaid with `config`; ValueError on an unknown key (a typo must not be ignored), a value out of
        bounds, or a broken rule."""
        out = self.defaults
        for key, value in (config or {}).items():
            if key not in out:
                raise ValueError(f"loss {self.name!r} takes no config key {key!r} (accepted: {', '.join(out) or 'none'})")
            try:
                if not isinstance(value, (str, SupportsFloat, SupportsIndex)):
                    raise TypeError(value)
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

    def check_datum(self, datum: HasLossData) -> None:
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

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
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


# ---------------------------------------------------------------- the recipe's variants (`algo.loss = {kind = NAME}`)


class LossConfig(ConfigStruct, tag_field="kind", tag=str.lower):  # pyright: ignore[reportGeneralTypeIssues]
    """A recipe's `algo.loss` table. Each built-in RL loss's variant is generated from its spec (`loss_config`), so its
    fields are the spec's and it checks what the spec checks; a user's is the recipe schema's `kind = "python"`."""

    loss_spec: ClassVar[LossSpec | None] = None


def loss_config(spec: LossSpec, module: str) -> type[LossConfig]:
    """The recipe table of a loss, declared in `module` (its config file): `{kind = NAME, <its fields>}`."""
    fields = [(f.recipe, Annotated[float, f.meta()], f.default) for f in spec.fields]

    def __post_init__(self: object) -> None:
        if problem := spec.problem({f.key: getattr(self, f.recipe) for f in spec.fields}):
            raise ValueError(problem)

    namespace = {"__doc__": spec.doc, "__post_init__": __post_init__, "loss_spec": spec}
    title = spec.title or spec.name.title().replace("_", "")
    variant = msgspec.defstruct(title, fields, bases=(LossConfig,), tag=spec.name, module=module, namespace=namespace)
    assert issubclass(variant, LossConfig)
    return variant


# ---------------------------------------------------------------- helpers of the built-ins' token losses


def need(x: Tensor | None) -> Tensor:
    assert x is not None  # the backends check the datum's inputs (LossSpec.check_datum) first
    return x


def ratio(lp: Tensor, inp: LossInputs) -> Tensor:
    """r = exp(lp − lp_sampler)."""
    return (lp - need(inp.logprobs)).exp()


def clips_ordered(cfg: Mapping[str, float]) -> str | None:
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    return "clip_low must be < clip_high" if lo >= hi else None


def clip_fields(lo: float, hi: float) -> tuple[LossField, ...]:
    return (LossField("clip_low", "clip_low_threshold", lo, ge=0.0, doc="lower bound on the ratio r itself"),
            LossField("clip_high", "clip_high_threshold", hi, gt=0.0, doc="upper bound on the ratio r itself"))


# ---------------------------------------------------------------- Tinker's built-ins (docs/losses.md)

# Each backends/losses/NAME_config.py registers its loss when imported (file-name order); these are the built-ins.
config_modules(__name__)
BUILTINS: tuple[LossSpec, ...] = tuple(specs())


def rl_variants() -> tuple[type[LossConfig], ...]:
    """The recipe variants of the built-in RL losses (`algo.loss.kind`), in file-name order."""
    return found(LossConfig, __name__)
