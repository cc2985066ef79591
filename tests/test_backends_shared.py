"""The same loop tests on both backends.

`local` is backends/local in process. `tinker` is backends/tinker/backend.py driving the real tinker SDK over
real HTTP against backends/serve (what `runner serve` runs; tests/tinker_mock.py injects faults in front of it),
whose engine is a LocalBackend on the same tiny model: every byte crosses the SDK's protobuf/JSON wire and the
service's promise/poll/seq-id machinery, yet the math is the local backend's, so the two must agree number for
number.

Run: python -m pytest tests/test_backends_shared.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import concurrent.futures
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tinker_mock import MockTinker

from backends.base import BackendError, Future
from backends.errors import UserError
from backends.local.local_config import Local
from runner.engine.loop import run
from runner.recipe.schema import Recipe
from scripts.tiny_build import sft_conversations

STEPS = 4


@dataclass
class Service:
    kind: str
    mock: MockTinker | None = None


def start(kind: str, request: pytest.FixtureRequest) -> Service:
    """The tinker kind's service: the session's backends/serve behind this test's MockTinker (the mock_tinker fixture
    also points TINKER_BASE_URL at it)."""
    return Service(kind) if kind == "local" else Service(kind, request.getfixturevalue("mock_tinker"))


@pytest.fixture(params=["local", "tinker"])
def service(request) -> Service:
    return start(request.param, request)


def recipe_for(tmp_path: Path, kind: str, run_dir: str, **over: Any) -> Recipe:
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in sft_conversations(24, seed=1)))
    backend = {"kind": "local", "device": "cpu"} if kind == "local" else {"kind": "tinker"}
    return msgspec.convert({
        "algo": {"kind": "sft", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4, "test_size": 4,
                 "max_length": 96},
        "lr": 5e-3, "lora": {"rank": 4}, "max_steps": STEPS, "eval_every": 2, "save_every": 2, "depth": 2,
        "backend": backend, "log_dir": str(tmp_path / run_dir), **over,
    }, Recipe)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows without timings and prices (the local backend logs a $0 cost, a Tinker model without a price none);
    token counts stay: the same recipe submits the same tokens over either backend."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "cost/"))} for r in rows]


def checkpoints(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "checkpoints.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_sft_learns_and_checkpoints(service, tmp_path):
    run(recipe_for(tmp_path, service.kind, "run"), "r")
    rows = metrics(tmp_path / "run")
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == STEPS and nll[-1] < nll[0], nll
    # Evaluated at steps 0 and 2, then the final weights at step 4 (its own row).
    test = [(r["step"], r["test/nll"]) for r in rows if "test/nll" in r]
    assert [s for s, _ in test] == [0, 2, 4] and test[-1][1] < test[0][1], test
    ckpts = checkpoints(tmp_path / "run")
    assert [c["next_step"] for c in ckpts] == [2, 4]
    if service.kind == "local":
        assert all((tmp_path / "run" / c["state_path"]).exists() for c in ckpts)
        return
    mock = service.mock
    assert all(c["state_path"].startswith("tinker://") and "/weights/" in c["state_path"] for c in ckpts)
    assert all(c["sampler_path"].startswith("tinker://") and "/sampler_weights/" in c["sampler_path"] for c in ckpts)
    # One FIFO on the service: every training request in seq order, none lost, none repeated.
    training = mock.submits("forward_backward", "optim_step", "save_weights", "save_weights_for_sampler")
    assert [r.seq_id for r in training] == list(range(1, len(training) + 1))
    kinds = ["forward" if r.forward_only else r.route for r in training]
    assert kinds.count("forward_backward") == kinds.count("optim_step") == STEPS
    # fb and optim of a step alternate strictly. An eval's forward (or a save) may land between a step's fb and its
    # optim when the loop's tasks interleave under load: harmless, only optim_step changes the weights (and
    # test_tinker_matches_local checks the numbers). The periodic save is the final one's TTL'd sibling.
    assert [k for k in kinds if k in ("forward_backward", "optim_step")] == ["forward_backward", "optim_step"] * STEPS, kinds
    ttls = [r.body.get("ttl_seconds") for r in training if r.route == "save_weights"]
    assert ttls == [7 * 24 * 3600, None]
    assert mock.finished[-1]["reason"] == {"type": "success"}


def test_tinker_matches_local(tmp_path, mock_tinker):
    """Same recipe, same seed, same math: the Tinker wire changes nothing in the numbers."""
    run(recipe_for(tmp_path, "local", "local"), "r")
    run(recipe_for(tmp_path, "tinker", "tinker"), "r")
    assert metrics(tmp_path / "tinker") == metrics(tmp_path / "local")


class FailingBackend:
    """The local backend, except that its n-th forward_backward fails as a service would report it."""

    def __init__(self, inner: Any, fail_after: int):
        self.inner, self.fail_after = inner, fail_after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create_training_client(self, spec):
        return self.inner.create_training_client(spec).map(lambda tc: FailingClient(tc, self.fail_after))


class FailingClient:
    def __init__(self, inner: Any, left: int):
        self.inner, self.left = inner, left

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_backward(self, *args, **kwargs):
        self.left -= 1
        if self.left < 0:  # as a service failure arrives: through the future, not at submit
            failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
            failed.set_exception(BackendError("forward_backward #4: request failed on the server: worker lost",
                                              "forward_backward #4"))
            return Future(failed)
        return self.inner.forward_backward(*args, **kwargs)


def test_backend_failure_keeps_checkpoint_and_resumes(service, tmp_path):
    run(recipe_for(tmp_path, service.kind, "straight"), "r")
    want = metrics(tmp_path / "straight")

    recipe = recipe_for(tmp_path, service.kind, "crashed")
    backend = None
    if service.kind == "local":
        from backends.local import LocalBackend

        inner = LocalBackend(recipe.backend, recipe.model, recipe.tokenizer, tmp_path / "crashed" / "checkpoints")
        backend = FailingBackend(inner, fail_after=3)
    else:
        service.mock.faults.fail_after["forward_backward"] = (3, "server", "worker lost")
    with pytest.raises(BackendError, match="forward_backward #4: request failed on the server: worker lost"):
        run(recipe, "r", backend=backend)
    # Steps before the failure are logged, their checkpoint is recorded and usable; nothing after it.
    ckpts = checkpoints(tmp_path / "crashed")
    assert [c["next_step"] for c in ckpts] == [2]
    assert len(metrics(tmp_path / "crashed")) == STEPS - 1
    if service.mock is not None:
        assert service.mock.finished[-1]["reason"] == {"type": "errored"}
    run(recipe, "r")  # resumes from the checkpoint on a fresh backend (a new session on the service)
    assert metrics(tmp_path / "crashed") == want


def test_user_category_failure_is_a_user_error(tmp_path, mock_tinker):
    """What the service rejects as the user's fault ends the run as a one-line UserError (exit 2)."""
    mock_tinker.faults.fail_after["forward_backward"] = (1, "user", "sequence longer than the model's context")
    with pytest.raises(UserError, match="forward_backward #2.*server rejected request: sequence longer") as err:
        run(recipe_for(tmp_path, "tinker", "run"), "r")
    assert str(err.value).count("forward_backward #2") == 1  # named once, not once per layer



