"""Prompt distillation: a `generate` run samples a prompted teacher and writes conversations without the prompt
(resumable, seeded); an SFT recipe reads them through `run_output` (runner run runs the generator first) and its
final eval measures agreement with the teacher on held-out prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.cli import main
from runner.engine.log import read_jsonl

RECIPES = """
[recipes.gen]
save_every = {save_every}
eval_every = 0
{extra}
[recipes.gen.algo]
kind = "generate"
prompts = {{kind = "python", target = "backends.local.tiny:task_prompts", args = {{n = 40, seed = 3, kinds = ["short"]}}}}
system = "Always answer in uppercase."
batch_size = 8
max_tokens = 16
temperature = {temperature}

[recipes.student]
lr = 0.01
eval_every = 0
save_every = 0
{extra}
[recipes.student.algo]
kind = "sft"
data = {{kind = "run_output", run = "#gen"}}
batch_size = 8
test_size = 8
agreement = true
"""


def write(proj: Path, save_every: int = 2, temperature: float = 0.0, extra: str = "") -> None:
    (proj / "r.toml").write_text(RECIPES.format(save_every=save_every, temperature=temperature, extra=extra))


def generated(run_dir: Path) -> list[dict]:
    return [json.loads(line) for f in sorted((run_dir / "generated").glob("step_*.jsonl")) for line in f.open()]


@pytest.fixture
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_generate_writes_conversations_without_the_system_prompt_and_resumes_exactly(proj: Path) -> None:
    write(proj, temperature=1.0)
    assert main(["run", "r.toml#gen", "max_steps=3"]) == 0  # 3 of 5 steps, as if stopped
    assert len(list((proj / "runs" / "gen" / "generated").glob("step_*.jsonl"))) == 3
    assert main(["run", "r.toml#gen"]) == 0  # extends to all 5 steps
    rows = generated(proj / "runs" / "gen")
    assert 30 <= len(rows) <= 40  # replies cut off by max_tokens are dropped (and counted)
    assert all(r["messages"][0]["role"] == "user" and r["messages"][-1]["role"] == "assistant" for r in rows)
    assert not any(m["role"] == "system" for r in rows for m in r["messages"])
    # Seeded: a straight run elsewhere writes the same rows, sampled at temperature 1.
    write(proj, temperature=1.0, extra=f'log_dir = "{proj / "straight"}"')
    assert main(["run", "r.toml#gen"]) == 0
    assert generated(proj / "straight") == rows
    metrics = read_jsonl(proj / "runs" / "gen" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(5)) and "truncated_frac" in metrics[0]


def test_student_trains_on_the_output_and_reports_agreement(proj: Path) -> None:
    write(proj)
    assert main(["run", "r.toml#student"]) == 0  # runs gen first
    final = read_jsonl(proj / "runs" / "student" / "metrics.jsonl")[-1]
    rows = len(generated(proj / "runs" / "gen"))
    assert 0.0 <= final["test/agreement"] <= 1.0 and final["step"] == (rows - 8) // 8  # 8 held out, 8 per step


def test_run_output_of_a_run_that_generated_nothing(proj: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(proj)
    assert main(["run", "r.toml#student", "--dry-run"]) == 2
    assert "has generated nothing yet" in capsys.readouterr().err


def test_prompt_distillation_over_the_tinker_sdk(proj: Path, mocked_tinker: None) -> None:
    remote = 'model = "Qwen/Qwen3-8B"\ntokenizer = "tiny"\nbackend = {kind = "tinker"}'
    write(proj, extra=remote)
    assert main(["run", "r.toml#student"]) == 0
    assert generated(proj / "runs" / "gen")
    final = read_jsonl(proj / "runs" / "student" / "metrics.jsonl")[-1]
    assert 0.0 <= final["test/agreement"] <= 1.0
