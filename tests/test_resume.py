"""Resume on the real local backend (tiny model): a crashed-then-resumed run equals an uninterrupted one,
metric for metric (time/* aside), including after a real `kill -9` of `python -m runner run`.

Run: pytest tests/test_resume.py   (about 20 s on 2 cores; the kill -9 test is marked slow)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from crashing import CrashingBackend

from backends.base import BackendError
from runner.cli import main
from runner.engine.log import read_jsonl
from runner.engine.loop import run
from runner.recipe.load import dump_recipe, load_recipe
from runner.recipe.schema import Recipe
from scripts.tiny_build import sft_conversations

STEPS = 6


def recipe_for(tmp_path: Path, run_dir: str) -> Recipe:
    data = tmp_path / "chat.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in sft_conversations(40, seed=1)))
    return msgspec.convert({
        "algo": {"kind": "sft", "data": {"kind": "jsonl", "path": str(data)}, "batch_size": 4, "test_size": 4,
                 "max_length": 96},
        "lr": 5e-3, "lora": {"rank": 4}, "max_steps": STEPS, "eval_every": 2, "save_every": 2, "depth": 2,
        "backend": {"kind": "local", "device": "cpu"}, "log_dir": str(tmp_path / run_dir),
    }, Recipe)


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_resume_after_crash_equals_uninterrupted(tmp_path):
    from backends.local import LocalBackend

    run(recipe_for(tmp_path, "straight"), "r")
    want = metrics(tmp_path / "straight")
    # STEPS training rows, then the final weights' test/nll row at step STEPS.
    assert [r["step"] for r in want] == [*range(STEPS), STEPS] and "train_mean_nll" not in want[-1]

    recipe = recipe_for(tmp_path, "crashed")
    inner = LocalBackend(recipe.backend, recipe.model, recipe.tokenizer, tmp_path / "crashed" / "checkpoints")
    with pytest.raises(BackendError, match="simulated crash"):
        run(recipe, "r", backend=CrashingBackend(inner, crash_at=5))  # steps 0-4 submitted, step 5 fails
    # With depth 2, steps 3 and 4 were still in flight: the checkpoint after step 4 was queued but its
    # row never written, so the resume point is the one after step 2, and steps 3-4 rows are dropped.
    ckpts = [json.loads(line) for line in (tmp_path / "crashed" / "checkpoints.jsonl").read_text().splitlines()]
    assert [c["next_step"] for c in ckpts] == [2]
    assert len(metrics(tmp_path / "crashed")) == 3
    run(recipe, "r")  # resumes at step 2 on a fresh backend
    assert metrics(tmp_path / "crashed") == want


@pytest.mark.slow
def test_kill_9_then_resume(tmp_path):
    """A real crash: SIGKILL the CLI process right after its first checkpoint row lands."""
    recipe = msgspec.structs.replace(recipe_for(tmp_path, "killed"), max_steps=16, save_every=3)
    got, want = kill_9_resume_and_straight(tmp_path, recipe, {"OMP_NUM_THREADS": "1"})
    assert got == want


def kill_9_resume_and_straight(
    tmp_path: Path, recipe: Recipe, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run `recipe` (whose log_dir is tmp_path/killed) with the CLI, SIGKILL it right after its first checkpoint
    row lands (asserting it was really interrupted), resume it in-process, then run it uninterrupted under
    tmp_path/straight: (resumed metrics, uninterrupted metrics), time/* aside."""
    ref = tmp_path / "recipe.toml"
    ref.write_text(dump_recipe("r", recipe))
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "runner", "run", f"{ref}#r"], cwd=tmp_path,
                            env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints.jsonl").exists() or not (run_dir / "checkpoints.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(metrics(run_dir)) < recipe.max_steps  # it really was interrupted

    _, resumed = load_recipe(f"{ref}#r")
    run(resumed, "r")
    run(msgspec.structs.replace(recipe, log_dir=str(tmp_path / "straight")), "r")
    return metrics(run_dir), metrics(tmp_path / "straight")