def backend_for(service: Service, tmp_path: Path) -> Any:
    from backends.local import LocalBackend
    from backends.tinker import TinkerBackend
    from backends.tinker.tinker_config import Tinker

    if service.kind == "local":
        return LocalBackend(Local(device="cpu"), "tiny", None, tmp_path / "direct", seed=0)
    return TinkerBackend(Tinker(), "tiny", None)


def rl_steps(backend: Any, steps: int = 3) -> list[tuple[list[list[int]], float]]:
    """A bare RL loop on the protocol (the RL algorithm is not in runner/engine/loop.py yet): sample a group
    from the current weights, reward 'a'-heavy answers, importance-sampling step. Per step: the
    sampled tokens and the loss."""
    import numpy as np

    from backends.types import AdamParams, Datum, LoraSpec, SamplingParams

    tok = backend.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "say a"}], tokenize=False, add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    target = tok.convert_tokens_to_ids("a")
    tc = backend.create_training_client(LoraSpec(base_model="tiny", rank=4, seed=0)).result(60)
    out = []
    for step in range(steps):
        sampler = tc.save_weights_and_get_sampling_client().result(60)
        group_G = sampler.sample(prompt, 4, SamplingParams(max_tokens=8, seed=step)).result(60).sequences
        rewards_G = np.array([np.mean([t == target for t in s.tokens]) for s in group_G])
        advantages_G = rewards_G - rewards_G.mean()
        data_D = []
        for s, adv in zip(group_G, advantages_G, strict=True):
            full_T = prompt + s.tokens
            n = len(full_T) - 1
            action_T = np.array([0.0] * (len(prompt) - 1) + [1.0] * len(s.tokens), np.float32)
            data_D.append(Datum(model_input=full_T[:-1], target_tokens=np.array(full_T[1:]),
                                logprobs=np.array([0.0] * (len(prompt) - 1) + s.logprobs, np.float32),
                                advantages=np.full(n, adv, np.float32) * action_T, mask=action_T))
        fb = tc.forward_backward(data_D, "importance_sampling")
        tc.optim_step(AdamParams(learning_rate=1e-2)).result(60)
        out.append(([s.tokens for s in group_G], fb.result(60).metrics["loss:sum"]))
    return out


def test_rl_steps_match_across_backends(tmp_path, request):
    """Sampling (seeded), the ratio loss and snapshots agree between the two backends, step by step."""
    runs = {}
    for kind in ("local", "tinker"):
        backend = backend_for(start(kind, request), tmp_path)
        try:
            runs[kind] = rl_steps(backend)
        finally:
            backend.close()
    assert [t for t, _ in runs["tinker"]] == [t for t, _ in runs["local"]]
    assert [loss for _, loss in runs["tinker"]] == pytest.approx([loss for _, loss in runs["local"]], abs=1e-5)
    assert len({str(t) for t, _ in runs["local"]}) == 3  # each step samples afresh


