"""The conformance suite's machinery: the check registry, the shared context (one ServiceClient, the model,
a few token ids), running each check in a thread with a timeout, known gaps, and the report."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, cast, runtime_checkable

from backends.tokenizer import Tokenizer
from backends.types import Json

if TYPE_CHECKING:
    import tinker

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class Future(Protocol[T_co]):
    """What wait() needs of an SDK future (tinker's APIFuture, the backcompat client futures, a concurrent Future)."""

    def result(self, timeout: float | None = None) -> T_co: ...


# Checks known to fail on a server, by the server's name (--server-name, else get_server_capabilities'
# `server_name` when it sends one): check -> why. A key "CHECK@sdk<X.Y.Z" applies only to SDKs older than X.Y.Z.
# Reported as "known gap", which does not fail the run.
KNOWN_GAPS: dict[str, dict[str, str]] = {
    "runner-serve": {},  # none: SDKs 0.25.0, 0.36.0 and 0.38.0 pass every check (docs/conformance.md)
}


def gap_reason(gaps: dict[str, str], check_name: str, sdk_version: str) -> str | None:
    """Why check_name is a known gap under this SDK version, or None."""
    from packaging.version import InvalidVersion, Version

    for key, reason in gaps.items():
        name, _, cond = key.partition("@")
        if name != check_name:
            continue
        if not cond:
            return reason
        if cond.startswith("sdk<"):
            try:
                if Version(sdk_version) < Version(cond.removeprefix("sdk<")):
                    return reason
            except InvalidVersion:
                continue
    return None

GROUPS = ("sessions", "ordering", "losses", "sampling", "checkpoints", "errors")


class Fail(Exception):
    """The server answered, but not as the SDK's documentation says it must."""


class Skip(Exception):
    """The check does not apply (the SDK version or the server lacks the feature)."""


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    group: str
    fn: Callable[[Ctx], str | None]
    timeout_s: float


CHECKS: list[Check] = []


def check(group: str, name: str, timeout_s: float = 60.0) -> Callable[[Callable[[Ctx], str | None]], Callable[[Ctx], str | None]]:
    """Register a check: fn(ctx) returns a detail line, or raises Fail / Skip."""
    if group not in GROUPS:
        raise ValueError(f"unknown conformance group {group!r}")

    def deco(fn: Callable[[Ctx], str | None]) -> Callable[[Ctx], str | None]:
        if any(c.name == name for c in CHECKS):
            raise ValueError(f"conformance check {name!r} is registered twice")
        CHECKS.append(Check(name, group, fn, timeout_s))
        return fn

    return deco


@dataclasses.dataclass
class Result:
    check: str
    group: str
    result: str  # "pass" | "FAIL" | "skip" | "known gap"
    detail: str
    seconds: float


@dataclasses.dataclass(frozen=True)
class Saved:
    """What the checkpoint checks share (runner/tools/conformance/checkpoints.py): the client that saved, the three
    paths it saved to, and its logprobs."""

    tc: tinker.TrainingClient
    ttl: str  # save_state with ttl_seconds=3600
    plain: str  # save_state
    sampler: str  # save_weights_for_sampler
    tag: str  # the names' random part
    datum: tinker.Datum
    ids: list[int]
    lp: list[float]  # the trainer's target logprobs of `datum` after the step


class Ctx:
    """What the checks share: the SDK module, a ServiceClient, the model under test, and lazily created
    clients (a training client per purpose, so one check's updates do not move another's numbers)."""

    def __init__(self, base_url: str, api_key: str, model: str | None, rtol: float = 2e-3, atol: float = 2e-3) -> None:
        import tinker

        self.tinker = tinker
        from importlib.metadata import version

        self.sdk_version = version("tinker")
        self.types = tinker.types
        self.base_url = base_url
        self.api_key = api_key
        self.requested_model = model
        self.rtol, self.atol = rtol, atol
        self.op_timeout = 45.0  # one SDK future; a check's own timeout bounds the whole check
        self._lock = self.lock = threading.RLock()
        # What several checks of a group share: the sampling group's sampler and greedy tokens, the checkpoint group's
        # saves (created on first use, under the lock).
        self.sampler: tinker.SamplingClient | None = None
        self.greedy: list[int] | None = None
        self.saved: Saved | None = None
        self._service: tinker.ServiceClient | None = None
        self._rest: tinker.RestClient | None = None
        self._model: str | None = None
        self._clients: dict[str, tinker.TrainingClient] = {}
        self._tokenizer: Tokenizer | None = None
        self._tokenizer_error: str | None = None

    # ------------------------------------------------------------ clients

    @property
    def service(self) -> tinker.ServiceClient:
        with self._lock:
            if self._service is None:
                self._service = self.tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)
            return self._service

    @property
    def rest(self) -> tinker.RestClient:
        with self._lock:
            if self._rest is None:  # SDKs before RestClient was public make it from the ServiceClient
                self._rest = (self.tinker.RestClient(base_url=self.base_url, api_key=self.api_key)
                              if hasattr(self.tinker, "RestClient") else self.service.create_rest_client())
            return self._rest

    def wait(self, fut: Future[T] | T, timeout: float | None = None) -> T:
        """An SDK future's result (never blocking past the timeout); older SDKs' creation methods block and
        return the client itself, which is passed through."""
        if isinstance(fut, Future):
            return fut.result(timeout=timeout or self.op_timeout)
        return fut

    def server_name(self) -> str | None:
        """The `server_name` field of get_server_capabilities' JSON as sent (the SDK's response type drops
        fields it does not know), or None."""
        import json
        import urllib.request

        req = urllib.request.Request(f"{self.base_url.rstrip('/')}/api/v1/get_server_capabilities",
                                     headers={"X-API-Key": self.api_key})
        try:
            with urllib.request.urlopen(req, timeout=15) as r:
                name = json.loads(r.read()).get("server_name")
        except Exception:  # noqa: BLE001 - the name is optional; the capabilities check reports a broken route
            return None
        return name if isinstance(name, str) and name else None

    def capabilities(self) -> tinker.types.GetServerCapabilitiesResponse:
        """RestClient's get_server_capabilities, or the ServiceClient's on SDKs whose RestClient lacks it."""
        if hasattr(self.rest, "get_server_capabilities"):
            return self.wait(self.rest.get_server_capabilities())
        return self.wait(self.service.get_server_capabilities())

    @property
    def model(self) -> str:
        with self._lock:
            if self._model is None:
                if self.requested_model:
                    self._model = self.requested_model
                else:
                    caps = self.capabilities()
                    names = [str(m.model_name) for m in caps.supported_models if m.model_name and getattr(m, "trainable", None) is not False]
                    if not names:
                        raise Fail("get_server_capabilities lists no trainable model (pass --model NAME)")
                    self._model = names[0]
            return self._model

    def training_client(self, purpose: str, rank: int = 4) -> tinker.TrainingClient:
        """One LoRA training client per purpose (seed 0), created on first use."""
        with self._lock:
            if purpose not in self._clients:
                self._clients[purpose] = self.wait(
                    self.service.create_lora_training_client(self.model, rank=rank, seed=0), timeout=120)
            return self._clients[purpose]

    def tokenizer(self) -> Tokenizer | None:
        with self._lock:
            if self._tokenizer is None and self._tokenizer_error is None:
                try:
                    # a Hugging Face tokenizer, which Tokenizer describes (as load_tokenizer's are)
                    self._tokenizer = cast("Tokenizer", self.training_client("main").get_tokenizer())
                except Exception as exc:  # noqa: BLE001 - reported by the tokenizer check; others use raw ids
                    self._tokenizer_error = f"{type(exc).__name__}: {exc}"
            return self._tokenizer

    def tokens(self, text: str, fallback: list[int]) -> list[int]:
        """The text's token ids, or fixed small ids when the tokenizer cannot be loaded (a hub download)."""
        tok = self.tokenizer()
        if tok is None:
            return list(fallback)
        ids = list(tok.encode(text, add_special_tokens=False))
        return ids or list(fallback)

    def close(self) -> None:
        if self._service is not None:
            try:
                self._service.close("success").result(timeout=15)
            except Exception:  # noqa: BLE001 - the report is already complete
                pass

    # ------------------------------------------------------------ data helpers

    def datum(self, ids: list[int], **inputs: Sequence[float]) -> tinker.Datum:
        """A next-token datum over ids (input ids[:-1], target ids[1:]); inputs are float32 arrays by key."""
        import numpy as np

        loss_inputs: Json = {"target_tokens": np.asarray(ids[1:], dtype=np.int64)}
        for k, v in inputs.items():
            loss_inputs[k] = np.asarray(v, dtype=np.float32)
        return self.types.Datum(model_input=self.types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=loss_inputs)

    def close_enough(self, got: float, want: float) -> bool:
        return abs(got - want) <= self.atol + self.rtol * abs(want)


