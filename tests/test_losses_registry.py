"""The loss registry (backends/losses.py): one entry per loss, read by the recipe schema, RL, the local backend, the
fake, `runner serve` and the Tinker adapter. A loss registered here, in a test module, trains on the local backend
and is named from a recipe; every registered loss gives the same values in local, fake and serve."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from backends import losses
from backends.fake import FakeBackend
from backends.local.backend import LocalBackend
from backends.local.local_config import Local
from backends.types import LOSS_FNS, AdamParams, Datum, LoraSpec
from runner.algos.rl_config import RL, PythonLoss

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
WAIT = 120


# A user's loss: that module is all it takes (no backend, schema or RL edit). Importing it registers it.
from custom_loss import LINEAR_PG, _linear_pg


def rl_data(rng: np.random.Generator, masked: bool) -> list[Datum]:
    out = []
    for n in (9, 5, 12):
        seq = rng.integers(10, 250, n + 1)
        mask = (np.arange(n) >= 2).astype(np.float32) if masked else None
        out.append(Datum(model_input=seq[:-1].tolist(), target_tokens=seq[1:], logprobs=rng.normal(-3, 0.5, n),
                         advantages=rng.normal(0, 1, n), mask=mask))
    return out


def sft_data(rng: np.random.Generator, masked: bool) -> list[Datum]:
    seqs = [rng.integers(10, 250, n + 1) for n in (7, 11)]
    return [Datum(model_input=s[:-1].tolist(), target_tokens=s[1:], weights=rng.uniform(0, 1, len(s) - 1),
                  mask=(np.arange(len(s) - 1) % 3 != 0).astype(np.float32) if masked else None) for s in seqs]


def data_for(spec: losses.LossSpec, masked: bool) -> list[Datum]:
    rng = np.random.default_rng(0)
    return sft_data(rng, masked) if "weights" in spec.inputs else rl_data(rng, masked)


def configs(spec: losses.LossSpec) -> list[dict[str, float] | None]:
    """The defaults, and every key moved off its default (so a backend that ignored the config would differ)."""
    if not spec.fields:
        return [None]
    moved = {f.key: f.default * 1.25 + 0.1 for f in spec.fields}
    if spec.rule is not None and spec.rule(moved):
        moved = {f.key: f.default + 0.05 * (i + 1) for i, f in enumerate(spec.fields)}
    return [None, moved]


def expected(spec: losses.LossSpec, data: list[Datum], lps: list[np.ndarray], config: dict[str, float] | None) -> float:
    """The registry's formula on the logprobs the backend reported, in float64, datum by datum."""
    cfg = spec.resolve(config)

    def t(x):
        return None if x is None else torch.as_tensor(np.asarray(x, np.float64))

    return sum(float(spec.masked_sum(t(lp), losses.LossInputs(t(d.weights), t(d.logprobs), t(d.advantages),
                                                              t(d.mask)), cfg)) for d, lp in zip(data, lps))


def cases() -> list[tuple[str, dict[str, float] | None]]:
    return [(spec.name, cfg) for spec in losses.specs() for cfg in configs(spec)]


# ---------------------------------------------------------------- the registry itself


