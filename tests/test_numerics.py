"""The numerics gate (runner/rl/gate.py): every RL / distill step logs the sampler-vs-trainer logprob mismatch of
its sampled tokens; `numerics = {action = "warn" | "stop"}` acts on it; `runner numerics` runs the check alone.

A broken sampler is the local backend's, with every sampled logprob multiplied by 1.5 (BrokenBackend below): the
trainer's forward still sees the true model, so the two disagree as a mis-scaled sampler would.
On tiny (CPU, fp32) a healthy step's max |Δ| is ~1e-5 (measured: docs/numerics.md).

Run: pytest tests/test_numerics.py   (about 30 s on 2 cores: tiny, 2 steps, 2 groups of 2, 4 tokens)
"""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.base import Future
from backends.errors import UserError
from backends.local.local_config import Local
from backends.types import Datum, SampleOutput
from runner import cli
from runner.algos.rl_config import RL
from runner.recipe.load import load_recipe
from runner.recipe.numerics_table import Numerics
from runner.rl.gate import FRAC_KEY, Gate, dlogprob_metrics, on_policy

SCALE = 1.5


# ---------------------------------------------------------------- a sampler that mis-scales its logprobs

class BrokenSampler:
    def __init__(self, inner: Any):
        self.inner = inner

    def sample(self, prompt: list[int], num_samples: int, params: Any) -> Future[SampleOutput]:
        return self.inner.sample(prompt, num_samples, params).map(lambda out: SampleOutput(
            [replace(s, logprobs=[SCALE * x for x in s.logprobs]) for s in out.sequences]))

    def compute_logprobs(self, tokens: list[int]) -> Any:
        return self.inner.compute_logprobs(tokens)


