"""bench/gpu_check.py (the GPU device check of issue #28, docs/gpu.md): its plan (what one device call runs, in which
order, within which limits), its report (rewritten after every step, earlier runs kept below), a step past its
limit or crashing recorded while the next still runs; here on the CPU (--device cpu --quick), where the GPU box
runs the same code on cuda. bench/gpu_wheels.sh names the wheels the device image lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import gpu_check  # noqa: E402


def test_cpu_figures_come_from_the_recipes_table():
    figures = gpu_check._cpu_figures()
    assert set(figures) == set(gpu_check.FULL)  # sl_basic, rl_basic, dpo_basic each with first, last, wall s
    assert all(float(w) > 0 for _, _, w in figures.values())


def test_the_plan_fits_one_device_call(capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in out if not ln.startswith(" ")][1:] == ["gpu", "speed", "sampling", "conformance",
                                                                              "full", "suite"]
    assert sum(gpu_check.LIMITS[k] for k in gpu_check.DEFAULT_STEPS) <= gpu_check.BUDGET_S <= 10 * 60 - 60  # a device call is at most 600 s, the wheel install in it
    assert sum(gpu_check.FULL_S.values()) <= gpu_check.LIMITS["full"]
    # The owed smoke files are real example files, and with the ones smoked on cuda before they are all of them.
    examples = {f.stem for f in (REPO / "examples").glob("*.toml")}
    assert set(gpu_check.OWED_SMOKE) <= examples and examples - set(gpu_check.OWED_SMOKE) == {"cookbook"}
    assert sum(gpu_check.LIMITS[k] for k in gpu_check.DEFAULT_STEPS) == gpu_check.BUDGET_S  # nothing cut by default
    assert not any("runner smoke" in ln for ln in out)  # the owed smoke files: a later call (--steps smoke)
    gpu_check.main(["--dry-run", "--steps", "smoke"])
    assert sum("runner smoke examples/" in ln for ln in capsys.readouterr().out.splitlines()) == 11
    assert len(gpu_check.OWED_SMOKE) == 11
    assert any("bench_gpu.py --device cuda --shape 0.6b" in ln and "--no-sampling" in ln for ln in out)
    assert any("bench_gpu.py --device cuda --shape 0.6b" in ln and "--no-training" in ln for ln in out)
    assert any("pytest" in ln and "-v" in ln for ln in out)
    assert any("runner run recipes.toml#sl_basic backend.device=cuda" in ln for ln in out)


def test_a_bad_limit_is_one_line(capsys):
    with pytest.raises(SystemExit, match="--limit 'nope=3'"):
        gpu_check.main(["--dry-run", "--limit", "nope=3"])


def test_steps_past_their_limit_or_crashing_are_recorded_and_the_rest_run(tmp_path, monkeypatch):
    out = tmp_path / "gpu.md"
    out.write_text("<!-- an older run -->\n# The local backend on a GPU\n\n| measured | 42 |\n")
    monkeypatch.setattr(gpu_check, "FULL", {"sl_basic": "test/nll", "no_such_recipe": "test/nll"})
    monkeypatch.setattr(gpu_check, "FULL_S", {"sl_basic": 0.5, "no_such_recipe": 60.0})

    def crash(*_a):
        raise RuntimeError("boom")

    seen = []

    def fine(device, scratch, limit, quick, emit):
        seen.append(out.read_text())  # the report as it stood when this step began
        return gpu_check.Step("conformance (faked)", True, 0.1, "42/42 passed", limit_s=limit)

    monkeypatch.setitem(gpu_check.STEPS, "suite", crash)
    monkeypatch.setitem(gpu_check.STEPS, "conformance", fine)
    # Not --quick: that gives each full run the step's whole limit; here sl_basic's own 0.5 s cap cuts it.
    rc = gpu_check.main(["--device", "cpu", "--steps", "full", "suite", "conformance", "--out", str(out)])
    text = out.read_text()
    assert rc == 1
    assert "| sl_basic | test/nll | 0 | - | - |" in text and "timed out (cap 1 s)" in text  # _run waits >= 1 s
    assert "| no_such_recipe | test/nll | 0 | - | - |" in text and "exit 2" in text
    assert "| suite | FAIL | 0.0 |" in text and "crashed: RuntimeError: boom" in text
    assert "| conformance (faked) | pass |" in text
    # Written before the last step ran: the two before it there, the last one marked as not reached.
    assert "crashed: RuntimeError: boom" in seen[0] and "| conformance | not run yet |" in seen[0]
    # The new run on top, the older report below it, unchanged.
    new, old = text.split(gpu_check.EARLIER)
    assert "the latest run (new)" in new and old.strip() == "<!-- an older run -->\n# The local backend on a GPU\n\n" \
        "| measured | 42 |"
    # A second run keeps both earlier ones.
    monkeypatch.setitem(gpu_check.STEPS, "full", fine)
    gpu_check.main(["--device", "cpu", "--quick", "--steps", "full", "--out", str(out)])
    again = out.read_text()
    assert again.count("the latest run (new)") == 2 and again.count(gpu_check.EARLIER) == 1
    assert again.index("| measured | 42 |") > again.index("crashed: RuntimeError: boom")


def test_pytest_logs_are_read_whole_or_cut():
    xdist = ("[gw0] [ 10%] PASSED tests/test_a.py::test_x \n[gw1] [ 20%] FAILED tests/test_gpu.py::test_step[bf16] \n"
             "[gw0] [ 30%] SKIPPED tests/test_b.py::test_y \n[gw1] [ 40%] PASS")  # cut mid-line
    counts, bad, gpu = gpu_check.parse_pytest_log(xdist)
    assert counts == {"PASSED": 1, "FAILED": 1, "SKIPPED": 1}
    assert bad == ["tests/test_gpu.py::test_step[bf16]"] and gpu == ["tests/test_gpu.py::test_step[bf16] FAILED"]
    plain = "tests/test_a.py::test_x PASSED [ 50%]\ntests/test_a.py::test_z ERROR [100%]\n"
    assert gpu_check.parse_pytest_log(plain)[:2] == ({"PASSED": 1, "ERROR": 1}, ["tests/test_a.py::test_z"])


@pytest.mark.slow
def test_gpu_check_runs_its_steps_on_the_cpu(tmp_path):
    out = tmp_path / "gpu.md"
    # The conformance step against `runner serve --dtype bfloat16` is tests/test_bf16.py's; here one step suffices.
    rc = gpu_check.main(["--device", "cpu", "--quick", "--steps", "smoke", "--out", str(out)])
    text = out.read_text()
    assert rc == 0, text
    assert "| smoke of the owed files on cpu (1 files) | pass |" in text and "| sft_tiny.toml#sft_tiny | 1 | 2 |" in text
    assert "- card: " in text and "torch " in text and gpu_check.EARLIER not in text


def test_wheel_list_pins_what_the_device_lacks():
    pins = subprocess.run([str(REPO / "bench" / "gpu_wheels.sh"), "--list"], capture_output=True, text=True,
                          check=True).stdout.split()
    names = {p.split("==")[0] for p in pins}
    assert all("==" in p for p in pins) and len(names) == len(pins)
    assert {"msgspec", "tomli-w", "datasets", "tinker", "pydantic", "zstandard", "h2", "respx"} <= names
    assert {"reasoning_gym", "pycosat"} <= names  # examples/rl_reasoning_gym.toml's smoke
    assert "pytest-xdist" not in names  # the image has it (and execnet)


BENCH_LOG = """building the model
### 0.6b training: N_base 0.6B

