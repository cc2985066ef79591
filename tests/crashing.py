"""A backend wrapper that simulates a crash, for resume tests (SFT: test_resume.py, RL: test_rl_loop.py)."""

from __future__ import annotations

from typing import Any

from backends.base import BackendError


class CrashingBackend:
    """The wrapped backend, except that the training client's n-th forward_backward raises at submit."""

    def __init__(self, inner: Any, crash_at: int):
        self.inner, self.crash_at = inner, crash_at

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def create_training_client(self, spec: Any) -> Any:
        return self.inner.create_training_client(spec).map(lambda tc: CrashingClient(tc, self.crash_at))


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
