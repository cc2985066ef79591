"""`runner serve`'s start-up and first /v1 request: seconds from launch until the port file is written (the port is
ready), then the wall time of the first and of the second `POST /v1/chat/completions` (tiny, 4 tokens, CPU).
The first read of a model's shapes imports transformers' modeling code for it; the server does that before it
reports its port (backends/serve/http.py `warm_shapes`), so the first request costs about what the second does.

    python bench/bench_serve_first_request.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def once() -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "runner", "serve", "--port", "0", "--port-file", str(port_file),
                                 "--storage", str(Path(tmp) / "s"), "--device", "cpu"], cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not port_file.exists():
                if proc.poll() is not None:
                    raise SystemExit("runner serve exited before it listened")
                time.sleep(0.02)
            ready = time.perf_counter() - t0
            url = f"http://127.0.0.1:{port_file.read_text().strip()}/v1/chat/completions"
            body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                               "max_tokens": 4}).encode()
            took = []
            for _ in range(2):
                t = time.perf_counter()
                req = urllib.request.Request(url, body, {"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=300) as r:
                    r.read()
                took.append(time.perf_counter() - t)
            return ready, took[0], took[1]
        finally:
            proc.terminate()
            proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description="runner serve's start-up and first /v1 request")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    for _ in range(args.runs):
        ready, first, second = once()
        print(f"port ready {ready:.2f} s; first /v1 request {first:.2f} s; second {second:.2f} s", flush=True)


if __name__ == "__main__":
    main()
