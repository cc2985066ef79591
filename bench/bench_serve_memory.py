"""`runner serve`'s memory over many sampling clients: the server's RSS while one tinker SDK program makes
N sampling clients (`save_weights_and_get_sampling_client`, an optimizer step between every 10) and samples
from each, as an RL loop does every step.

Two servers, the same program: `runner serve` as shipped (at most --max-live-samplers sessions hold a loaded
model, 4 by default; idle ones are freed after 30 s, their snapshot spilled to disk) and the same with freeing
off (--max-live-samplers 100000 --sampler-idle-s 1e9: every session keeps its model, as the test server did).
Prints the server's RSS (VmRSS of its process) every 50 clients.

    python bench/bench_serve_memory.py                 # 500 clients per server (~2 min)
    python bench/bench_serve_memory.py --clients 200
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(tmp: Path, label: str, extra: list[str], clients: int) -> list[tuple[int, float]]:
    port_file = tmp / f"{label}.port"
    server = subprocess.Popen(
        [sys.executable, "-m", "runner", "serve", "--port", "0", "--port-file", str(port_file),
         "--storage", str(tmp / label), *extra],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not port_file.exists():
            if server.poll() is not None:
                raise SystemExit(f"runner serve {extra} failed to start")
            time.sleep(0.05)
        import tinker
        from tinker import types

        sc = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port_file.read_text().strip()}", api_key="tml-bench")
        tc = sc.create_lora_training_client("tiny", rank=8, seed=0).result()
        tok = tc.get_tokenizer()
        ids = tok.encode("Memory is what the server keeps.")
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
        prompt = types.ModelInput.from_ints(ids[:4])
        params = types.SamplingParams(max_tokens=8, seed=0)
        points = []
        t0 = time.perf_counter()
        for i in range(1, clients + 1):
            if i % 10 == 0:
                tc.forward_backward([datum], "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=1e-3))
            sampler = tc.save_weights_and_get_sampling_client().result()
            sampler.sample(prompt, 4, params).result()
            if i % 50 == 0 or i == 1:
                points.append((i, rss_mb(server.pid)))
                print(f"{label:8s} clients {i:4d}  server RSS {points[-1][1]:7.1f} MB  "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        sc.close("success").result()
        time.sleep(1.0)
        points.append((-1, rss_mb(server.pid)))
        print(f"{label:8s} after the session ended: server RSS {points[-1][1]:7.1f} MB", flush=True)
        return points
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--only-freeing", action="store_true", help="skip the server without freeing")
    args = ap.parse_args()
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with tempfile.TemporaryDirectory(prefix="bench-serve-mem-") as tmp_:
        tmp = Path(tmp_)
        runs = {"freeing": measure(tmp, "freeing", [], args.clients)}
        if not args.only_freeing:
            runs["keep-all"] = measure(tmp, "keep-all", ["--max-live-samplers", "100000", "--sampler-idle-s", "1e9"],
                                       args.clients)
    print()
    import numpy as np

    for label, pts in runs.items():
        steady = [(i, r) for i, r in pts if i >= 50]
        x, y = np.array([i for i, _ in steady], float), np.array([r for _, r in steady])
        slope = np.polyfit(x, y, 1)[0] if len(steady) > 1 else float("nan")
        print(f"{label:8s} RSS from 50 to {args.clients} clients: {y.min():.0f}-{y.max():.0f} MB, "
              f"trend {1024 * slope:+.0f} KB per client; after the session: {pts[-1][1]:.0f} MB")


if __name__ == "__main__":
    main()
