"""A backend wrapper that simulates a crash, for resume tests (SFT: test_resume.py, RL: test_rl_loop.py)."""

from __future__ import annotations

from typing import Any

from backends.base import BackendError


class CrashingBackend:
    """The wrapped backend, except that the training client's n-th forward_backward raises at submit (never,
    with crash_at None), and with `crash_loading_sampler` so does loading sampler weights by path (what RL's
    final eval does first after the last step)."""

    def __init__(self, inner: Any, crash_at: int | None, *, crash_loading_sampler: bool = False):
        self.inner, self.crash_at, self.crash_loading_sampler = inner, crash_at, crash_loading_sampler

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create_training_client(self, spec: Any) -> Any:
        if self.crash_at is None:
            return self.inner.create_training_client(spec)
        return self.inner.create_training_client(spec).map(lambda tc: CrashingClient(tc, self.crash_at))

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None) -> Any:
        if self.crash_loading_sampler and model_path is not None:
            raise BackendError("simulated crash", request="create_sampling_client")
        return self.inner.create_sampling_client(model_path=model_path, base_model=base_model)


class CrashingClient:
    def __init__(self, inner: Any, crash_at: int):
        self.inner, self.left = inner, crash_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_backward(self, *args: Any, **kwargs: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise BackendError("simulated crash", request="forward_backward")
        return self.inner.forward_backward(*args, **kwargs)