def logprobs_of(out: tinker.ForwardBackwardOutput) -> list[list[float]]:
    """Per-datum target logprobs from a ForwardBackwardOutput."""
    return [[float(x) for x in o["logprobs"].to_numpy().reshape(-1)] for o in out.loss_fn_outputs]


def loss_sum(out: tinker.ForwardBackwardOutput) -> float:
    metrics = out.metrics or {}
    if "loss:sum" not in metrics:
        raise Fail(f"metrics have no 'loss:sum' (got {sorted(metrics)})")
    return float(metrics["loss:sum"])


# ------------------------------------------------------------ running


def _run_one(c: Check, ctx: Ctx) -> tuple[str, str]:
    box: dict[str, tuple[str, str]] = {}

    def target() -> None:
        try:
            box["r"] = ("pass", c.fn(ctx) or "")
        except Fail as exc:
            box["r"] = ("FAIL", str(exc))
        except Skip as exc:
            box["r"] = ("skip", str(exc))
        except Exception as exc:  # noqa: BLE001 - any SDK error the check did not expect is a failure
            box["r"] = ("FAIL", f"{type(exc).__name__}: {_one_line(str(exc))}")

    t = threading.Thread(target=target, name=f"conformance-{c.name}", daemon=True)
    t.start()
    t.join(c.timeout_s)
    if t.is_alive():  # the thread is abandoned (daemon); the suite goes on
        return "FAIL", f"no answer within {c.timeout_s:g}s (a hang; a 5xx is retried by the SDK for minutes)"
    return box.get("r", ("FAIL", "the check ended without a result"))


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def select(only: Iterable[str] = ()) -> list[Check]:
    """The registered checks, in registration order, filtered by group or check names. The group modules register
    their checks when the package is imported (runner/tools/conformance/__init__.py)."""
    CHECKS.sort(key=lambda c: GROUPS.index(c.group))  # stable: registration order within a group
    wanted = set(only)
    known = set(GROUPS) | {c.name for c in CHECKS}
    bad = sorted(wanted - known)
    if bad:
        from backends.errors import UserError

        raise UserError(f"--only {', '.join(bad)}: not a group or check (groups: {', '.join(GROUPS)})")
    return [c for c in CHECKS if not wanted or c.group in wanted or c.name in wanted]


