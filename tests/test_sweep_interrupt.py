"""Ctrl-C to `runner sweep`: the scheduler, asleep until a point exits (it waits on the points, it does not poll),
wakes, passes the interrupt to the running points (each in its own session, so a terminal's Ctrl-C reaches only the
sweep), each saves a checkpoint and stops, and the sweep exits 130 saying how to continue; the same command then
completes every point from its checkpoint."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from runner.tools.compare import read_rows
from tests.test_sweep import env, sweep_cmd


@pytest.mark.slow
def test_ctrl_c_stops_every_point_at_a_checkpoint_and_the_same_command_completes_them(tmp_path: Path) -> None:
    args = ("max_steps=16", "save_every=0", "--parallel", "2")
    proc = subprocess.Popen(sweep_cmd(*args), cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    points = [tmp_path / f"runs/sl_basic/lr={lr}" for lr in ("0.001", "0.004")]
    try:
        deadline = time.monotonic() + 300  # two points start at once: torch and the model, each, under load
        while not all(len(read_rows(p / "metrics.jsonl")) >= 2 for p in points if (p / "metrics.jsonl").exists()) \
                or not all((p / "metrics.jsonl").exists() for p in points):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the points did not start training within 300 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out
    assert "sweep interrupted: run the same command to continue" in out, out
    assert out.count("stopped") == 2, out
    for p in points:
        saved = read_rows(p / "checkpoints.jsonl")
        assert saved and 0 < saved[-1]["step"] < 16, (p, saved)  # Ctrl-C saved the last step, mid-run

    done = subprocess.run(sweep_cmd(*args), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for p in points:
        assert [r["step"] for r in read_rows(p / "metrics.jsonl")][-1] == 16
        sessions = read_rows(p / "sessions.jsonl")
        assert len(sessions) == 2 and sessions[1]["start_step"] > 0