class BrokenTraining:
    def __init__(self, inner: Any):
        self.inner = inner

    def save_weights_and_get_sampling_client(self) -> Future[Any]:
        return self.inner.save_weights_and_get_sampling_client().map(BrokenSampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class BrokenBackend:
    def __init__(self, inner: Any):
        self.inner = inner

    def create_training_client(self, *a: Any, **k: Any) -> Future[Any]:
        return self.inner.create_training_client(*a, **k).map(BrokenTraining)

    def create_training_client_from_state(self, *a: Any, **k: Any) -> Future[Any]:
        return self.inner.create_training_client_from_state(*a, **k).map(BrokenTraining)

    def create_sampling_client(self, *a: Any, **k: Any) -> Future[Any]:
        return self.inner.create_sampling_client(*a, **k).map(BrokenSampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every local backend a recipe makes (runner run, runner numerics) samples with mis-scaled logprobs."""
    make = Local.make
    monkeypatch.setattr(Local, "make", lambda self, *a, **k: BrokenBackend(make(self, *a, **k)))


DISTILL = """
[recipes.student]
max_steps = 2
save_every = 1
eval_every = 0
backend = {kind = "local", device = "cpu"}

[recipes.student.algo]
kind = "distill"
group_size = 2
max_tokens = 4
transcript_every = 0

[[recipes.student.algo.datasets]]
prompts = { kind = "jsonl", path = "PROMPTS" }
groups_per_batch = 2
"""

RECIPE = """
[recipes.gate]
max_steps = 2
save_every = 1
eval_every = 0
lr = 1e-3
backend = {kind = "local", device = "cpu"}

[recipes.gate.algo]
kind = "rl"
env = { kind = "arithmetic", max_value = 9, test_size = 0 }
group_size = 2
groups_per_batch = 2
max_tokens = 4
transcript_every = 0
"""


def recipe_file(tmp_path: Path) -> str:
    path = tmp_path / "gate.toml"
    path.write_text(RECIPE)
    return f"{path}#gate"


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------- the metrics and the gate, on hand-made numbers

def datum(sampled: list[float], mask: list[float]) -> Datum:
    n = len(sampled)
    return Datum(model_input=list(range(n)), target_tokens=np.arange(1, n + 1), logprobs=np.asarray(sampled),
                 advantages=np.zeros(n), mask=np.asarray(mask))


def test_metrics_on_action_tokens_only() -> None:
    d = datum([0.0, -1.0, -0.5, -2.0], [0, 1, 1, 1])
    m = dlogprob_metrics([d], [np.array([-9.0, -1.2, -0.5, -1.95])])  # Δ on actions: 0.2, 0, -0.05
    assert m["numerics/max_abs_dlogprob"] == pytest.approx(0.2, abs=1e-6)
    assert m["numerics/mean_abs_dlogprob"] == pytest.approx(0.25 / 3, abs=1e-6)
    assert m[FRAC_KEY] == pytest.approx(1 / 3)
    assert m["numerics/tokens"] == 3
    assert m["numerics/kl_sample_train_v1"] == pytest.approx(0.05, abs=1e-6)
    assert m["numerics/kl_sample_train_v2"] == pytest.approx(0.5 * (0.04 + 0.0025) / 3, abs=1e-6)
    assert dlogprob_metrics([], []) == {}


def test_on_policy_is_what_trained_before_the_first_optim_step() -> None:
    d = [datum([-1.0, -1.0], [0, 1]) for _ in range(5)]
    lp = [np.zeros(2) for _ in range(5)]
    # One submission of two substeps (its first chunk: 2 datums), or stream parts (no optim, then an optim).
    assert on_policy([(2, d[:4], lp[:4])])[0] == d[:2]
    assert on_policy([(None, d[:1], lp[:1]), (1, d[1:2], lp[1:2]), (1, d[2:3], lp[2:3])])[0] == d[:2]
    assert on_policy([(None, d, lp)])[0] == d


def step_metrics(v1: float, v2: float, max_abs: float) -> dict[str, float]:
    return {"numerics/kl_sample_train_v1": v1, "numerics/kl_sample_train_v2": v2, "numerics/max_abs_dlogprob": max_abs}


def test_gate_limits_after_steps_and_rate_limited_warnings() -> None:
    out = io.StringIO()
    gate = Gate(Numerics(max_kl=0.01, max_abs_dlogprob=0.5, action="warn", after_steps=1), warn_every_s=3600,
                stream=out)
    assert gate.check(0, step_metrics(1.0, 1.0, 9.0)) == {}  # before after_steps: not gated
    assert gate.check(1, step_metrics(-0.005, 0.001, 0.4)) == {"numerics/gate_failed": 0.0}
    # A negative v1 (a sampler whose logprobs are too low) fails as a positive one does.
    assert gate.check(2, step_metrics(-0.02, 0.001, 0.4)) == {"numerics/gate_failed": 1.0}
    assert gate.check(3, step_metrics(0.0, 0.0, 0.6)) == {"numerics/gate_failed": 1.0}
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "step 2" in lines[0] and "|kl_sample_train_v1| 0.02 > max_kl 0.01" in lines[0]
    gate.warn_every_s = 0.0
    gate.check(4, step_metrics(0.0, 0.02, 0.0))
    last = out.getvalue().splitlines()[-1]
    assert "step 4" in last and "kl_sample_train_v2 0.02" in last and "(1 more failing steps" in last
    with pytest.raises(UserError, match="numerics gate: step 5: .*max_abs_dlogprob 0.7 > 0.5.*last step that passed"):
        Gate(Numerics(max_abs_dlogprob=0.5, action="stop")).check(5, step_metrics(0.0, 0.0, 0.7))
    assert Gate(None).check(0, step_metrics(1.0, 1.0, 1.0)) == {}


def test_gate_needs_temperature_one(tmp_path: Path) -> None:
    ref = recipe_file(tmp_path)
    with pytest.raises(UserError, match="numerics: .*temperature = 1.*samples at 2"):
        load_recipe(ref, ['algo.numerics={action="stop"}', "algo.temperature=2"])
    _, ok = load_recipe(ref, ['algo.numerics={action="stop"}'])
    assert isinstance(ok.algo, RL) and ok.algo.numerics == Numerics(action="stop")


# ---------------------------------------------------------------- runs on the local backend (tiny, CPU)

def test_healthy_run_passes_the_stop_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(["run", recipe_file(tmp_path), f"log_dir={tmp_path / 'run'}",
                          'algo.numerics={action="stop", max_kl=1e-4, max_abs_dlogprob=1e-3}'], capsys)
    assert rc == 0, err
    ms = rows(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in ms] == [0, 1]
    for m in ms:
        assert m["numerics/gate_failed"] == 0.0 and m["numerics/tokens"] > 0
        assert m["numerics/max_abs_dlogprob"] < 1e-4 and abs(m["optim/kl_sample_train_v1"]) < 1e-5
        assert m[FRAC_KEY] == 0.0


def test_broken_sampler_is_stopped_keeping_the_last_good_checkpoint(tmp_path: Path, broken: None,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    rc, _, err = run_cli(["run", recipe_file(tmp_path), f"log_dir={run_dir}",
                          'algo.numerics={action="stop", after_steps=1}'], capsys)
    assert rc == 2
    [line] = [x for x in err.splitlines() if "numerics" in x]
    assert line.startswith("error: ") and "gate.toml#gate: numerics gate: step 1: " in line and "max_kl 0.01" in line
    assert sum("error" in x for x in err.splitlines()) == 1
    # Step 0 (before after_steps) was trained, logged and checkpointed; step 1 failed: no row, no checkpoint row.
    ms = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in ms] == [0]
    assert abs(ms[0]["optim/kl_sample_train_v1"]) > 0.01  # the mismatch was there, only not gated yet
    assert [c["next_step"] for c in rows(run_dir / "checkpoints.jsonl")] == [1]
    # The sampler fixed, the same command resumes from that checkpoint and finishes.
    monkeypatch.undo()
    rc, _, err = run_cli(["run", recipe_file(tmp_path), f"log_dir={run_dir}",
                          'algo.numerics={action="stop", after_steps=1}'], capsys)
    assert rc == 0 and "resuming" in err and "at step 1" in err, err
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [0, 1]
    assert rows(run_dir / "metrics.jsonl")[1]["numerics/gate_failed"] == 0.0


@pytest.mark.usefixtures("broken")
def test_broken_sampler_warns_and_goes_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    rc, _, err = run_cli(["run", recipe_file(tmp_path), f"log_dir={run_dir}", 'algo.numerics={action="warn"}'],
                         capsys)
    assert rc == 0, err
    warnings = [x for x in err.splitlines() if x.startswith("warning: numerics gate")]
    assert len(warnings) == 1 and "step 0" in warnings[0]  # rate-limited: step 1 failed too, within 60 s
    ms = rows(run_dir / "metrics.jsonl")
    assert [m["numerics/gate_failed"] for m in ms] == [1.0, 1.0]
    assert all(m["numerics/max_abs_dlogprob"] > 0.01 for m in ms)


def test_later_substeps_and_stale_samplers_are_not_gated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """optim/kl_sample_train_* spans the whole step, so a second substep (trained after the first's update) or an
    async sampler one step behind shows the policy's change; numerics/* and the gate see only on-policy tokens."""
    strict = 'algo.numerics={action="stop", max_kl=1e-4, max_abs_dlogprob=1e-3}'
    # Groups of 4, so the first substep's group is unlikely to have one reward for all (advantages all 0, no update).
    rc, _, err = run_cli(["run", recipe_file(tmp_path), f"log_dir={tmp_path / 'sub'}", "lr=0.05", "max_steps=1",
                          "algo.num_substeps=2", "algo.group_size=4", strict], capsys)
    assert rc == 0, err
    [m] = rows(tmp_path / "sub" / "metrics.jsonl")
    assert m["optim/num_substeps"] == 2 and m["numerics/gate_failed"] == 0.0
    assert abs(m["optim/kl_sample_train_v1"]) > 1e-3 and abs(m["numerics/kl_sample_train_v1"]) < 1e-5
    rc, _, err = run_cli(["run", recipe_file(tmp_path), f"log_dir={tmp_path / 'async'}", "lr=0.05", "algo.group_size=4",
                          'algo.mode={kind="async", max_staleness=1, fixed_staleness=true}', strict], capsys)
    assert rc == 0, err
    first, second = rows(tmp_path / "async" / "metrics.jsonl")
    assert first["numerics/gate_failed"] == 0.0 and "numerics/tokens" in first
    assert second["async/staleness_max"] == 1 and "numerics/tokens" not in second
    assert "numerics/gate_failed" not in second and abs(second["optim/kl_sample_train_v1"]) > 1e-3


@pytest.mark.usefixtures("broken")
def test_distill_steps_are_gated_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."}]}) + "\n"
                               for w in ["one", "two", "three", "four"]))
    path = tmp_path / "student.toml"
    path.write_text(DISTILL.replace("PROMPTS", str(prompts)))
    rc, _, err = run_cli(["run", f"{path}#student", f"log_dir={tmp_path / 'run'}", 'algo.numerics={action="stop"}'],
                         capsys)
    assert rc == 2 and f"error: {path}#student: numerics gate: step 0: " in err
    assert rows(tmp_path / "run" / "metrics.jsonl") == [] and rows(tmp_path / "run" / "checkpoints.jsonl") == []


# ---------------------------------------------------------------- runner numerics

def test_runner_numerics_table_on_a_healthy_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(["numerics", recipe_file(tmp_path), "--n", "3"], capsys)
    assert rc == 0, err
    assert "numerics check: tiny on local, 3 prompts" in out
    assert "sampler - trainer" in out and "worst tokens" in out and out.rstrip().endswith("ok (max_kl 0.01)")
    rc, out, _ = run_cli(["numerics", recipe_file(tmp_path), "--n", "3", "--json"], capsys)
    report = json.loads(out)
    st = report["pairs"]["sampler - trainer"]
    assert rc == 0 and report["failed"] == [] and st["tokens"] > 0 and st["max_abs"] < 1e-4
    assert len(report["worst"]) == min(5, int(st["tokens"]))


@pytest.mark.usefixtures("broken")
def test_runner_numerics_flags_a_broken_sampler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["numerics", recipe_file(tmp_path), "--n", "3", "--json"], capsys)
    report = json.loads(out)
    assert rc == 1 and report["failed"]
    # The sampler is off by (SCALE - 1)·lp; compute_logprobs and the trainer still agree with each other.
    worst = report["worst"][0]
    assert worst["sampler"] == pytest.approx(SCALE * worst["trainer"], rel=1e-3, abs=1e-5)
    assert report["pairs"]["compute_logprobs - trainer"]["max_abs"] < 1e-4
    rc, out, _ = run_cli(["numerics", recipe_file(tmp_path), "--n", "3"], capsys)
    assert rc == 1 and "FAILED: " in out.splitlines()[-1]


def test_runner_numerics_over_the_tinker_sdk(tmp_path: Path, mocked_tinker: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The same check through the Tinker adapter (backends/serve over the tiny model: its sampler and trainer agree)."""
    path = tmp_path / "gate.toml"
    path.write_text(RECIPE.replace('backend = {kind = "local", device = "cpu"}',
                                   'model = "Qwen/Qwen3-8B"\ntokenizer = "tiny"\nbackend = {kind = "tinker"}'))
    rc, out, err = run_cli(["numerics", f"{path}#gate", "--n", "2", "--json"], capsys)
    report = json.loads(out)
    assert rc == 0, err
    assert report["backend"] == "tinker" and report["pairs"]["sampler - trainer"]["tokens"] > 0
    assert report["pairs"]["sampler - trainer"]["max_abs"] < 1e-4
