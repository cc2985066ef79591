"""`runner check` stays fast (issue 23: median < 0.5 s, bench/bench_check.py): validating recipes never loads
the heavy libraries that training needs. Run as the user runs it, in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "tinker", "safetensors")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in HEAVY)


def test_check_imports_no_heavy_library():
    proc = _run("-X", "importtime", "-m", "runner", "check", "recipes.toml")
    assert "ok  recipes.toml#prompt_distill_teacher" in proc.stdout
    # stderr lines: "import time: self [us] | cumulative | <indent>module"
    mods = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "runner.recipe.schema" in mods  # the trace is real: the check path shows up in it
    assert not _heavy(mods), f"runner check imported {_heavy(mods)[:10]}"


def test_check_imports_no_heavy_library_through_targets():
    # -X importtime does not list modules loaded by importlib.import_module (recipe targets): list sys.modules.
    code = ("import json, runpy, sys\nsys.argv = ['runner', 'check', 'recipes.toml']\ntry:\n"
            "    runpy.run_module('runner', run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(json.dumps(sorted(sys.modules)))\n")
    mods = set(json.loads(_run("-c", code).stdout.splitlines()[-1]))
    assert "backends.local.tiny" in mods  # prompt_distill_teacher's target (task_prompts) was imported to be checked
    assert not _heavy(mods), f"runner check imported {_heavy(mods)[:10]}"
