"""The SDK version matrix of `runner conformance` against `runner serve` (docs/conformance.md).

One `runner serve` process (tiny, CPU, this interpreter: the SDK version the backend pins) serves every
round; for each tinker version a throwaway venv at /tmp/venv-tinker-<V> runs `runner conformance --json` with
that version of the SDK. The venv sees this interpreter's packages (torch, transformers, ...) through a .pth
file and gets only `tinker==V` installed itself (`pip install --no-deps`: the SDK's dependencies are the ones
already here; an old SDK that needs others fails to import, and the matrix says so).

    python bench/conformance_matrix.py                          # the pinned version and 0.25.0
    python bench/conformance_matrix.py --versions 0.38.0 0.36.0 0.25.0 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import site
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def venv_python(v: str) -> str:
    """The interpreter of a venv with tinker==v (this interpreter itself for the installed version)."""
    if v == version("tinker"):
        return sys.executable
    root = Path(f"/tmp/venv-tinker-{v}")
    py = root / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", f"tinker=={v}"], check=True)
    sp = next((root / "lib").glob("python3*/site-packages"))
    (sp / "zz-parent-site-packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return str(py)


def serve(storage: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = storage / "port"
    proc = subprocess.Popen([sys.executable, "-m", "runner", "serve", "--port", "0", "--port-file", str(port_file),
                             "--storage", str(storage), "--device", "cpu"],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if port_file.exists():
            return proc, f"http://127.0.0.1:{port_file.read_text().strip()}"
        if proc.poll() is not None:
            raise SystemExit(f"runner serve exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("runner serve did not start within 60 s")


def run_version(v: str, url: str) -> dict[str, object]:
    try:
        py = venv_python(v)
    except subprocess.CalledProcessError as exc:
        return {"version": v, "error": f"install failed: {exc}"}
    t0 = time.monotonic()
    out = subprocess.run([py, "-m", "runner", "conformance", "--base-url", url, "--json"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO), "TINKER_API_KEY": "tml-matrix",
                              "TINKER_TELEMETRY": "0"},
                         capture_output=True, text=True, timeout=900)
    try:
        report = json.loads(out.stdout)
    except json.JSONDecodeError:
        return {"version": v, "error": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    results = report["results"]
    count = {k: sum(r["result"] == k for r in results) for k in ("pass", "FAIL", "skip", "known gap")}
    return {"version": report["sdk_version"], "exit": out.returncode, "seconds": round(time.monotonic() - t0, 1),
            **count, "failed": [f"{r['check']}: {r['detail']}" for r in results if r["result"] == "FAIL"],
            "skipped": [f"{r['check']}: {r['detail']}" for r in results if r["result"] == "skip"],
            "known": [f"{r['check']}: {r['detail']}" for r in results if r["result"] == "known gap"]}


def markdown(rows: list[dict[str, object]]) -> str:
    lines = ["| tinker SDK | passed | failed | skipped | known gaps | seconds |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['version']} | - | - | - | - | {r['error']} |")
        else:
            lines.append(f"| {r['version']} | {r['pass']} | {r['FAIL']} | {r['skip']} | {r['known gap']} | {r['seconds']} |")
    lines.append("")
    for r in rows:
        for label in ("failed", "known", "skipped"):
            for f in r.get(label, []):  # type: ignore[union-attr]
                lines.append(f"- {r['version']} {label}: {f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", nargs="+", default=[version("tinker"), "0.25.0"])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table instead of JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(Path(tmp))
        try:
            rows = [run_version(v, url) for v in args.versions]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(markdown(rows) if args.markdown else json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