def run_suite(ctx: Ctx, only: Iterable[str] = (), server_name: str | None = None,
              known_gaps: dict[str, dict[str, str]] | None = None,
              progress: Callable[[Result], None] | None = None,
              max_timeout_s: float | None = None) -> tuple[str, list[Result]]:
    """Run the checks (each within its timeout, or max_timeout_s when lower); returns the server name used for
    known gaps and one Result per check."""
    checks = select(only)
    results: list[Result] = []
    gaps_by_server = KNOWN_GAPS if known_gaps is None else known_gaps
    name = server_name or ctx.server_name()
    for c in checks:
        t0 = time.monotonic()
        if max_timeout_s is not None and max_timeout_s < c.timeout_s:
            c = dataclasses.replace(c, timeout_s=max_timeout_s)
        outcome, detail = _run_one(c, ctx)
        reason = gap_reason(gaps_by_server.get(name or "", {}), c.name, ctx.sdk_version)
        if outcome == "FAIL" and reason is not None:
            outcome, detail = "known gap", f"{reason} (observed: {detail})"
        r = Result(c.name, c.group, outcome, _one_line(detail), round(time.monotonic() - t0, 2))
        results.append(r)
        if progress is not None:
            progress(r)
    return name or "unknown", results


def failed(results: list[Result]) -> bool:
    return any(r.result == "FAIL" for r in results)


def format_table(results: list[Result], server: str) -> str:
    rows = [("check", "group", "result", "detail")] + [(r.check, r.group, r.result, r.detail) for r in results]
    w = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}".rstrip() for a, b, c, d in rows]
    counts = {k: sum(r.result == k for r in results) for k in ("pass", "FAIL", "skip", "known gap")}
    lines.append(f"server {server}: {counts['pass']} passed, {counts['FAIL']} failed, {counts['skip']} skipped, "
                 f"{counts['known gap']} known gaps")
    return "\n".join(lines)


def to_json(results: list[Result], server: str, sdk_version: str) -> str:
    return json.dumps({"server": server, "sdk_version": sdk_version,
                       "results": [dataclasses.asdict(r) for r in results]}, indent=2)
