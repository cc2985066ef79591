"""docs/rundir.md lists every file and folder a run writes: an SFT chain (init_from, a generate stage's output,
periodic and final checkpoints, `runner eval`) and an RL run (transcripts) write only paths the table names.

    pytest tests/test_rundir_files.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runner.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = """
[recipes.gen]
save_every = 0
eval_every = 0
max_steps = 1
backend = {kind = "local", device = "cpu"}
algo = {kind = "generate", prompts = {kind = "python", target = "backends.local.tiny:task_prompts", \
args = {n = 8, seed = 1, kinds = ["short"]}}, batch_size = 4, max_tokens = 8, keep_truncated = true}

[recipes.base]
max_steps = 3
save_every = 2
eval_every = 2
backend = {kind = "local", device = "cpu"}
lora = {rank = 4}
algo = {kind = "sft", data = {kind = "run_output", run = "#gen"}, batch_size = 2, test_size = 2}

[recipes.chained]
init_from = "#base"
max_steps = 1
backend = {kind = "local", device = "cpu"}
lora = {rank = 4}
algo = {kind = "sft", data = {kind = "run_output", run = "#gen"}, batch_size = 2}

[recipes.rl]
max_steps = 2
eval_every = 1
save_every = 0
backend = {kind = "local", device = "cpu"}
lora = {rank = 4}
algo = {kind = "rl", env = {kind = "arithmetic", max_value = 9, test_size = 2}, group_size = 2, groups_per_batch = 2, \
max_tokens = 4, transcript_every = 1}
"""


def documented() -> str:
    text = (ROOT / "docs" / "rundir.md").read_text()
    return text[text.index("## Every file and folder a run writes"):]


def written(runs: Path) -> set[str]:
    """Every path under runs/, as the table names it: steps as NNNNNN, checkpoint folders as <name>."""
    out = set()
    for p in runs.rglob("*"):
        parts = list(p.relative_to(runs).parts[1:])  # without the run dir's own name
        if not parts:
            continue
        if len(parts) >= 3 and parts[0] == "checkpoints":
            parts[2] = "<name>"
        out.add("/".join(re.sub(r"\d{6}", "NNNNNN", x) for x in parts) + ("/" if p.is_dir() else ""))
    return out


def test_every_path_a_run_writes_is_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.toml").write_text(RECIPES)
    assert main(["run", "r.toml#chained"]) == 0  # gen, base, then chained
    assert main(["run", "r.toml#rl"]) == 0
    assert main(["eval", "runs/base"]) == 0
    paths = written(tmp_path / "runs")
    # The runs wrote what the table is about (so the check below checks something).
    assert {"iteration_NNNNNN/train.html", "generated/step_NNNNNN.jsonl", "init_from.json", "evals.jsonl",
            "checkpoints/weights/<name>/"} <= paths, sorted(paths)
    doc = documented()
    missing = []
    for path in sorted(paths):
        top = path.split("/")[0] + ("/" if "/" in path else "")
        names = path.rstrip("/").split("/")
        if f"`{top}" not in doc or not all(name in doc for name in names):
            missing.append(path)
    assert not missing, f"docs/rundir.md does not list: {missing}"
