"""The clock bench (bench/bench_loop.py) still runs and still shows what issue #4 asks of the loop: the
pipelined SFT and RL (async K=1) loops take about one simulated Tinker cycle per step where the naive
submit-await loops take 2 (SFT) and 3 (RL). A few steps only; the real numbers are in bench/README.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


# The rows the claims are about: the bench measures only these (its other rows, depth 0 and 2, slow prep and RL
# stream, take a third of its time and are claimed nothing of here).
ROWS = ("SFT naive (await fb, await optim)", "SFT runner.engine.loop depth=1", "RL naive (await sample, fb, optim)",
        "RL runner.engine.loop sync", "RL runner.engine.loop async K=1")


def _cycles_hold(rows: dict) -> list[str]:
    """The claims that do not hold in one measurement (empty: all hold)."""
    checks = {
        "SFT naive = 2": rows[ROWS[0]].steady == pytest.approx(2.0, abs=0.05),
        "SFT depth=1 <= 1.05": rows[ROWS[1]].steady <= 1.05,
        "RL naive = 3": rows[ROWS[2]].steady == pytest.approx(3.0, abs=0.1),
        "RL sync = 2": rows[ROWS[3]].steady == pytest.approx(2.0, abs=0.1),
        "RL async K=1 <= 1.1": rows[ROWS[4]].steady <= 1.1,
    }
    return [name for name, ok in checks.items() if not ok]


@pytest.mark.slow
def test_clock_bench_cycles_per_step():
    import bench_loop

    # A simulated cycle is a wall-clock period: a process descheduled for longer than one (a loaded CI machine) misses
    # a tick and reads as an extra cycle. So the period is long enough to ride out short stalls, and a measurement
    # that misses is taken again with periods 3x longer, which the stalls of a machine at load 11 on 2 cores (the
    # suite beside 5 other test runs) no longer reach: the claims are about cycles, not about how long a cycle is.
    failed: list[str] = []
    for period, rl_period in ((0.12, 0.5), (0.36, 1.5)):
        rows = {r.name: r for r in bench_loop.cycles_table(steps=4, period=period, rl_period=rl_period, only=ROWS)}
        assert list(rows) == list(ROWS)
        failed = _cycles_hold(rows)
        if not failed:
            break
    assert not failed, (failed, {n: r.steady for n, r in rows.items()})
