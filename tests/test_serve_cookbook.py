"""tinker-cookbook's own entry points (supervised.train.main, rl.train.main with importance_sampling and
stable_reinforce on the arithmetic env, preference.train_dpo.main) against runner serve, offline, through
examples/serve_cookbook.py. Skipped when the cookbook or its training deps are not installed (.ci/run installs them)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
from serve_cookbook import missing_cookbook_deps  # noqa: E402

if missing_cookbook_deps():
    pytest.skip(f"the cookbook's training loops need {missing_cookbook_deps()} (.ci/run installs them)",
                allow_module_level=True)
pytestmark = pytest.mark.extras("cookbook")


@pytest.mark.slow
def test_cookbook_sft_rl_dpo_against_runner_serve(tmp_path):
    out = tmp_path / "curves.json"
    proc = subprocess.run(
        [sys.executable, "examples/serve_cookbook.py", "--steps", "3", "--out", str(tmp_path / "logs"), "--json", str(out)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "TINKER_TELEMETRY": "0"},
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert set(report) == {"sft", "rl_importance_sampling", "rl_stable_reinforce", "dpo"}
    nll = [v for _, v in report["sft"]["train_mean_nll"]]
    assert len(nll) == 3 and nll[-1] < nll[0]
    for name in ("rl_importance_sampling", "rl_stable_reinforce"):
        rewards = [v for _, v in report[name]["env/all/reward/total"]]
        assert len(rewards) == 3 and all(math.isfinite(r) for r in rewards)
    dpo = [v for _, v in report["dpo"]["dpo_loss"]]
    assert dpo[0] == pytest.approx(math.log(2), abs=1e-3)  # policy == reference at the first step
    assert (tmp_path / "logs" / "sft" / "checkpoints.jsonl").is_file()
