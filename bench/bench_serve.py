"""`runner run ... rl_basic` over `runner serve` (the tinker SDK over HTTP) vs the in-process local backend.

Both are the same command line, one with `backend={kind="tinker", base_url=...}` (and the tiny tokenizer),
each a fresh `runner run` process; rounds are interleaved (serve, local, serve, local, ...) so the machine's
load hits both alike, and the report is medians. One `runner serve` process serves every serve round, as a
user would keep it running. Reported per contender: wall time of the `runner run` process (start-up
included), the summed per-step time from its metrics.jsonl (`time/step`, the loop's own clock) and its
sampling part (`time/sampling`), and the final rewards (the two runs compute the same thing: with the same
seed they should match exactly). The server runs with `-v` (a log line per request), so each serve round
also reports the HTTP requests it made: `asample`, `retrieve_future` and all of them.

    python bench/bench_serve.py                 # rl_basic, 40 steps, 3 rounds (~3 min on 2 busy cores)
    python bench/bench_serve.py --steps 20 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(log_dir: Path, steps: int, recipe: str, base_url: str | None) -> dict[str, float]:
    cmd = [sys.executable, "-m", "runner", "run", recipe, f"max_steps={steps}", f"log_dir={log_dir}"]
    if base_url is not None:
        cmd += [f'backend={{kind="tinker", base_url="{base_url}"}}', "tokenizer=tiny"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TINKER_API_KEY": "tml-bench", "TINKER_TELEMETRY": "0"}
    t = time.perf_counter()
    out = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "time/step" in r]
    return {"wall": wall, "steps": sum(r["time/step"] for r in train),
            "sampling": sum(r.get("time/sampling", 0.0) for r in train),
            "reward": train[-1].get("env/all/reward/total", float("nan")),
            "test": rows[-1].get("test/env/all/reward/total", float("nan"))}


def requests(log: Path) -> list[str]:
    """The last path segment of every request `runner serve -v` has logged so far ("POST /api/v1/asample -> 200")."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        parts = line.split()
        if "->" in parts and parts.index("->") >= 2 and parts[parts.index("->") - 2] in ("GET", "POST", "PUT", "DELETE"):
            out.append(parts[parts.index("->") - 1].rstrip("/").rsplit("/", 1)[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--recipe", default="recipes.toml#rl_basic")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp_:
        tmp = Path(tmp_)
        port_file = tmp / "port"
        server = subprocess.Popen(
            [sys.executable, "-m", "runner", "serve", "-v", "--port", "0", "--port-file", str(port_file),
             "--storage", str(tmp / "storage")],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL,
            stderr=open(tmp / "serve.log", "w"))  # noqa: SIM115 - open while the server runs
        try:
            while not port_file.exists():
                if server.poll() is not None:
                    raise SystemExit((tmp / "serve.log").read_text())
                time.sleep(0.05)
            url = f"http://127.0.0.1:{port_file.read_text().strip()}"
            results: dict[str, list[dict[str, float]]] = {"serve": [], "local": []}
            for r in range(args.rounds):
                for name in ("serve", "local"):
                    seen = len(requests(tmp / "serve.log"))
                    res = run(tmp / f"{name}-{r}", args.steps, args.recipe, url if name == "serve" else None)
                    results[name].append(res)
                    made = ""
                    if name == "serve":
                        routes = requests(tmp / "serve.log")[seen:]
                        made = (f"  requests: asample {routes.count('asample')}, retrieve_future "
                                f"{routes.count('retrieve_future')}, all {len(routes)}")
                    print(f"round {r + 1} {name:5s}  wall {res['wall']:6.2f} s  steps {res['steps']:6.2f} s  "
                          f"sampling {res['sampling']:6.2f} s  reward {res['reward']:.4f}  test {res['test']:.4f}"
                          f"{made}", flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
    med = {n: {k: statistics.median(x[k] for x in rs) for k in ("wall", "steps", "sampling")} for n, rs in results.items()}
    print(f"\nmedians over {args.rounds} rounds, {args.recipe}, {args.steps} steps:")
    for n in ("local", "serve"):
        print(f"  {n:5s}  wall {med[n]['wall']:6.2f} s  steps {med[n]['steps']:6.2f} s  sampling {med[n]['sampling']:6.2f} s")
    print(f"  serve / local:  wall {med['serve']['wall'] / med['local']['wall']:.2f}x  "
          f"steps {med['serve']['steps'] / med['local']['steps']:.2f}x")
    same = all(a["reward"] == b["reward"] for a, b in zip(results["serve"], results["local"], strict=True))
    print(f"  same rewards over HTTP as in process: {same}")


if __name__ == "__main__":
    main()
