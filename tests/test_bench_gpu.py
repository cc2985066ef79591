"""bench/bench_gpu.py runs end to end on the CPU with the tiny shape (its contenders agree on the first loss, or it
exits non-zero). That bench/bench_train.py imports (it once failed at import and nothing noticed) is checked by
tests/test_bench_scripts.py, with every other bench script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.slow  # a bench smoke: ~60 s (two contender processes), `pytest -m slow`
def test_bench_gpu_smokes_on_cpu():
    # Two training contenders (each a child process: ~5 s of imports on 2 cores), the ones the device check's speed
    # step compares; ours-before and hf-padded run the same child code with another step function.
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--shape", "tiny", "--quick",
                          "--rows", "2", "--rounds", "1", "--prompts", "2", "--new-tokens", "4", "--only", "hf-packed"],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")}
    assert {"ours-sdpa", "hf-packed", "ours", "ours-before", "generate"} <= rows, out.stdout
    assert "hf-padded" not in rows  # --only: the reference and the named ones
    assert "tiny: first loss ours-sdpa" in out.stdout
    assert "| first step (s) |" in out.stdout  # time to the first step, apart from the steady tokens/s
    assert "ours-sdpa / best hand loop: " in out.stdout  # the verdict line a device session decides on
    assert not (ROOT / "bench" / "results" / "gpu_speed.md").exists() or "CPU" not in (ROOT / "bench" / "results" / "gpu_speed.md").read_text()


@pytest.mark.slow  # a bench smoke: ~13 s
def test_a_contender_past_its_time_limit_is_reported_and_the_rest_run():
    """--contender-timeout: each contender's process group is killed at the limit (here before a child can even
    import torch) and reported as timed out; the bench goes on to the next and exits 0."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--shape", "tiny", "--quick", "--rows", "2",
                          "--rounds", "1", "--no-rl", "--no-sampling", "--only", "hf-packed", "--contender-timeout", "0.5"],
                         capture_output=True, text=True, env=_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ours-sdpa") or line.startswith("| hf-packed")]
    assert len(rows) == 2 and all("timed out after 0.5 s (first step not finished)" in r for r in rows), out.stdout


def test_the_hand_loops_packed_boundaries_stay_on_the_host(monkeypatch):
    """hf-packed, hf-flex and liger's attention functions read the packed row's boundaries with .tolist() in every
    layer; on CUDA boundaries on the device made that a host sync per layer. The inputs go to the device (here
    "meta", the only non-CPU device a CPU box has), the boundaries stay on the CPU. (A structural check: no CPU
    behaviour shows a host sync.)"""
    import numpy as np
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.syspath_prepend(str(ROOT))
    import bench_gpu

    from backends.types import Datum

    batch = [Datum(list(range(n)), np.arange(1, n + 1), weights=np.ones(n, np.float32)) for n in (3, 5)]
    inputs = bench_gpu.packed_inputs(batch, torch.device("meta"))
    assert inputs["input_ids"].device.type == "meta" and inputs["position_ids"].device.type == "meta"
    assert inputs["cu_seq_lens_q"].device.type == "cpu" and inputs["cu_seq_lens_q"].tolist() == [0, 3, 8]
