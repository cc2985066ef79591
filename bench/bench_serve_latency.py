"""One request's round trip through `runner serve`'s HTTP layer, idle and beside a thread that holds the GIL (as the
sampler's Python code does between torch calls): 300 `POST /api/v1/healthz` over one keep-alive connection, after 50
to warm up. The server runs in this process (backends/serve/http.py `running`), on the tiny model, CPU.

    python bench/bench_serve_latency.py          # idle, then with a busy thread
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import httpx

from backends.serve.http import ServeConfig, build_service, running

N = 300


def per_request_ms(url: str) -> float:
    with httpx.Client(base_url=url) as c:
        for _ in range(50):
            c.post("/api/v1/healthz", json={})
        t = time.perf_counter()
        for _ in range(N):
            c.post("/api/v1/healthz", json={})
        return (time.perf_counter() - t) / N * 1000


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        svc = build_service(ServeConfig(storage=Path(tmp) / "s", device="cpu"))
        stop = threading.Event()

        def busy() -> None:
            x = 0
            while not stop.is_set():
                for i in range(10_000):
                    x += i

        try:
            with running(svc) as srv:
                url = f"http://127.0.0.1:{srv.server_address[1]}"  # the stdlib server's too (for comparisons)
                print(f"idle: {per_request_ms(url):.2f} ms per healthz")
                threading.Thread(target=busy, daemon=True).start()
                print(f"beside a busy thread: {per_request_ms(url):.2f} ms per healthz")
        finally:
            stop.set()
            svc.close()


if __name__ == "__main__":
    main()
