"""A `runner serve` killed with SIGKILL mid-run and started again on the same --storage costs `runner run`
(backend tinker) the steps since its last checkpoint, not the run: the server answers the lost training run
with code training_run_not_loaded, the tinker backend raises BackendError(state_lost=True), and the loop
resumes from the run dir's last checkpoint (runner/engine/loop.py reload_after_lost_state). docs/serve.md
"After a restart"."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tinker")

REPO = Path(__file__).resolve().parent.parent
STEPS = 10  # save_every=2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(storage: Path, port: int, log: Path) -> subprocess.Popen:
    port_file = storage.parent / "port"
    port_file.unlink(missing_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "runner", "serve", "--port", str(port), "--port-file",
                                 str(port_file), "--storage", str(storage), "--device", "cpu"],
                                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 300  # start-up reads the models' shapes: ~20 s busy, minutes on a loaded machine
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"runner serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["sl_basic", "rl_basic"])
def test_sigkilled_server_costs_the_run_its_inflight_steps_not_the_run(recipe, tmp_path):
    port = _free_port()
    storage, log_dir = tmp_path / "storage", tmp_path / "run"
    server_log = tmp_path / "serve.log"
    server = _serve(storage, port, server_log)
    run = None
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO), "TINKER_API_KEY": "tml-test", "TINKER_TELEMETRY": "0"}
        run = subprocess.Popen(
            [sys.executable, "-m", "runner", "run", f"recipes.toml#{recipe}", f"max_steps={STEPS}", "save_every=2",
             # lost_after_s: the restarted server's start-up (above) must not pass for a lost service under load.
             "eval_every=0", f'backend={{kind="tinker", base_url="http://127.0.0.1:{port}", lost_after_s=900}}',
             "tokenizer=tiny",
             f"log_dir={log_dir}"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while len(_rows(log_dir / "checkpoints.jsonl")) < 2 or len(_rows(log_dir / "metrics.jsonl")) < 5:
            assert run.poll() is None, run.communicate()
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.02)
        server.send_signal(signal.SIGKILL)  # mid-run: steps in flight, a checkpoint or two saved
        server.wait()
        killed_at = len(_rows(log_dir / "metrics.jsonl"))
        server = _serve(storage, port, server_log)  # the same port and storage
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-3000:]
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    assert killed_at < STEPS
    assert "the server lost the run's training state (restarted?): resuming from checkpoint" in err
    assert "the server no longer holds this client" in err
    # The run went on from its last checkpoint: a second session starting there, each step logged once.
    sessions = _rows(log_dir / "sessions.jsonl")
    assert [s["session"] for s in sessions] == [1, 2]
    resumed_at = sessions[1]["start_step"]
    assert 2 <= resumed_at <= killed_at and resumed_at % 2 == 0
    steps = [r["step"] for r in _rows(log_dir / "metrics.jsonl") if r["step"] < STEPS]
    assert steps == list(range(STEPS))
    ckpts = _rows(log_dir / "checkpoints.jsonl")
    assert ckpts[-1]["name"] == "final-s2" and ckpts[-1]["next_step"] == STEPS
    assert any(r["next_step"] == resumed_at for r in ckpts if not r["name"].endswith("-s2"))
    # Training went on from the saved weights and optimizer state: the steps retrained after the restart have
    # the losses the first server gave them (kept in the resume's backup of metrics.jsonl).
    rows = {r["step"]: r for r in _rows(log_dir / "metrics.jsonl")}
    # No step trained on what was left of a batch whose groups lost their sampler (RL): it was retrained whole.
    assert all(r.get("rollout_errors/total", 0) == 0 for r in rows.values())
    before = {r["step"]: r for r in _rows(log_dir / f"metrics.jsonl.pre_resume_{resumed_at:06d}")}
    for s in [s for s in before if s >= resumed_at]:  # none when the kill came right after a checkpoint
        key = "train_mean_nll" if recipe == "sl_basic" else "env/all/reward/total"
        assert rows[s][key] == pytest.approx(before[s][key], rel=1e-5)
