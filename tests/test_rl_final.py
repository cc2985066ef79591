"""RL after the loop (runner/engine/loop.py `final`, runner/algos/rl.py `final`): one eval of the test set on the final
weights, logged at step = the number of steps (the cookbook's end_batch); resuming a run stopped before it runs
it once, a finished run never again; and `transcript_every`, which steps write iteration_NNNNNN/ transcripts.

Run: pytest tests/test_rl_final.py   (tiny arithmetic runs on the local backend, seconds each)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from crashing import CrashingBackend

from backends.base import BackendError
from runner.engine.loop import run
from runner.recipe.schema import Recipe


def recipe(tmp_path: Path, run_dir: str, **over: Any) -> Recipe:
    """Arithmetic, as small as still meaningful: 2 groups of 2 per step, a 4-problem test set."""
    algo = {
        "kind": "rl",
        "env": {"kind": "arithmetic", "max_value": 9, "test_size": 4},
        "group_size": 2,
        "groups_per_batch": 2,
        "max_tokens": 4,
        **over.pop("algo", {}),
    }
    return msgspec.convert(
        {
            "algo": algo,
            "lr": 5e-3,
            "lora": {"rank": 4},
            "max_steps": 3,
            "eval_every": 2,
            "save_every": 2,
            "schedule": {"kind": "constant"},
            "backend": {"kind": "local", "device": "cpu"},
            "log_dir": str(tmp_path / run_dir),
            **over,
        },
        Recipe,
    )


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def eval_keys(row: dict[str, Any]) -> list[str]:
    return sorted(k for k in row if k.startswith("test/"))


def local(r: Recipe, run_dir: Path) -> Any:
    from backends.local import LocalBackend

    return LocalBackend(r.backend, r.model, r.tokenizer, run_dir / "checkpoints")


class Recording:
    """The wrapped backend; records which of its methods were called."""

    def __init__(self, inner: Any):
        self.inner, self.called = inner, []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if callable(attr) and name.startswith("create_"):
            self.called.append(name)
        return attr


def test_final_eval_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = recipe(tmp_path, "run")
    run(r, "r")
    ms = rows(tmp_path / "run" / "metrics.jsonl")
    # Steps 0-2 (evals before steps 0 and 2, on the weights after 0 and 2 steps), then the final eval on the
    # weights after step 2's update, logged at step 3 = max_steps.
    assert [m["step"] for m in ms] == [0, 1, 2, 3]
    assert [bool(eval_keys(m)) for m in ms] == [True, False, True, True]
    final = ms[-1]
    assert eval_keys(final) == eval_keys(ms[0]) and "test/env/all/reward/total" in final
    assert final["test/env/all/total_episodes"] == 4  # the whole test set, eval group size 1
    assert not any(k.startswith(("env/", "optim/", "progress/")) for k in final)  # an eval row, not a step's
    assert final["time/total"] >= ms[-2]["time/total"]
    assert (tmp_path / "run" / "iteration_000003" / "test.html").exists()
    err = capsys.readouterr().err
    assert f"final (3 steps)  test/reward {final['test/env/all/reward/total']:.4f}" in err
    # The final eval samples the final checkpoint's weights; no other checkpoint is made for it.
    assert [c["name"] for c in rows(tmp_path / "run" / "checkpoints.jsonl")] == ["000002", "final"]


@pytest.mark.parametrize(
    "over",
    [{"eval_every": 0}, {"algo": {"env": {"kind": "arithmetic", "max_value": 9, "test_size": 0}}}],
    ids=["eval_every=0", "no test set"],
)
def test_no_final_eval_without_evals(tmp_path: Path, over: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    r = recipe(tmp_path, "run", max_steps=2, **over)
    run(r, "r", dry_run=True)
    assert "final eval" not in capsys.readouterr().out
    run(r, "r")
    ms = rows(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in ms] == [0, 1] and not any(eval_keys(m) for m in ms)
    run(r, "r")  # finished: nothing is owed
    assert "already finished" in capsys.readouterr().err


def test_dry_run_plans_the_final_eval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(recipe(tmp_path, "run"), "r", dry_run=True)
    out = capsys.readouterr().out
    assert "evals before steps: 0, 2\n" in out
    assert "after the last step: final eval (the test set on the final weights), logged at step 3" in out
    assert "transcripts (iteration_NNNNNN/): every 10 steps and the last step" in out


def test_crash_before_final_eval_resumes_for_it_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = recipe(tmp_path, "straight")
    run(r, "r")
    want = rows(tmp_path / "straight" / "metrics.jsonl")

    r = recipe(tmp_path, "crashed")
    run_dir = tmp_path / "crashed"
    with pytest.raises(BackendError, match="simulated crash"):  # every step done, the final eval fails
        run(r, "r", backend=CrashingBackend(local(r, run_dir), None, crash_loading_sampler=True))
    assert [m["step"] for m in rows(run_dir / "metrics.jsonl")] == [0, 1, 2]
    ckpts = rows(run_dir / "checkpoints.jsonl")
    assert [c["name"] for c in ckpts] == ["000002", "final"]

    capsys.readouterr()
    run(r, "r", dry_run=True)
    assert "every step trained; still to run: final eval" in capsys.readouterr().out

    backend = Recording(local(r, run_dir))
    run(r, "r", backend=backend)
    got = rows(run_dir / "metrics.jsonl")
    assert [m["step"] for m in got] == [0, 1, 2, 3]
    # Nothing retrained: no training client at all, only a sampler on the final weights; no new checkpoint.
    assert backend.called == ["create_sampling_client"]
    assert rows(run_dir / "checkpoints.jsonl") == ckpts
    assert [s["start_step"] for s in rows(run_dir / "sessions.jsonl")] == [0, 3]
    assert "after its last step, for the final row only" in capsys.readouterr().err
    # The same eval as the uninterrupted run's (same weights, same seeds): rewards exactly.
    assert eval_keys(got[-1]) == eval_keys(want[-1])
    for k in eval_keys(want[-1]):
        if k.startswith("test/env/"):
            assert got[-1][k] == want[-1][k], k


def test_finished_run_adds_no_row_and_extends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = recipe(tmp_path, "run", max_steps=2)
    run(r, "r")
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text()
    assert [m["step"] for m in rows(metrics)] == [0, 1, 2]
    capsys.readouterr()

    backend = Recording(local(r, tmp_path / "run"))
    run(r, "r", backend=backend)  # if_exists = "resume" on a finished run
    assert "already finished" in capsys.readouterr().err
    assert metrics.read_text() == before and backend.called == []
    run(r, "r", dry_run=True)
    assert "already finished: nothing to do" in capsys.readouterr().out

    # A larger max_steps continues: the old final row (step 2) gives way to step 2's own row, and the final eval
    # moves to the new end.
    run(msgspec.structs.replace(r, max_steps=3), "r")
    ms = rows(metrics)
    assert [m["step"] for m in ms] == [0, 1, 2, 3]
    assert "progress/batch" in ms[2] and eval_keys(ms[3])


def test_transcript_every(tmp_path: Path) -> None:
    # Train transcripts on steps 0 and 4 (every 4) and 5 (the last); test ones on evals 0 and 3 and the final (6).
    r = recipe(tmp_path, "run", max_steps=6, eval_every=3, algo={"transcript_every": 4})
    run(r, "r")
    run_dir = tmp_path / "run"
    files = {p.parent.name + "/" + p.name for p in run_dir.glob("iteration_*/*")}
    assert files == {
        f"iteration_{step:06d}/{split}{suffix}"
        for step, split in [(0, "train"), (4, "train"), (5, "train"), (0, "test"), (3, "test"), (6, "test")]
        for suffix in (".html", "_rollout_summaries.jsonl")
    }
    assert {
        json.loads(line)["iteration"]
        for line in (run_dir / "iteration_000006" / "test_rollout_summaries.jsonl").read_text().splitlines()
    } == {6}

    r = recipe(tmp_path, "none", max_steps=2, eval_every=1, algo={"transcript_every": 0})
    run(r, "r")
    assert not list((tmp_path / "none").glob("iteration_*"))
    assert [m["step"] for m in rows(tmp_path / "none" / "metrics.jsonl")] == [0, 1, 2]  # evals still run


def test_runner_eval_of_a_checkpoint_reproduces_the_runs_eval_at_that_step(tmp_path: Path, monkeypatch: Any) -> None:
    """`runner eval RUN --checkpoint N` samples the test set with the seeds the run's own eval at step N used (the
    checkpoint's next_step), so it prints the value the run logged there; the final checkpoint's eval is the final
    row's. At temperature 2 over 16 problems another seed would give another reward."""
    from runner.cli import main

    r = recipe(tmp_path, "run", algo={"env": {"kind": "arithmetic", "max_value": 9, "test_size": 16},
                                      "temperature": 2.0, "eval": {"temperature": 2.0}})
    run(r, "r")
    ms = {m["step"]: m for m in rows(tmp_path / "run" / "metrics.jsonl")}
    monkeypatch.chdir(tmp_path)
    for checkpoint, step in (("000002", 2), ("final", 3)):
        assert main(["eval", str(tmp_path / "run"), "--checkpoint", checkpoint]) == 0
        got = rows(tmp_path / "run" / "evals.jsonl")[-1]
        assert got["step"] == step
        logged = {k: v for k, v in ms[step].items() if k.startswith("test/")}
        assert logged and {k: got[k] for k in logged} == logged, (checkpoint, got, logged)
