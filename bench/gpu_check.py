"""The local backend on one GPU in one device call (issue #28; docs/gpu.md says how to run it on a box with no network).

Runs what is still owed, in value order, each step in its own processes with its own time limit (--limit STEP=S),
all inside one budget (--budget-s, default 540 s: one device call of at most 10 minutes with the wheel install):
1. smoke: `runner smoke` of the example files not yet run on cuda (OWED_SMOKE), each its own process capped at
   SMOKE_FILE_S, with RUNNER_LOCAL_DEVICE=DEV so their small stand-in models run on DEV (device = "auto" would keep
   them on the CPU: backends/local/device.py); a file whose optional package is missing there is recorded as such;
2. full: sl_basic, rl_basic and dpo_basic in full with backend.device = DEV (bfloat16 on cuda): steps reached, the
   headline metric's first and last value and the wall time next to bench/results/recipes.md's CPU figures;
3. suite: the whole test suite on that machine, tests/test_gpu.py's `gpu` tests included (they run where CUDA is),
   with pytest-xdist's -n where it is installed (the device image has it), else plain; its gpu tests and failures
   are listed, from the log, even when the step is cut at its limit;
4. conformance: `runner conformance` against `runner serve --device DEV` (numeric checks at --atol/--rtol 5e-3, the
   bfloat16 tolerance of tests/test_bf16.py);
5. gpu: `pytest -m 'gpu and not slow'` alone (the CUDA paths: bf16 step vs float32, graph vs eager decode,
   FlexAttention; the slow gpu test is the conformance step's check);
6. speed: bench/bench_gpu.py's training on the Qwen3-0.6B shape (issue #29): ours-sdpa, ours-flex and the packed
   hand loop's tokens/s, MFU and memory; 7. sampling: its sampling on that shape, ours against `generate` and
   `generate` with a static cache + compile. Each section of the bench's tables lands in the report as soon as it is
   measured, so a bench cut at the step's limit keeps what it measured.
The default order (one device call, DEFAULT_STEPS) puts the never-measured first: gpu, speed, sampling,
conformance, full, suite; `smoke` (the owed example files) and `allsmoke` (recipes.toml and every examples/*.toml)
in a later call.
The report (default bench/results/gpu.md) is rewritten after every step and every sub-run, so a call cut short
still leaves what it measured; a step past its limit is recorded as timed out and the next one runs. What the file
held before is kept below the new run, under "Earlier runs" (measured data is never dropped). Exit 0 when every
step passed.

    bench/gpu_check.sh                                   # on the GPU box (installs the carried wheels first)
    python bench/gpu_check.py --dry-run                  # the plan: steps, limits, commands (nothing runs)
    python bench/gpu_check.py --device cpu --quick --out /tmp/gpu.md   # the same code on the CPU, small
--quick: one smoke file (examples/sft_tiny.toml), the full runs cut to 2 steps, the suite cut to one test file,
conformance's sampling group only.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FULL = {"sl_basic": "test/nll", "rl_basic": "test/env/all/reward/total", "dpo_basic": "test/accuracy"}
# Each full run's own cap, seconds: sl_basic took 1.7-2 s a step on an H200 before issue #29 (60 steps), the others
# are unmeasured; a run cut at its cap still reports the steps it reached and its metric so far.
FULL_S = {"sl_basic": 30.0, "rl_basic": 25.0, "dpo_basic": 25.0}
BF16_TOL = "5e-3"
# The example files the first H200 session did not reach (bench/results/gpu.md), in the order they run.
OWED_SMOKE = ["custom_algo", "rl_async", "rl_guess_number", "rl_preference", "rl_stream", "rl_tictactoe",
              "rl_twenty_questions", "sft_tinker", "sft_tiny", "rl_reasoning_gym", "verifiers_rl"]
# A file's optional package (pyproject's extras): where it is not installed the file is recorded as not run.
NEEDS = {"rl_reasoning_gym": "reasoning_gym", "verifiers_rl": "verifiers"}
SMOKE_FILE_S = 45.0  # one smoke file's cap (a fresh process: CUDA's start is in it)
# Step -> its time limit, seconds; the default steps in value order (what was never measured on a GPU first). The
# default steps' limits sum to the default budget: one device call of at most 10 minutes with the wheel install.
LIMITS = {"gpu": 90.0, "speed": 140.0, "sampling": 90.0, "conformance": 60.0, "full": 80.0, "suite": 80.0,
          "smoke": 135.0, "allsmoke": 240.0}
DEFAULT_STEPS = ["gpu", "speed", "sampling", "conformance", "full", "suite"]
BUDGET_S = 540.0
# bench/bench_gpu.py's arguments (step -> full, --quick): speed, the 0.6B shape's training contenders that decide
# issue #29's questions (ours-sdpa, the reference, always runs: does flex beat it, and how do both compare with the
# packed hand loop), 3 rounds of 2 batches; sampling, that shape's sampling (ours, generate, generate with a static
# cache + compile).
BENCH_ARGS = {
    "speed": (["--shape", "0.6b", "--no-rl", "--no-sampling", "--only", "hf-packed,ours-flex",
               "--contender-timeout", "60", "--rounds", "3", "--steps", "2"],
              ["--shape", "tiny", "--quick", "--no-rl", "--no-sampling"]),
    "sampling": (["--shape", "0.6b", "--no-rl", "--no-training", "--rounds", "3"],
                 ["--shape", "tiny", "--quick", "--no-rl", "--no-training"]),
}
# Between the new run and what the report held before (kept whole below it).
EARLIER = "# Earlier runs, kept as they were measured (not rerun by the run above)"


@dataclass
class Step:
    name: str
    ok: bool
    wall_s: float
    detail: str = ""
    rows: list[list[str]] = field(default_factory=list)  # extra table rows (smoke results, full runs, failures)
    columns: list[str] = field(default_factory=list)  # the rows' header
    limit_s: float = 0.0
    text: str = ""  # markdown written under the step's heading as it is (the speed step's tables)


class Budget:
    def __init__(self, total_s: float):
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return self.end - time.monotonic()


Emit = Callable[[Step], None]  # called with a step's partial result after each of its sub-runs


def _env(device: str | None) -> dict[str, str]:
    """This repo first on the path; device: what device = "auto" picks (RUNNER_LOCAL_DEVICE), None: its own rule."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env["TINKER_TELEMETRY"] = "0"
    env.pop("RUNNER_LOCAL_DEVICE", None)
    if device is not None:
        env["RUNNER_LOCAL_DEVICE"] = device
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], limit: float, log: Path) -> tuple[int | None, float, str]:
    """(exit code, or None past `limit`; wall seconds; the output's last lines). The whole output goes to `log`."""
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group we started (a server's children too)
            proc.wait()
            rc = None
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    return rc, time.monotonic() - t0, tail


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def env_info() -> list[str]:
    import torch

    lines = [f"python {platform.python_version()}, torch {torch.__version__}"]
    for pkg in ("transformers", "peft", "tinker", "pytest-xdist"):
        try:
            from importlib.metadata import version

            lines[-1] += f", {pkg} {version(pkg)}"
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            lines[-1] += f", {pkg} missing"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        lines.append(f"card: {p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}")
    else:
        lines.append("card: none (torch sees no CUDA device)")
    lines.append(f"host: {platform.machine()}, {os.cpu_count()} cores")
    return lines


# ---------------------------------------------------------------- the steps


def smoke_files(quick: bool, every: bool = False) -> list[Path]:
    if quick:
        return [REPO / "examples" / "sft_tiny.toml"]
    if every:
        return [REPO / "recipes.toml", *sorted((REPO / "examples").glob("*.toml"))]
    return [REPO / "examples" / f"{name}.toml" for name in OWED_SMOKE]


def _smoke(files: list[Path], device: str, scratch: Path, limit: float, emit: Emit, title: str,
           quick: bool = False) -> Step:
    step = Step(f"{title} on {device} ({len(files)} files)", True, 0.0, limit_s=limit,
                columns=["recipe", "stages", "steps", "wall s", "result"])
    end = time.monotonic() + limit
    for f in files:
        left = end - time.monotonic()
        need = NEEDS.get(f.stem)
        if need is not None and importlib.util.find_spec(need) is None:
            step.rows.append([f.name, "-", "-", "-", f"not run: needs {need}, not installed here"])
        elif left < 3:
            step.rows.append([f.name, "-", "-", "-", "not run (step limit spent)"])
            step.ok = False
        else:
            cap = max(1.0, left if quick else min(SMOKE_FILE_S, left))  # --quick on a CPU: the step's limit
            log = scratch / f"smoke-{f.stem}.log"
            rc, wall, _ = _run(_py("-m", "runner", "smoke", str(f)), scratch, _env(device), cap, log)
            step.wall_s += wall
            table = [ln.split() for ln in log.read_text(errors="replace").splitlines()
                     if re.match(r"^\S+\s+\d+\s+\d+\s+[\d.]+\s+\S", ln)]
            step.rows += [[f"{f.name}#{r[0]}", r[1], r[2], r[3], " ".join(r[4:])] for r in table]
            if rc != 0:
                step.ok = False
                if not table or rc is None:
                    step.rows.append([f.name, "-", "-", f"{wall:.1f}",
                                      f"timed out (cap {cap:.0f} s)" if rc is None else f"exit {rc}"])
        ran = [r for r in step.rows if not r[-1].startswith("not run")]
        step.detail = f"{sum(r[-1] == 'ok' for r in ran)}/{len(ran)} recipes ok"
        emit(step)
    return step


def step_smoke(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    return _smoke(smoke_files(quick), device, scratch, limit, emit, "smoke of the owed files", quick)


def step_allsmoke(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    return _smoke(smoke_files(quick, every=True), device, scratch, limit, emit, "smoke of every file", quick)


def _cpu_figures() -> dict[str, tuple[str, str, str]]:
    """recipe -> (first, last, wall s) of its headline metric in bench/results/recipes.md (2 CPU cores)."""
    out = {}
    path = REPO / "bench" / "results" / "recipes.md"
    for line in path.read_text().splitlines() if path.is_file() else []:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in FULL and cells[2] == f"`{FULL[cells[0]]}`":
            out[cells[0]] = (cells[3], cells[4], cells[6])
    return out


def full_command(name: str, device: str, run_dir: Path, quick: bool) -> list[str]:
    extra = ["max_steps=2", "eval_every=1"] if quick else []
    return _py("-m", "runner", "run", f"{REPO / 'recipes.toml'}#{name}", f"backend.device={device}",
               f"log_dir={run_dir}", *extra)


def step_full(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    cpu = _cpu_figures()
    step = Step(f"sl_basic, rl_basic, dpo_basic in full on {device}" + (" (--quick: 2 steps)" if quick else ""),
                True, 0.0, limit_s=limit,
                columns=["recipe", "metric", "steps", "first", "last", f"wall s ({device})", "result", "CPU first",
                         "CPU last", "CPU wall s"])
    end = time.monotonic() + limit
    for name, metric in FULL.items():
        left = end - time.monotonic()
        if left < 3:
            step.rows.append([name, metric, "-", "-", "-", "-", "not run (step limit spent)", *cpu.get(name, ("",) * 3)])
            step.ok = False
            emit(step)
            continue
        cap = max(1.0, left if quick else min(FULL_S.get(name, 60.0), left))
        run_dir = scratch / f"{name}-{device}"
        rc, wall, tail = _run(full_command(name, device, run_dir, quick), REPO, _env(device), cap,
                              scratch / f"{name}.log")
        step.wall_s += wall
        vals, steps = [], 0
        metrics = run_dir / "metrics.jsonl"
        for line in metrics.read_text().splitlines() if metrics.is_file() else []:
            row = json.loads(line)
            steps = max(steps, int(row.get("step", 0)))
            if isinstance(row.get(metric), (int, float)):
                vals.append(row[metric])
        first, last = (f"{vals[0]:.3g}", f"{vals[-1]:.3g}") if vals else ("-", "-")
        where = next((ln for ln in tail.splitlines() if ln.startswith("device: ")), "")
        result = "ok" if rc == 0 else f"timed out (cap {cap:.0f} s)" if rc is None else f"exit {rc}"
        if where:
            result += f" ({where.removeprefix('device: ').split(' (')[0]})"
        step.ok = step.ok and rc == 0
        step.rows.append([name, metric, str(steps), first, last, f"{wall:.1f}", result, *cpu.get(name, ("",) * 3)])
        step.detail = f"{sum(r[6].startswith('ok') for r in step.rows)}/{len(FULL)} finished"
        emit(step)
    return step


def _has_xdist() -> bool:
    return importlib.util.find_spec("xdist") is not None


def suite_command(quick: bool) -> tuple[list[str], dict[str, str]]:
    """pytest over tests/ (--quick: one file), -v so that each result is a log line as it happens; with xdist, one
    worker per 2 cores, each at 2 threads (the suite's numbers come from 2-core machines; 16 threads per worker would
    oversubscribe the cores)."""
    cores = os.cpu_count() or 2
    workers = ["-n", str(max(1, min(8, cores // 2)))] if _has_xdist() and not quick else []
    target = str(REPO / "tests" / ("test_gpu_box.py" if quick else ""))
    extra = {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"} if workers else {}
    return _py("-m", "pytest", "-p", "no:cacheprovider", "-v", "-o", "addopts=", *workers, target), extra


def parse_pytest_log(text: str) -> tuple[dict[str, int], list[str], list[str]]:
    """(outcome -> count, failed/errored test ids, the gpu tests' "id outcome") from a -v log, whole or cut."""
    counts: dict[str, int] = {}
    bad, gpu = [], []
    seen = set()
    for m in re.finditer(r"(tests/\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)|"
                         r"(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+::\S+)", text):
        test, outcome = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        if (test, outcome) in seen:
            continue
        seen.add((test, outcome))
        counts[outcome] = counts.get(outcome, 0) + 1
        if outcome in ("FAILED", "ERROR"):
            bad.append(test)
        if test.startswith("tests/test_gpu.py::") or "cuda" in test:
            gpu.append(f"{test} {outcome}")
    return counts, bad, gpu


def step_suite(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    cmd, extra = suite_command(quick)
    rc, wall, tail = _run(cmd, REPO, {**_env(None), **extra}, limit, scratch / "suite.log")
    counts, bad, gpu = parse_pytest_log((scratch / "suite.log").read_text(errors="replace"))
    got = ", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())) or "no results"
    workers = f"-n {cmd[cmd.index('-n') + 1]}" if "-n" in cmd else "no xdist"
    detail = f"{got} ({workers})" + (f"; timed out at {limit:.0f} s" if rc is None else "")
    if rc not in (0, None) and not counts:
        detail += "; " + tail.splitlines()[-1][:200] if tail else ""
    step = Step("pytest, the whole suite (gpu tests included)", rc == 0, wall, detail, limit_s=limit,
                columns=["test", "outcome"])
    step.rows = [[t, "FAILED/ERROR"] for t in bad[:40]] + [t.rsplit(" ", 1) for t in gpu]
    return step


# The gpu step's marker expression: the `gpu` tests but the slow one (test_gpu.py's conformance against `runner serve
# --device cuda`: the conformance step runs the same check, 40.2 s on the H200, bench/results/gpu.md).
GPU_MARKERS = "gpu and not slow"


def gpu_files() -> list[Path]:
    """The test files that mark tests `gpu`: collecting only these takes 2 s instead of the whole tree's 10 s (on
    the dev box), out of the step's 90."""
    return sorted(f for f in (REPO / "tests").glob("test_*.py") if "pytest.mark.gpu" in f.read_text())


def gpu_command() -> list[str]:
    """pytest of the `gpu` tests; `-o addopts=` drops pyproject's -q, so that -v prints a line per test (what
    parse_pytest_log reads; -q and -v together print dots only)."""
    return _py("-m", "pytest", "-m", GPU_MARKERS, "-p", "no:cacheprovider", "-v", "-o", "addopts=",
               *map(str, gpu_files()))


def step_gpu(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    rc, wall, tail = _run(gpu_command(), REPO, _env(None), limit, scratch / "pytest-gpu.log")
    counts, bad, gpu = parse_pytest_log((scratch / "pytest-gpu.log").read_text(errors="replace"))
    # Exit 5: nothing selected ran (every gpu test skipped where there is no CUDA device).
    ok = rc in (0, 5) if device == "cpu" else rc == 0
    got = ", ".join(f"{n} {k.lower()}" for k, n in sorted(counts.items())) or "no results"
    return Step("pytest -m gpu", ok, wall, "timed out" if rc is None else got, limit_s=limit)


def bench_command(key: str, device: str, quick: bool) -> list[str]:
    return _py(str(REPO / "bench" / "bench_gpu.py"), "--device", device, *BENCH_ARGS[key][quick])


def bench_tables(log: str) -> str:
    """The markdown bench_gpu.py printed, from its log, whole or cut at a limit: its final print (from its "Device:"
    line on) when it got there, else each section it printed on the way as soon as it was measured."""
    lines = log.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Device:")), None)
    if start is not None:
        lines = lines[start:]
    keep = [ln for ln in lines if ln.startswith(("Device:", "###", "|")) or ln.startswith(("first loss", "MFU"))]
    out: list[str] = []
    for ln in keep:
        if ln.startswith("###"):
            out += ["", ln, ""]
        else:
            out.append(ln)
    return "\n".join(out).strip()


def _bench(key: str, device: str, scratch: Path, limit: float, quick: bool) -> Step:
    log = scratch / f"bench-gpu-{key}.log"
    rc, wall, tail = _run(bench_command(key, device, quick), REPO, _env(None), limit, log)
    text = bench_tables(log.read_text(errors="replace"))
    sections = sum(ln.startswith("###") for ln in text.splitlines())
    detail = f"{sections} table(s) measured" + (f"; timed out at {limit:.0f} s" if rc is None else "")
    if rc not in (0, None):
        detail += f"; exit {rc}: " + (tail.splitlines()[-1][:200] if tail else "")
    return Step(f"bench_gpu.py {' '.join(BENCH_ARGS[key][quick])}", rc == 0, wall, detail, limit_s=limit, text=text)


def step_speed(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    return _bench("speed", device, scratch, limit, quick)


def step_sampling(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    return _bench("sampling", device, scratch, limit, quick)


def step_conformance(device: str, scratch: Path, limit: float, quick: bool, emit: Emit) -> Step:
    env = _env(device)
    port_file = scratch / "serve.port"
    log = (scratch / "serve.log").open("w")
    server = subprocess.Popen(_py("-m", "runner", "serve", "--device", device, "--port", "0", "--port-file",
                                  str(port_file), "--storage", str(scratch / "serve-storage")),
                              cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    name = f"conformance vs runner serve --device {device}"
    try:
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() - t0 > min(60.0, limit):
                return Step(name, False, time.monotonic() - t0,
                            "runner serve did not start: " + (scratch / "serve.log").read_text()[-300:], limit_s=limit)
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        only = ["--only", "sampling"] if quick else []
        rc, wall, _ = _run(_py("-m", "runner", "conformance", "--base-url", url, "--json", "--atol", BF16_TOL,
                               "--rtol", BF16_TOL, *only), scratch, env, limit - (time.monotonic() - t0),
                           scratch / "conformance.json")
        try:
            text = (scratch / "conformance.json").read_text()
            results = json.loads(text[text.index("{"):])["results"]
            passed = sum(r["result"] == "pass" for r in results)
            bad = [f"{r['check']}: {r['result']} {r.get('detail', '')}"[:160] for r in results if r["result"] != "pass"]
            detail = f"{passed}/{len(results)} passed" + ("; " + "; ".join(bad) if bad else "")
        except (ValueError, KeyError):
            detail = "timed out" if rc is None else "no JSON report (see conformance.json)"
        return Step(name, rc == 0, time.monotonic() - t0, detail, limit_s=limit)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


STEPS: dict[str, Callable[[str, Path, float, bool, Emit], Step]] = {
    "smoke": step_smoke, "full": step_full, "suite": step_suite, "conformance": step_conformance, "gpu": step_gpu,
    "allsmoke": step_allsmoke, "speed": step_speed, "sampling": step_sampling}


# ---------------------------------------------------------------- plan and report


def plan(steps: list[str], device: str, quick: bool, budget_s: float, limits: dict[str, float]) -> list[str]:
    """What a call would run, one line per step (--dry-run prints it; tests/test_gpu_check.py checks it)."""
    lines = [f"budget {budget_s:.0f} s, device {device}{' (--quick)' if quick else ''}; steps in this order, each "
             "capped at its limit or what is left of the budget:"]
    for key in steps:
        lines.append(f"{key}: limit {limits[key]:.0f} s")
        if key in ("smoke", "allsmoke"):
            lines += [f"  runner smoke {f.relative_to(REPO)}  (cap {SMOKE_FILE_S:.0f} s"
                      + (f"; needs {NEEDS[f.stem]})" if f.stem in NEEDS else ")")
                      for f in smoke_files(quick, every=key == "allsmoke")]
        elif key == "full":
            lines += [f"  runner run recipes.toml#{n} backend.device={device}  (cap {FULL_S.get(n, 60.0):.0f} s)" for n in FULL]
        elif key == "suite":
            cmd, extra = suite_command(quick)
            lines.append("  " + " ".join([*(f"{k}={v}" for k, v in extra.items()), "pytest", *cmd[3:]])
                         + ("" if "-n" in cmd else "  (no pytest-xdist here: one process; the device image has it)"))
        elif key == "gpu":
            lines.append("  pytest " + " ".join(repr(a) if " " in a else a for a in gpu_command()[3:]).replace(str(REPO) + "/", ""))
        elif key in BENCH_ARGS:
            lines.append("  python " + " ".join(bench_command(key, device, quick)[1:]).replace(str(REPO) + "/", ""))
        elif key == "conformance":
            lines.append(f"  runner serve --device {device} + runner conformance --atol {BF16_TOL} --rtol {BF16_TOL}")
    return lines


def report(steps: list[Step], info: list[str], device: str, wall: float, quick: bool, todo: list[str]) -> str:
    lines = [f"<!-- bench/gpu_check.py --device {device}{' --quick' if quick else ''}, "
             f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC -->",
             "# The local backend on a GPU: the latest run (new)", "",
             *[f"- {x}" for x in info], f"- wall time so far: {wall:.0f} s", "",
             "| step | result | wall s | limit s | detail |", "|---|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s.name} | {'pass' if s.ok else 'FAIL'} | {s.wall_s:.1f} | {s.limit_s:.0f} | "
                     f"{s.detail.replace('|', '/')} |")
    lines += [f"| {key} | not run yet | - | - | (this call had not reached it when the report was written) |"
              for key in todo]
    for s in steps:
        if s.text:
            lines += ["", f"## {s.name}", "", s.text]
        if s.rows:
            lines += ["", f"## {s.name}", ""]
            if s.name.startswith("sl_basic"):
                lines += ["Next to bench/results/recipes.md's CPU figures (2 cores, float32).", ""]
            lines += ["| " + " | ".join(s.columns) + " |", "|" + "---|" * len(s.columns)]
            lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in s.rows]
    return "\n".join(lines) + "\n"


def with_earlier(new: str, previous: str) -> str:
    """The new report, then every earlier run the file held (their own text, unchanged) under EARLIER."""
    earlier = [p.strip() for p in previous.split(EARLIER) if p.strip()]
    return new if not earlier else new + "\n---\n\n" + EARLIER + "\n\n" + "\n\n".join(earlier) + "\n"


def _limits(pairs: list[str]) -> dict[str, float]:
    out = dict(LIMITS)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in LIMITS:
            raise SystemExit(f"error: --limit {pair!r}: expected STEP=SECONDS with STEP one of {', '.join(LIMITS)}")
        out[key] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="a small version of every step (a check of this script)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"wall-clock budget of all steps ({BUDGET_S:.0f})")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu.md")
    p.add_argument("--steps", nargs="+", default=DEFAULT_STEPS, choices=list(STEPS),
                   help=f"in this order (default: {' '.join(DEFAULT_STEPS)})")
    p.add_argument("--limit", nargs="*", default=[], metavar="STEP=S", help="a step's own time limit, seconds")
    p.add_argument("--fresh", action="store_true", help="do not keep what --out held before")
    p.add_argument("--dry-run", action="store_true", help="print the plan and run nothing")
    args = p.parse_args(argv)
    limits = _limits(args.limit)
    if args.dry_run:
        print("\n".join(plan(args.steps, args.device, args.quick, args.budget_s, limits)))
        return 0
    missing = [m for m in ("msgspec", "tomli_w", "zstandard", "datasets", "tinker") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: {', '.join(missing)} not installed: run bench/gpu_wheels.sh where PyPI is reachable and carry "
              ".whl/ (bench/gpu_check.sh installs it; docs/gpu.md)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    budget = Budget(args.budget_s)
    info = env_info()
    print("\n".join(info), flush=True)
    previous = "" if args.fresh or not args.out.is_file() else args.out.read_text()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    steps: list[Step] = []

    def write(partial: Step | None = None, todo: list[str] | None = None) -> None:
        done = steps + ([partial] if partial is not None else [])
        text = report(done, info, args.device, time.monotonic() - t0, args.quick, todo or [])
        tmp = args.out.with_name(f".{args.out.name}.tmp")
        tmp.write_text(with_earlier(text, previous))
        os.replace(tmp, args.out)  # a reader (or a call cut mid-write) never sees half a report

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        scratch = Path(tmp)
        (scratch / "examples").symlink_to(REPO / "examples")  # recipes name their data as examples/data/...
        for i, key in enumerate(args.steps):
            todo = args.steps[i + 1:]
            limit = min(limits[key], budget.left())
            if limit < 5:
                steps.append(Step(key, False, 0.0, "not run (budget spent)", limit_s=0))
                write(todo=todo)
                continue
            write(todo=args.steps[i:])
            try:
                step = STEPS[key](args.device, scratch, limit, args.quick, lambda s: write(s, todo))
            except Exception as exc:  # noqa: BLE001 - one step's crash is recorded; the next one still runs
                step = Step(key, False, 0.0, f"crashed: {type(exc).__name__}: {exc}"[:300], limit_s=limit)
            print(f"{'pass' if step.ok else 'FAIL'}  {step.name}  {step.wall_s:.1f} s  {step.detail}", flush=True)
            steps.append(step)
            write(todo=todo)
    print(f"wrote {args.out}")
    return 0 if all(s.ok for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