def rl_recipe_for(tmp_path: Path, kind: str, run_dir: str) -> Recipe:
    backend = {"kind": "local", "device": "cpu"} if kind == "local" else {"kind": "tinker"}
    return msgspec.convert({
        "algo": {"kind": "rl", "env": {"kind": "arithmetic", "max_value": 9, "test_size": 2}, "group_size": 2,
                 "groups_per_batch": 2, "max_tokens": 6, "groups_to_log": 1},
        "lr": 5e-3, "lora": {"rank": 4}, "max_steps": 2, "eval_every": 1, "save_every": 1, "depth": 1,
        "schedule": {"kind": "constant"}, "backend": backend, "log_dir": str(tmp_path / run_dir),
    }, Recipe)


def test_rl_tinker_matches_local(tmp_path, mock_tinker):
    """The RL algorithm over the Tinker wire: same samples, rewards and evals as local; logprob-derived numbers
    to float noise (the sampler batches concurrent requests differently when they arrive one HTTP call each)."""
    run(rl_recipe_for(tmp_path, "local", "local"), "r")
    run(rl_recipe_for(tmp_path, "tinker", "tinker"), "r")
    got, want = metrics(tmp_path / "tinker"), metrics(tmp_path / "local")
    assert [sorted(r) for r in got] == [sorted(r) for r in want] and len(want) == 3  # 2 steps + the final eval
    for g, w in zip(got, want, strict=True):
        for k, v in w.items():
            exact = k.startswith(("env/", "test/env/", "progress/", "sampling_client/")) or k == "step"
            assert g[k] == (v if exact else pytest.approx(v, rel=1e-3, abs=1e-4)), k
    assert "test/env/all/reward/total" in want[0] and "optim/kl_sample_train_v1" in want[0]
    assert [c["next_step"] for c in checkpoints(tmp_path / "tinker")] == [1, 2]
    # Per step: fb, optim, then the next step's sampler snapshot, in one FIFO with the saves.
    kinds = [r.route for r in mock_tinker.submits("forward_backward", "optim_step", "save_weights_for_sampler")]
    assert kinds.count("forward_backward") == kinds.count("optim_step") == 2
    assert (tmp_path / "tinker" / "iteration_000001" / "train.html").exists()


KEY = "tml-secret-key-that-must-not-leak-0123456789"


def test_cli_runs_sft_and_rl_against_a_tinker_compatible_http_server(tmp_path, monkeypatch, mock_tinker):
    """`runner run` with backend.base_url pointing at a Tinker-compatible server on 127.0.0.1 (real sockets,
    the SDK's pyqwest transport): SFT and RL both finish, and no file in either run dir holds the API key."""
    from runner.cli import main

    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.delenv("TINKER_BASE_URL")
    monkeypatch.chdir(tmp_path)
    url = mock_tinker.url
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_conversations(12, seed=2)))
    (tmp_path / "r.toml").write_text(f"""
[recipes.sft]
max_steps = 2
lr = 5e-3
tokenizer = "tiny"
backend = {{ kind = "tinker", base_url = "{url}" }}
lora = {{ rank = 4 }}
algo = {{ kind = "sft", data = {{ kind = "jsonl", path = "chat.jsonl" }}, batch_size = 4, max_length = 96 }}

[recipes.rl]
max_steps = 2
lr = 5e-3
tokenizer = "tiny"
backend = {{ kind = "tinker", base_url = "{url}" }}
lora = {{ rank = 4 }}
algo = {{ kind = "rl", env = {{ kind = "arithmetic", max_value = 9, test_size = 2 }}, group_size = 2, groups_per_batch = 2, max_tokens = 6 }}
""")
    for name in ("sft", "rl"):
        assert main(["run", f"r.toml#{name}"]) == 0
        run_dir = tmp_path / "runs" / name
        # Two steps; RL then logs its final eval (from the final tinker:// sampler weights) at step 2.
        assert [m["step"] for m in metrics(run_dir)] == ([0, 1] if name == "sft" else [0, 1, 2])
        assert checkpoints(run_dir)[-1]["state_path"].startswith("tinker://")
        for f in run_dir.rglob("*"):
            if f.is_file():
                assert KEY not in f.read_bytes().decode("utf-8", "replace"), f


def test_fake_backend_takes_a_negative_sampling_seed() -> None:
    """The SDK's SamplingParams.seed is any int; numpy's generators refuse a negative one (the fake crashed)."""
    from backends.fake import FakeBackend
    from backends.types import LoraSpec, SamplingParams

    backend = FakeBackend()
    sampler = backend.create_training_client(LoraSpec(base_model="tiny", seed=-5)).result() \
        .save_weights_and_get_sampling_client().result()
    a = sampler.sample([1, 2, 3], 2, SamplingParams(max_tokens=4, seed=-1)).result()
    b = sampler.sample([1, 2, 3], 2, SamplingParams(max_tokens=4, seed=-1)).result()
    assert a == b and len(a.sequences) == 2 and all(len(s.tokens) >= 1 for s in a.sequences)