| contender | tokens/s |
|---|---:|
| ours-sdpa | 9,000 |
| hf-packed | 8,000 |
ours-flex: compiling
"""


def test_a_bench_cut_at_its_limit_keeps_the_tables_it_printed(tmp_path, monkeypatch):
    """The speed step's bench prints each section as it is measured; cut at the step's limit, those are in the
    report; a bench that finished is reported from its final print (its Device line on), each table once."""
    script = tmp_path / "bench.py"
    script.write_text(f"import sys, time\nsys.stderr.write({BENCH_LOG!r})\nsys.stderr.flush()\ntime.sleep(60)\n")
    monkeypatch.setattr(gpu_check, "bench_command", lambda key, device, quick: [sys.executable, str(script)])
    step = gpu_check.step_speed("cpu", tmp_path, 3.0, False, lambda s: None)
    assert not step.ok and "1 table(s) measured; timed out at 3 s" in step.detail
    assert step.text.splitlines() == ["### 0.6b training: N_base 0.6B", "", "| contender | tokens/s |", "|---|---:|",
                                      "| ours-sdpa | 9,000 |", "| hf-packed | 8,000 |"]
    whole = BENCH_LOG + "Device: H200; bf16\n" + BENCH_LOG
    text = gpu_check.bench_tables(whole)
    assert text.startswith("Device: H200; bf16") and text.count("| ours-sdpa | 9,000 |") == 1


@pytest.mark.slow  # collects all of tests/ in a subprocess: ~30 s
def test_the_gpu_step_runs_every_gpu_test_but_the_slow_one():
    """The gpu step's pytest command collects only the files that mark tests `gpu` (collecting the whole tree took
    10 s of the step's 90): what it selects is everything `-m gpu` selects over all of tests/, less the slow test
    (test_gpu.py's conformance, which the conformance step runs)."""
    def selected(args: list[str]) -> set[str]:
        args = [a for a in args if a != "-v"]  # -o addopts= -q: one node id a line
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-o", "addopts=", "-q", *args],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        return {ln for ln in out.stdout.splitlines() if "::" in ln}

    cmd = gpu_check.gpu_command()
    assert cmd[cmd.index("-m", 3) + 1] == "gpu and not slow" and "addopts=" in cmd
    every = selected(["-p", "no:cacheprovider", "-m", "gpu", "tests"])
    step = selected(cmd[3:])
    assert step == every - {"tests/test_gpu.py::test_conformance_against_serve_on_cuda"}
    assert len(step) >= 13 and {s.split("::")[0] for s in step} == {
        str(f.relative_to(REPO)) for f in gpu_check.gpu_files()}
