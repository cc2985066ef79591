"""The local backend on one GPU in one go (issue #28; docs/gpu.md says how to run it on a box with no network).

Runs, each in its own process, with a wall-clock cap per step and a budget for the whole (default 470 s):
1. `pytest -m gpu` (tests/test_gpu.py: bf16 training step vs float32, sampler/trainer agreement, conformance on cuda);
2. `runner conformance` against `runner serve --device DEV` (numeric checks at --atol/--rtol 5e-3, the bfloat16
   tolerance of tests/test_bf16.py);
3. `runner smoke FILE` for recipes.toml and every examples/*.toml, with RUNNER_LOCAL_DEVICE=DEV so the stand-in
   models run on DEV (device = "auto" would keep them on the CPU: backends/local/device.py);
4. sl_basic, rl_basic and dpo_basic in full with backend.device = DEV (bfloat16 on cuda), their headline metric's
   first and last value and wall time next to the CPU figures of bench/results/recipes.md (2 cores).
and writes a markdown report (default bench/results/gpu.md): card, versions, pass/fail and wall time per step.
Exit 0 when every step passed.

    bench/gpu_check.sh                                  # on the GPU box (installs the carried wheels first)
    python bench/gpu_check.py --device cpu --quick --out /tmp/gpu.md   # the same steps on the CPU, ~1-2 min
    bench/gpu_check.sh --steps suite --out bench/results/gpu-suite.md   # the whole suite there (a second call)
--quick: one smoke file (examples/sft_tiny.toml), the full runs cut to 2 steps, conformance's sampling group only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FULL = {"sl_basic": "test/nll", "rl_basic": "test/env/all/reward/total", "dpo_basic": "test/accuracy"}
BF16_TOL = "5e-3"


@dataclass
class Step:
    name: str
    ok: bool
    wall_s: float
    detail: str = ""
    rows: list[list[str]] = field(default_factory=list)  # extra table rows (smoke results, full runs)


class Budget:
    def __init__(self, total_s: float):
        self.end = time.monotonic() + total_s

    def left(self) -> float:
        return self.end - time.monotonic()


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
    for pkg in ("transformers", "peft", "tinker"):
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


def step_pytest(device: str, scratch: Path, budget: Budget, quick: bool) -> Step:
    rc, wall, tail = _run(_py("-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", str(REPO / "tests")),
                          REPO, _env(None), min(240.0, budget.left()), scratch / "pytest.log")
    # Exit 5: nothing collected/selected ran (every gpu test skipped where there is no CUDA device).
    summary = tail.splitlines()[-1] if tail else ""
    return Step("pytest -m gpu", rc in (0, 5) if device == "cpu" else rc == 0, wall,
                "timed out" if rc is None else summary)


def step_suite(device: str, scratch: Path, budget: Budget, quick: bool) -> Step:
    """The whole suite on this machine (not in the default steps: ~10 min on 2 cores, a few on the GPU box's 16 with
    pytest-xdist). Device = "auto" keeps its tiny models on the CPU, so it must pass where CUDA exists too."""
    workers = ["-n", str(max(1, min(14, (os.cpu_count() or 2) - 2)))] if _has_xdist() else []
    rc, wall, tail = _run(_py("-m", "pytest", "-p", "no:cacheprovider", *workers, str(REPO / "tests")), REPO,
                          _env(None), budget.left(), scratch / "suite.log")
    summary = tail.splitlines()[-1] if tail else ""
    return Step("pytest (the whole suite)", rc == 0, wall, "timed out" if rc is None else summary)


def _has_xdist() -> bool:
    import importlib.util

    return importlib.util.find_spec("xdist") is not None


def step_conformance(device: str, scratch: Path, budget: Budget, quick: bool) -> Step:
    env = _env(device)
    port_file = scratch / "serve.port"
    log = (scratch / "serve.log").open("w")
    server = subprocess.Popen(_py("-m", "runner", "serve", "--device", device, "--port", "0", "--port-file",
                                  str(port_file), "--storage", str(scratch / "serve-storage")),
                              cwd=scratch, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.monotonic()
    try:
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() - t0 > 90:
                return Step("conformance", False, time.monotonic() - t0,
                            "runner serve did not start: " + (scratch / "serve.log").read_text()[-300:])
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port_file.read_text().strip()}"
        only = ["--only", "sampling"] if quick else []
        rc, wall, _ = _run(_py("-m", "runner", "conformance", "--base-url", url, "--json", "--atol", BF16_TOL,
                               "--rtol", BF16_TOL, *only), scratch, env, min(300.0, budget.left()),
                           scratch / "conformance.json")
        try:
            text = (scratch / "conformance.json").read_text()
            results = json.loads(text[text.index("{"):])["results"]
            passed = sum(r["result"] == "pass" for r in results)
            bad = [f"{r['check']}: {r['result']} {r.get('detail', '')}"[:160] for r in results if r["result"] != "pass"]
            detail = f"{passed}/{len(results)} passed" + ("; " + "; ".join(bad) if bad else "")
        except (ValueError, KeyError):
            detail = "timed out" if rc is None else "no JSON report (see conformance.json)"
        return Step(f"conformance vs runner serve --device {device}", rc == 0, wall, detail)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def step_smoke(device: str, scratch: Path, budget: Budget, quick: bool) -> Step:
    files = [REPO / "examples" / "sft_tiny.toml"] if quick else [REPO / "recipes.toml",
                                                                  *sorted((REPO / "examples").glob("*.toml"))]
    rows, ok, total = [], True, 0.0
    for f in files:
        left = budget.left()
        if left < 5:
            rows.append([f.name, "-", "-", "-", "not run (budget spent)"])
            ok = False
            continue
        rc, wall, _ = _run(_py("-m", "runner", "smoke", str(f)), scratch, _env(device), min(240.0, left),
                           scratch / f"smoke-{f.stem}.log")
        total += wall
        table = [ln.split() for ln in (scratch / f"smoke-{f.stem}.log").read_text().splitlines()
                 if re.match(r"^\S+\s+\d+\s+\d+\s+[\d.]+\s+\S", ln)]
        rows += [[f"{f.name}#{r[0]}", r[1], r[2], r[3], " ".join(r[4:])] for r in table]
        if rc != 0:
            ok = False
            if not table:
                rows.append([f.name, "-", "-", f"{wall:.1f}", "timed out" if rc is None else f"exit {rc}"])
    n_ok = sum(r[-1] == "ok" for r in rows)
    return Step(f"smoke on {device} ({len(files)} files)", ok, total, f"{n_ok}/{len(rows)} recipes ok", rows)


def _cpu_figures() -> dict[str, tuple[str, str, str]]:
    """recipe -> (first, last, wall s) of its headline metric in bench/results/recipes.md (2 CPU cores)."""
    out = {}
    path = REPO / "bench" / "results" / "recipes.md"
    for line in path.read_text().splitlines() if path.is_file() else []:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] in FULL and cells[2] == f"`{FULL[cells[0]]}`":
            out[cells[0]] = (cells[3], cells[4], cells[6])
    return out


def step_full(device: str, scratch: Path, budget: Budget, quick: bool) -> Step:
    cpu = _cpu_figures()
    rows, ok, total = [], True, 0.0
    for name, metric in FULL.items():
        left = budget.left()
        if left < 5:
            rows.append([name, metric, "-", "-", "-", "not run (budget spent)", *cpu.get(name, ("", "", ""))])
            ok = False
            continue
        run_dir = scratch / f"{name}-{device}"
        extra = ["max_steps=2", "eval_every=1"] if quick else []
        rc, wall, tail = _run(_py("-m", "runner", "run", f"{REPO / 'recipes.toml'}#{name}", f"backend.device={device}",
                                  f"log_dir={run_dir}", *extra), REPO, _env(device), min(300.0, left),
                              scratch / f"{name}.log")
        total += wall
        vals = []
        metrics = run_dir / "metrics.jsonl"
        for line in metrics.read_text().splitlines() if metrics.is_file() else []:
            row = json.loads(line)
            if isinstance(row.get(metric), (int, float)):
                vals.append(row[metric])
        first, last = (f"{vals[0]:.3g}", f"{vals[-1]:.3g}") if vals else ("-", "-")
        where = next((ln for ln in tail.splitlines() if ln.startswith("device: ")), "")
        result = "ok" if rc == 0 else "timed out" if rc is None else f"exit {rc}"
        ok = ok and rc == 0
        rows.append([name, metric, first, last, f"{wall:.1f}", result, *cpu.get(name, ("", "", ""))])
        if where:
            rows[-1][5] += f" ({where.removeprefix('device: ').split(' (')[0]})"
    return Step(f"sl_basic, rl_basic, dpo_basic in full on {device}" + (" (--quick: 2 steps)" if quick else ""),
                ok, total, f"{sum(r[5].startswith('ok') for r in rows)}/{len(rows)} finished", rows)


def report(steps: list[Step], info: list[str], device: str, wall: float, quick: bool) -> str:
    lines = [f"<!-- bench/gpu_check.py --device {device}{' --quick' if quick else ''}, "
             f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC -->", "# The local backend on a GPU", "",
             *[f"- {x}" for x in info], f"- total wall time: {wall:.0f} s", "",
             "| step | result | wall s | detail |", "|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s.name} | {'pass' if s.ok else 'FAIL'} | {s.wall_s:.1f} | {s.detail.replace('|', '/')} |")
    for s in steps:
        if s.rows and s.name.startswith("smoke"):
            lines += ["", f"## {s.name}", "", "| recipe | stages | steps | wall s | result |", "|---|---|---|---|---|"]
            lines += ["| " + " | ".join(r) + " |" for r in s.rows]
        elif s.rows:
            lines += ["", f"## {s.name}", "", "Next to bench/results/recipes.md's CPU figures (2 cores, float32).", "",
                      f"| recipe | metric | first | last | wall s ({device}) | result | CPU first | CPU last "
                      "| CPU wall s |", "|---|---|---|---|---|---|---|---|---|"]
            lines += ["| " + " | ".join(r) + " |" for r in s.rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--quick", action="store_true", help="a small version of every step (a check of this script)")
    p.add_argument("--budget-s", type=float, default=470.0, help="wall-clock budget of all steps (default 470)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu.md")
    p.add_argument("--steps", nargs="+", default=["pytest", "conformance", "smoke", "full"],
                   choices=["pytest", "conformance", "smoke", "full", "suite"],
                   help="default: pytest (-m gpu) conformance smoke full; suite: the whole test suite (a call of its own)")
    args = p.parse_args(argv)
    import importlib.util

    missing = [m for m in ("msgspec", "tomli_w", "zstandard", "datasets", "tinker") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"error: {', '.join(missing)} not installed: run bench/gpu_wheels.sh where PyPI is reachable and carry "
              ".whl/ (bench/gpu_check.sh installs it; docs/gpu.md)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    budget = Budget(args.budget_s)
    info = env_info()
    print("\n".join(info), flush=True)
    funcs = {"pytest": step_pytest, "conformance": step_conformance, "smoke": step_smoke, "full": step_full,
             "suite": step_suite}
    steps = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        scratch = Path(tmp)
        (scratch / "examples").symlink_to(REPO / "examples")  # recipes name their data as examples/data/...
        for key in args.steps:
            if budget.left() < 5:
                steps.append(Step(key, False, 0.0, "not run (budget spent)"))
                continue
            step = funcs[key](args.device, scratch, budget, args.quick)
            print(f"{'pass' if step.ok else 'FAIL'}  {step.name}  {step.wall_s:.1f} s  {step.detail}", flush=True)
            steps.append(step)
        text = report(steps, info, args.device, time.monotonic() - t0, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0 if all(s.ok for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
