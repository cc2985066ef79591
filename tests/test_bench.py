"""The clock bench (bench/bench_loop.py) still runs and still shows what issue #4 asks of the loop: the
pipelined SFT and RL (async K=1) loops take about one simulated Tinker cycle per step where the naive
submit-await loops take 2 (SFT) and 3 (RL). A few steps only; the real numbers are in bench/README.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


@pytest.mark.slow
def test_clock_bench_cycles_per_step():
    import bench_loop

    rows = {r.name: r for r in bench_loop.cycles_table(steps=4, period=0.05, rl_period=0.5)}
    assert rows["SFT naive (await fb, await optim)"].steady == pytest.approx(2.0, abs=0.05)
    assert rows["SFT runner.engine.loop depth=1"].steady <= 1.05
    assert rows["RL naive (await sample, fb, optim)"].steady == pytest.approx(3.0, abs=0.1)
    assert rows["RL runner.engine.loop sync"].steady == pytest.approx(2.0, abs=0.1)
    assert rows["RL runner.engine.loop async K=1"].steady <= 1.1
