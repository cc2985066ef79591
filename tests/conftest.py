"""Tests run torch the way `runner run` does: OpenMP threads wait passively (runner/threads.py), which also
keeps the suite from crawling when the machine's cores are shared."""

from runner.threads import prefer_passive_openmp

prefer_passive_openmp()

import importlib.util
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import pytest

# The optional packages some tests need, by the name a test marks itself with (`@pytest.mark.extras("reasoning")`,
# or `pytestmark = pytest.mark.extras(...)` for a module): the modules that must import and the line that installs
# them. The README's test command installs `.[dev]` only, so these tests skip there, naming what is missing; `.ci/run`
# then installs them all and runs `pytest -m extras`.
EXTRAS = {
    "reasoning": (("reasoning_gym",), "pip install -e '.[reasoning]'"),
    "verifiers": (("verifiers",), "pip install -e '.[verifiers]'"),
    "inspect": (("inspect_ai",), "pip install -e '.[inspect]'"),
    "math": (("math_verify",), "pip install -e '.[math]'"),
    "lmeval": (("lm_eval",), "pip install -e '.[lmeval]'"),
    # Not an extra of runner: a peer the renderer, lr and serve tests compare against live (.ci/run's install line).
    "cookbook": (("tinker_cookbook",), "pip install --no-deps tinker-cookbook==0.6.1 chz termcolor"),
    "pyrage": (("pyrage",), "pip install pyrage"),
}


def missing_extra(name: str) -> str | None:
    """Why a test marked `extras(name)` cannot run here (the missing module and the install line), or None."""
    modules, install = EXTRAS[name]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return f"needs the `{name}` extra (missing {', '.join(missing)}): {install}" if missing else None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "extras(*names): needs optional packages (tests/conftest.py EXTRAS); skipped, "
                                       "naming them, where they are not installed; `pytest -m extras` runs these")


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("extras"):
        for name in mark.args:
            if name not in EXTRAS:
                raise pytest.UsageError(f"{item.nodeid}: unknown extra {name!r} (tests/conftest.py EXTRAS)")
            why = missing_extra(name)
            if why:
                pytest.skip(why)


@pytest.fixture(scope="session")
def tinker_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """backends/serve's Tinker service over the tiny model (tests/tinker_mock.py), one per test session: loading the
    model once keeps the Tinker tests fast, and every test gets its own sessions and runs on it."""
    from tinker_mock import shared_service

    with shared_service(tmp_path_factory.mktemp("tinker-service") / "storage") as service:
        yield service


MOCK = pytest.StashKey[Any]()


@pytest.fixture
def mock_tinker(tinker_service: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Iterator[Any]:
    """The service behind a fresh fault-injecting MockTinker on its own port, with the env a Tinker recipe reads
    (a test key, the server's base URL, no telemetry). A test that fails with it reports what the service saw and
    where every thread was (pytest_runtest_makereport)."""
    import msgspec
    from tinker_mock import serve

    from backends.tinker.backend import TinkerBackend
    from backends.tinker.options import TinkerOptions

    # A session the SDK has not created within the default 30 s on a loaded CI machine (seen once) fails the test;
    # here it may take 120 s (only a hung test waits that long). A connect_timeout_s other than the default (the
    # timeout tests' 1.5 s, 300 s) is left as it is.
    default_s, init = TinkerOptions().connect_timeout_s, TinkerBackend.__init__

    def patient(self: TinkerBackend, cfg: TinkerOptions, *args: Any, **kwargs: Any) -> None:
        init(self, msgspec.structs.replace(cfg, connect_timeout_s=120.0) if cfg.connect_timeout_s == default_s
             else cfg, *args, **kwargs)

    monkeypatch.setattr(TinkerBackend, "__init__", patient)
    with serve(tinker_service) as mock:
        request.node.stash[MOCK] = mock
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[None]:
    """A failed test that talked to the emulated Tinker service gets two more sections: the requests the service
    saw (route, status, seconds since the first) and every thread's stack at the failure. A rare stall (a session
    not created within connect_timeout_s on a loaded CI machine) then says where it stood."""
    report = yield
    mock = item.stash.get(MOCK, None)
    if mock is not None and report.when == "call" and report.failed:
        records = list(mock.records)
        t0 = records[0].t if records else time.monotonic()
        lines = [f"{r.t - t0:8.2f} s  {r.status}  {r.route}" for r in records[-60:]]
        report.sections.append(("tinker service requests (last 60)", "\n".join(lines) or "none"))
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = [f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                  for ident, frame in sys._current_frames().items()]
        report.sections.append(("threads at the failure", "\n".join(stacks)))
    return report
