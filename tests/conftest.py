"""Tests run torch the way `runner run` does: OpenMP threads wait passively (runner/threads.py), which also
keeps the suite from crawling when the machine's cores are shared."""

from runner.threads import prefer_passive_openmp

prefer_passive_openmp()

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tinker_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """backends/serve's Tinker service over the tiny model (tests/tinker_mock.py), one per test session: loading the
    model once keeps the Tinker tests fast, and every test gets its own sessions and runs on it."""
    from tinker_mock import shared_service

    with shared_service(tmp_path_factory.mktemp("tinker-service") / "storage") as service:
        yield service


@pytest.fixture
def mock_tinker(tinker_service: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The service behind a fresh fault-injecting MockTinker on its own port, with the env a Tinker recipe reads
    (a test key, the server's base URL, no telemetry)."""
    from tinker_mock import serve

    with serve(tinker_service) as mock:
        monkeypatch.setenv("TINKER_API_KEY", "tml-test-0123456789")
        monkeypatch.setenv("TINKER_BASE_URL", mock.url)
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        yield mock


@pytest.fixture
def mocked_tinker(mock_tinker: Any) -> None:
    """The real tinker SDK against the emulated service, for tests that need only the env."""


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Torch at one intra-op thread, as the local backend runs its samplers on the CPU: what the sampler's
    bit-exact batch invariance is promised (and measured) for. At 2 threads it held with transformers 5.23
    but not with 4.56-5.21, whose attention code takes other kernels."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
