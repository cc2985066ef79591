"""What the code sandbox holds on this machine, per isolation path (docs/sandbox.md's figures): which paths work,
whether a cgroup is made, processes visible in /proc, whether a path-named Unix socket in the host's tmp is
reached, bytes written by 16 forked writers, memory held by 8 forked 48 MiB hogs, and the time of one `print(1)`
run (median of 5, each path measured in the same run, so the ratio to the unisolated path is the figure to keep);
then, on the preferred path, one assert test judged by the harness (runner/rewards/harness.py) against the old way
(the assert appended to the program, exit 0 a pass), medians of 5 interleaved.

    python bench/bench_sandbox.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.rewards.sandbox import ISOLATIONS, Limits, Sandbox
from runner.rl.envs.code import run_check

LIMITS = Limits(cpu_s=5, wall_s=15.0, memory_mb=128, file_mb=4, nproc=32, work_mb=16)

WRITERS = """
import os
kids = []
for i in range(16):
    pid = os.fork()
    if pid == 0:
        n = 0
        try:
            while True:
                with open(f"w{i}-{n}", "wb") as f:
                    for _ in range(4):
                        f.write(b"x" * (1 << 20))
                n += 1
        except OSError:
            os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
print(sum(os.path.getsize(f) for f in os.listdir(".") if f.startswith("w")))
"""

HOGS = """
import os, time
r, w = os.pipe()
kids = []
for i in range(8):
    pid = os.fork()
    if pid == 0:
        block = bytearray(48 << 20)
        for j in range(0, len(block), 4096):
            block[j] = 1
        os.write(w, b"x")
        time.sleep(2)
        os._exit(0)
    kids.append(pid)
os.close(w)
for pid in kids:
    os.waitpid(pid, 0)
held = 0
while os.read(r, 1):
    held += 48
print(held)
"""


def probe(sock_path: str) -> str:
    return f"""
import json, os, socket
out = {{"procs": sum(p.isdigit() for p in os.listdir('/proc'))}}
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect({sock_path!r})
    out["socket"] = "reached"
except OSError as e:
    out["socket"] = type(e).__name__
print(json.dumps(out))
"""


def run(sb: Sandbox, code: str) -> str:
    r = asyncio.run(sb.run_python(code))
    return r.stdout.strip() if r.ok else f"failed: {(r.stderr.strip().splitlines() or [r.signal or ''])[-1]}"


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help; no options
    folder = Path(tempfile.mkdtemp(prefix="bench-sandbox-"))
    os.chmod(folder, 0o755)
    sock_path = str(folder / "listener.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    os.chmod(sock_path, 0o777)
    listener.listen(8)
    print(f"python {sys.version.split()[0]}, uid {os.geteuid()}, {os.uname().sysname} {os.uname().release}")
    times: dict[str, float] = {}
    for isolation in ISOLATIONS:
        try:
            sb = Sandbox(LIMITS, max_parallel=1, isolation=isolation)
        except RuntimeError as e:
            print(f"{isolation}: unavailable ({str(e)[:200]})")
            continue
        c = sb.containment
        seen = json.loads(run(sb, probe(sock_path)))
        written = run(sb, WRITERS) if isolation != "none" else "skipped (no tmpfs: it would fill the disk)"
        held = run(sb, HOGS)
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            run(sb, "print(1)")
            runs.append(time.perf_counter() - start)
        times[isolation] = statistics.median(runs)
        print(f"{isolation}: cgroup={c.cgroup or 'none'} landlock={c.landlock} own_uid={c.own_uid} "
              f"procs_visible={seen['procs']} path_socket={seen['socket']} "
              f"16_writers_bytes={written} 8_hogs_held_mib={held} print1_s={times[isolation]:.3f}")  # fmt: skip
        for note in c.notes:
            print(f"  note: {note}")
    listener.close()
    os.unlink(sock_path)
    folder.rmdir()
    if "none" in times:
        print("per-run time / unisolated: " + ", ".join(f"{k} {v / times['none']:.2f}x" for k, v in times.items()))
    sb = Sandbox(LIMITS, max_parallel=1)
    program, check = "def add(a, b):\n    return a + b", "assert add(1, 2) == 3"
    old, new = [], []
    for _ in range(5):
        start = time.perf_counter()
        assert asyncio.run(sb.run_python(program + "\n\n" + check)).ok
        old.append(time.perf_counter() - start)
        start = time.perf_counter()
        assert asyncio.run(run_check(sb, program, check))[0]
        new.append(time.perf_counter() - start)
    o, n = statistics.median(old), statistics.median(new)
    print(f"assert test on {sb.containment.isolation}: appended {o:.3f} s, harness {n:.3f} s ({n / o:.2f}x)")


if __name__ == "__main__":
    main()