def rl_recipe_for(tmp_path: Path, run_dir: str, steps: int) -> Recipe:
    return msgspec.convert({
        "algo": {"kind": "rl", "env": {"kind": "arithmetic", "max_value": 9, "test_size": 4}, "group_size": 4,
                 "groups_per_batch": 4, "max_tokens": 6, "temperature": 1.5},
        "lr": 1e-2, "lora": {"rank": 4}, "max_steps": steps, "eval_every": 4, "save_every": 3,
        "schedule": {"kind": "constant"}, "backend": {"kind": "local", "device": "cpu"},
        "log_dir": str(tmp_path / run_dir),
    }, Recipe)


@pytest.mark.slow
def test_kill_9_rl_then_resume(tmp_path):
    """RL (sync mode): SIGKILL the CLI after its first checkpoint row; the resumed run's metrics equal an
    uninterrupted run's exactly, logprob-derived ones included. That needs the local sampler to be batch
    invariant, since its worker coalesces the concurrent sample requests however they happen to arrive."""
    steps = 40
    got, want = kill_9_resume_and_straight(tmp_path, rl_recipe_for(tmp_path, "killed", steps))
    assert len(want) >= steps and "optim/kl_sample_train_v1" in want[0]
    assert got == want


@pytest.mark.slow
def test_ctrl_c_saves_the_last_step_and_resumes(tmp_path, capfd):
    """SIGINT (Ctrl-C) mid-run: the submitted steps finish, a checkpoint of the last one is saved, exit 130; the same
    command resumes from there, and the run ends with the uninterrupted run's metrics (nothing lost but time)."""
    recipe = msgspec.structs.replace(recipe_for(tmp_path, "killed"), max_steps=16, save_every=0)
    ref = tmp_path / "recipe.toml"
    ref.write_text(dump_recipe("r", recipe))
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "runner", "run", f"{ref}#r"], cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or len(metrics(run_dir)) < 3:  # a few steps in, with no checkpoint yet (save_every = 0)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no steps within 120 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert "Traceback" not in err.decode() and "run the same command to resume" in err.decode()
    done = len(metrics(run_dir))
    assert 3 <= done < recipe.max_steps
    [ckpt] = read_jsonl(run_dir / "checkpoints.jsonl")
    assert ckpt["next_step"] == done  # the last finished step, not an older one

    # The same command again, in this process (the interrupted run above was the one that needed a process of its own).
    capfd.readouterr()
    assert main(["run", f"{ref}#r"]) == 0
    assert f"resuming {run_dir} at step {done}" in capfd.readouterr().err
    run(msgspec.structs.replace(recipe, log_dir=str(tmp_path / "straight")), "r")
    assert metrics(run_dir) == metrics(tmp_path / "straight")


def test_second_ctrl_c_quits_at_once(tmp_path):
    """While the first Ctrl-C waits for slow in-flight steps, a second one exits at once (130, one line)."""
    recipe = msgspec.structs.replace(recipe_for(tmp_path, "killed"), max_steps=400, save_every=0)
    script = (
        "import sys, msgspec\n"
        "from backends.fake import FakeBackend\n"
        "from runner.engine.loop import Interrupted, run\n"
        "from runner.recipe.schema import Recipe\n"
        f"recipe = msgspec.json.decode({msgspec.json.encode(recipe)!r}, type=Recipe)\n"
        "try:\n"
        "    run(recipe, 'r', backend=FakeBackend(delay=1.0))\n"
        "except Interrupted:\n"
        "    sys.exit(130)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120  # the child imports the runner (and torch) first
    while not (tmp_path / "killed" / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted again: quitting now" in err.decode()
    assert "Traceback" not in err.decode()
    # It did not wait for the in-flight calls (1 s each) and the checkpoint the first Ctrl-C would save: no row.
    # (This was `< 0.9 s` after the signal, which a loaded machine's process exit alone can take.)
    ckpts = tmp_path / "killed" / "checkpoints.jsonl"
    assert not ckpts.exists() or not ckpts.read_text().strip()
    assert time.monotonic() - t < 20
