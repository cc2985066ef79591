"""Tests run torch the way `runner run` does: OpenMP threads wait passively (runner/threads.py), which also
keeps the suite from crawling when the machine's cores are shared."""

from runner.threads import prefer_passive_openmp

prefer_passive_openmp()

from collections.abc import Iterator

import pytest


@pytest.fixture
def mocked_tinker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The real tinker SDK against the respx-mocked service (tests/tinker_mock.py), with the env a Tinker recipe reads
    (a test key, the mock's base URL, no telemetry)."""
    from tinker_mock import BASE_URL, MockTinker, NumpyEngine, respx_tinker

    monkeypatch.setenv("TINKER_API_KEY", "tml-test-0123456789")
    monkeypatch.setenv("TINKER_BASE_URL", BASE_URL)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    with respx_tinker(MockTinker(NumpyEngine())):
        yield
