"""The sampling floors (backends/types.py: TEMPERATURE_FLOOR, TOP_P_FLOOR) in the fake backend and at `runner
check`; the local sampler's are in tests/test_local_sampler.py (test_below_the_floors_is_greedy)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from backends.fake import FakeBackend
from backends.types import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, temperature=1e-40, stop=[]),
                                    SamplingParams(max_tokens=20, top_p=1e-300, stop=[]),
                                    SamplingParams(max_tokens=20, temperature=0.7, top_p=1e-9, stop=[])])
def test_fake_backend_applies_the_same_floors(params):
    """The fake backend's sampler follows the floors alike: the most likely token every step (before, top_p was
    ignored and 1e-300 sampled at temperature 1)."""
    client = FakeBackend(vocab=50).create_sampling_client().result()
    (s,) = client.sample([1, 2], 1, params).result().sequences
    assert s.tokens == [int(client.theta.argmax())] * 20
    assert all(math.isfinite(lp) for lp in s.logprobs)


@pytest.mark.parametrize(("value", "message"), [("inf", "algo: temperature must be finite, got inf"),
                                                ("nan", "algo.temperature: expected float > 0.0, got nan"),
                                                ("-1", "algo.temperature: expected float > 0.0, got -1")])
def test_check_refuses_non_finite_or_negative_temperature(value: str, message: str) -> None:
    """One line, exit 2 (inf passed check before and sampled uniformly); a temperature below the floor is fine:
    it samples greedily."""
    def check(*overrides: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run([sys.executable, "-m", "runner", "check", "recipes.toml#rl_basic", *overrides],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip

    bad = check(f"algo.temperature={value}")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [f"error: recipes.toml#rl_basic: {message}"]
    if value == "inf":
        assert check("algo.temperature=1e-40").returncode == 0
