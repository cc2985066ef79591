"""bench/gpu_check.py (the GPU device check of issue #28, docs/gpu.md) runs its steps and writes its report; here on
the CPU (--device cpu --quick), where the GPU box runs the same code on cuda. bench/gpu_wheels.sh names the wheels
the device image lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402


def test_cpu_figures_come_from_the_recipes_table():
    figures = gpu_check._cpu_figures()
    assert set(figures) == set(gpu_check.FULL)  # sl_basic, rl_basic, dpo_basic each with first, last, wall s
    assert all(float(w) > 0 for _, _, w in figures.values())


@pytest.mark.slow
def test_gpu_check_runs_its_steps_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    # The conformance step against `runner serve --dtype bfloat16` is tests/test_bf16.py's; here one step suffices.
    rc = gpu_check.main(["--device", "cpu", "--quick", "--steps", "smoke", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "| smoke on cpu (1 files) | pass |" in text and "| sft_tiny.toml#sft_tiny | 1 | 2 |" in text
    assert "- card: " in text and "torch " in text


def test_a_failing_step_fails_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "FULL", {"no_such_recipe": "test/nll"})
    out = tmp_path / "gpu.md"
    assert gpu_check.main(["--device", "cpu", "--quick", "--steps", "full", "--out", str(out)]) == 1
    assert "| no_such_recipe | test/nll | - | - |" in out.read_text() and "exit 2" in out.read_text()


def test_wheel_list_pins_what_the_device_lacks():
    pins = subprocess.run([str(REPO / "bench" / "gpu_wheels.sh"), "--list"], capture_output=True, text=True,
                          check=True).stdout.split()
    names = {p.split("==")[0] for p in pins}
    assert all("==" in p for p in pins) and len(names) == len(pins)
    assert {"msgspec", "tomli-w", "datasets", "tinker", "pydantic", "zstandard"} <= names
