"""A user's backend (`backend = {kind = "python"}`) that breaks the protocol of backends/base.py is one line naming
the target, the call and what it returned, exit 2 (runner/recipe/backend_guard.py); before, a traceback from deep
in the loop. A KeyboardInterrupt out of the backend's own future is its error, not the user's Ctrl-C (was exit 130).
Each backend is the fake (backends/fake.py) with one thing broken."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from runner.cli import main

BAD = '''
import concurrent.futures
from backends.base import Future
from backends.fake import FakeBackend
from backends.tokenizer import load_tokenizer
from backends.types import ForwardBackwardOutput, OptimStepOutput, SampledSequence, SampleOutput


def interrupted():
    f = concurrent.futures.Future()
    f.set_exception(KeyboardInterrupt())
    return Future(f)


class Training:
    def __init__(self, inner, mode):
        self.inner, self.mode = inner, mode

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def optim_step(self, params):
        out = self.inner.optim_step(params)
        if self.mode == "metric_str":
            return out.map(lambda o: OptimStepOutput({"grad_norm:mean": "big"}))
        if self.mode == "optim_none":
            return None
        return out

    def forward_backward(self, data, loss_fn, loss_config=None):
        if self.mode == "interrupt":
            return interrupted()
        out = self.inner.forward_backward(data, loss_fn, loss_config)
        if self.mode == "fb_short":
            return out.map(lambda o: ForwardBackwardOutput(o.logprobs[:-1], o.metrics))
        return out

    def save_weights_and_get_sampling_client(self):
        return self.inner.save_weights_and_get_sampling_client().map(lambda c: Sampling(c, self.mode))


class Sampling:
    def __init__(self, inner, mode):
        self.inner, self.mode = inner, mode

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample(self, prompt, num_samples, params):
        out = self.inner.sample(prompt, num_samples, params)
        if self.mode == "sample_short":
            return out.map(lambda o: SampleOutput([SampledSequence(s.tokens, s.logprobs[:-1], s.stop_reason)
                                                   for s in o.sequences]))
        return out


class Breaks(FakeBackend):
    def __init__(self, tokenizer, storage_dir, mode):
        super().__init__(tokenizer, storage_dir=storage_dir)
        self.mode = mode

    def create_training_client(self, spec):
        if self.mode == "client_none":
            return None
        return super().create_training_client(spec).map(lambda c: Training(c, self.mode))

    def create_sampling_client(self, model_path=None, base_model=None):
        return super().create_sampling_client(model_path, base_model).map(lambda c: Sampling(c, self.mode))


def make(model, tokenizer, storage_dir, seed, mode="ok"):
    return Breaks(load_tokenizer(tokenizer or model), storage_dir, mode)
'''

RECIPES = '''
[recipes.sft]
backend = {kind = "python", target = "badbackend:make"}
max_steps = 2
eval_every = 0
save_every = 0
algo = {kind = "sft", data = {kind = "jsonl", path = "chat.jsonl"}, batch_size = 2, test_size = 0}

[recipes.rl]
backend = {kind = "python", target = "badbackend:make"}
max_steps = 1
eval_every = 0
save_every = 0
algo = {kind = "rl", env = {kind = "arithmetic", max_value = 9, test_size = 0}, group_size = 2, groups_per_batch = 2, max_tokens = 4}
'''

WHERE = "backend target 'badbackend:make'"


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "badbackend.py").write_text(BAD)
    (tmp_path / "r.toml").write_text(RECIPES)
    (tmp_path / "chat.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n' * 6)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("badbackend", None)


def test_a_backend_that_keeps_the_protocol_runs(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The checks pass a backend that keeps it (the wrappers of the broken ones, unbroken), SFT and RL."""
    assert main(["run", "r.toml#sft"]) == 0
    assert main(["run", "r.toml#rl"]) == 0


@pytest.mark.parametrize(("recipe", "mode", "message"), [
    ("sft", "client_none", "create_training_client() returned None, not a backends.base.Future (backends/base.py)"),
    ("sft", "optim_none", "optim_step() returned None, not a backends.base.Future"),
    ("sft", "metric_str", "optim_step() returned the metric 'grad_norm:mean' = str 'big', not a number"),
    ("sft", "fb_short", "forward_backward() gave logprobs for 1 datums of 2"),
    ("rl", "sample_short", "sample() gave 3 logprobs for 4 tokens (one per token: backends/base.py)"),
    ("sft", "interrupt", "forward_backward() raised KeyboardInterrupt (the backend's own, not a Ctrl-C)"),
])
def test_a_backend_that_breaks_the_protocol_is_one_line(proj: Path, capsys: pytest.CaptureFixture[str], recipe: str,
                                                        mode: str, message: str) -> None:
    capsys.readouterr()
    assert main(["run", f"r.toml#{recipe}", f"backend.args.mode={mode}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: r.toml#{recipe}: {WHERE}: {message}"), err
    assert "Traceback" not in "\n".join(err)