def test_registry_entries():
    assert list(LOSS_FNS)[:5] == ["cispo", "cross_entropy", "dro", "importance_sampling", "ppo"]  # file-name order
    assert "test_linear_pg" in LOSS_FNS  # the live view follows registrations
    assert losses.get("ppo").resolve(None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    with pytest.raises(ValueError, match="unknown loss_fn 'grpo'; expected one of: cispo, cross_entropy, "):
        losses.get("grpo")
    with pytest.raises(ValueError, match="takes no config key 'clip_hi'"):
        losses.get("ppo").resolve({"clip_hi": 1.3})
    with pytest.raises(ValueError, match="clip_low must be < clip_high"):
        losses.get("cispo").resolve({"clip_low_threshold": 5.0})
    with pytest.raises(ValueError, match=r"beta must be > 0"):
        losses.get("dro").resolve({"beta": 0.0})
    with pytest.raises(ValueError, match="a different loss is already registered as 'ppo'"):
        losses.register(losses.LossSpec("ppo", _linear_pg))
    assert losses.register(LINEAR_PG) is LINEAR_PG  # idempotent
    # `spec(**config)` is the resolved config, so `runner check` can check a recipe's args against its signature.
    assert LINEAR_PG(coef=2) == {"coef": 2.0, "tau": 0.0}


def test_schema_variants_come_from_the_registry():
    rl = msgspec.convert({"env": {"kind": "arithmetic"}, "loss": {"kind": "dro", "beta": 0.2}}, RL)
    assert type(rl.loss).__name__ == "DRO" and getattr(rl.loss, "beta") == 0.2
    with pytest.raises(msgspec.ValidationError, match="clip_low must be < clip_high"):
        msgspec.convert({"env": {"kind": "arithmetic"}, "loss": {"kind": "ppo", "clip_low": 1.5}}, RL)
    from runner.algos.rl import loss_of

    assert loss_of(msgspec.convert({"env": {"kind": "arithmetic"}, "loss": {"kind": "cispo", "clip_high": 3}}, RL)) \
        == ("cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 3.0})
    assert loss_of(RL(env=rl.env)) == ("importance_sampling", None)
    user = RL(env=rl.env, loss=PythonLoss(target="custom_loss:LINEAR_PG", args={"tau": 0.5}))
    assert loss_of(user) == ("test_linear_pg", {"coef": 1.0, "tau": 0.5})


# ---------------------------------------------------------------- a user's loss, end to end


def test_user_loss_trains_one_step_on_the_local_backend(tmp_path):
    be = LocalBackend(Local(), "tiny", None, tmp_path, seed=0)
    try:
        tc = be.create_training_client(LoraSpec(base_model="tiny", rank=2, seed=1)).result(WAIT)
        data = rl_data(np.random.default_rng(1), masked=True)
        config = {"coef": 2.0, "tau": 0.1}
        fb = tc.forward_backward(data, "test_linear_pg", config).result(WAIT)
        assert fb.metrics["loss:sum"] == pytest.approx(expected(LINEAR_PG, data, fb.logprobs, config), rel=1e-5)
        assert tc.optim_step(AdamParams(learning_rate=1e-2)).result(WAIT).metrics["grad_norm:mean"] > 0
        after = tc.forward(data, "test_linear_pg", config).result(WAIT)
        assert after.metrics["loss:sum"] < fb.metrics["loss:sum"]  # one step moved the loss down
        with pytest.raises(Exception, match="takes no config key 'beta'"):
            tc.forward(data, "test_linear_pg", {"beta": 1.0}).result(WAIT)
    finally:
        be.close()


RECIPE = """
[recipes.custom_loss]
max_steps = 1
[recipes.custom_loss.algo]
kind = "rl"
env = {{ kind = "arithmetic" }}
loss = {{ kind = "python", target = "{target}", args = {args} }}
"""


@pytest.mark.parametrize(("target", "args", "error"), [
    ("custom_loss:LINEAR_PG", "{ coef = 0.5 }", None),
    ("custom_loss:LINEAR_PG", "{ beta = 0.5 }", "cannot be called with args ['beta']"),
    ("custom_loss:NO_SUCH", "{}", "cannot import 'custom_loss:NO_SUCH'"),
    ("custom_loss:NOT_A_LOSS", "{}", "'custom_loss:NOT_A_LOSS' is int, not a callable"),
])
def test_runner_check_names_a_user_loss(tmp_path, target, args, error):
    (tmp_path / "r.toml").write_text(RECIPE.format(target=target, args=args))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    proc = subprocess.run([sys.executable, "-m", "runner", "check", "r.toml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    if error is None:
        assert proc.returncode == 0 and "ok  r.toml#custom_loss" in proc.stdout, proc.stderr
    else:
        assert proc.returncode == 2 and error in proc.stderr and "algo.loss" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- the same values everywhere


@pytest.fixture(scope="module")
def local_tc(tmp_path_factory):
    be = LocalBackend(Local(), "tiny", None, tmp_path_factory.mktemp("local"), seed=0)
    yield be.create_training_client(LoraSpec(base_model="tiny", rank=4, seed=0)).result(WAIT)
    be.close()


@pytest.fixture(scope="module")
def fake_tc():
    be = FakeBackend(vocab=300)
    yield be.create_training_client(LoraSpec(base_model="tiny", rank=4, seed=0)).result(WAIT)
    be.close()


@pytest.fixture(scope="module")
def serve_tc(tmp_path_factory):
    tinker = pytest.importorskip("tinker")
    from backends.serve.http import ServeConfig, build_service, running

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    service = build_service(ServeConfig(storage=tmp_path_factory.mktemp("serve"), device="cpu"))
    with running(service) as srv:
        client = tinker.ServiceClient(base_url=f"http://127.0.0.1:{srv.server_address[1]}", api_key="tml-test")
        yield client.create_lora_training_client("tiny", rank=4, seed=0).result()
        client.close("success").result(timeout=30)
    service.close()


@pytest.mark.parametrize(("name", "config"), cases(), ids=lambda v: v if isinstance(v, str) else str(v))
def test_every_loss_same_values_in_local_fake_and_serve(local_tc, fake_tc, serve_tc, name, config):
    from tinker import types as T

    spec = losses.get(name)
    for which, tc in (("local", local_tc), ("fake", fake_tc)):
        data = data_for(spec, masked=True)
        out = tc.forward(data, name, config).result(WAIT)
        want = expected(spec, data, out.logprobs, config)
        assert out.metrics["loss:sum"] == pytest.approx(want, rel=1e-4, abs=1e-4), which
    # runner serve, through the tinker SDK (Tinker's datums have no mask).
    data = data_for(spec, masked=False)
    tdata = [T.Datum(model_input=T.ModelInput.from_ints(d.model_input), loss_fn_inputs={
        k: T.TensorData.from_numpy(getattr(d, k)) for k in ("target_tokens", *spec.inputs)}) for d in data]
    out = serve_tc.forward(tdata, name, config).result()
    lps = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    assert out.metrics["loss:sum"] == pytest.approx(expected(spec, data, lps, config), rel=1e-4, abs=1e-4)
    # and serve's learner is the local backend's: the same logprobs on the same data and seed.
    local_lps = local_tc.forward(data, name, config).result(WAIT).logprobs
    for a, b in zip(lps, local_lps):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_fake_gradients_follow_the_registry():
    # The fake differentiates the registry's function (autograd): its gradient of Σ loss w.r.t. the logprobs is
    # the analytic one for dro, −(A − β·(lp − q)), masked.
    be = FakeBackend(vocab=300)
    tc = be.create_training_client(LoraSpec(base_model="tiny", rank=4, seed=0)).result(WAIT)
    data = rl_data(np.random.default_rng(3), masked=True)
    out, grads = tc._loss(data, "dro", {"beta": 0.3})
    for d, lp, g in zip(data, out.logprobs, grads):
        assert d.advantages is not None and d.logprobs is not None and d.mask is not None
        want = -(d.advantages - 0.3 * (lp.astype(np.float64) - d.logprobs)) * d.mask
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)
    be.close()
