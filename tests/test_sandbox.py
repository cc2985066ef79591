"""runner/rewards/sandbox.py: hostile programs are killed or refused within their limits, and the next run works."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_sandbox import HOGS, WRITERS  # the 16 writers and 8 memory hogs, measured by the bench too

from runner.rewards.sandbox import ISOLATIONS, RUN_UID_BASE, RUN_UID_SPAN, WORK, Limits, RunResult, Sandbox

LIMITS = Limits(cpu_s=1, wall_s=2.5, memory_mb=256, file_mb=1, nproc=16, output_bytes=4096)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(LIMITS, max_parallel=4)


def run(sb: Sandbox, code: str, stdin: str = "") -> RunResult:
    return asyncio.run(sb.run_python(code, stdin))


def test_stdin_to_stdout(sandbox: Sandbox) -> None:
    r = run(sandbox, "n = int(input())\nprint(sum(range(n + 1)))", "10\n")
    assert r.ok and r.stdout == "55\n" and r.stderr == ""


def test_assert_failure_is_a_nonzero_exit(sandbox: Sandbox) -> None:
    r = run(sandbox, "def f(x):\n    return x * 2\nassert f(2) == 4\nassert f(3) == 7, 'f(3)'")
    assert r.exit_code == 1 and not r.timed_out and "AssertionError: f(3)" in r.stderr


def test_hostile_programs_are_stopped_and_the_next_run_works(sandbox: Sandbox, tmp_path: Path) -> None:
    outside = tmp_path / "escaped.txt"
    hostile = {
        "loop": "while True:\n    pass",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "memory_hog": "blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))",
        "write_outside": f"open({str(outside)!r}, 'w').write('escaped')",
        "big_file": "open('big', 'wb').write(b'x' * (4 << 20))",
        "sleeper": "import time\ntime.sleep(60)",
    }

    async def all_at_once() -> dict[str, RunResult]:
        results = await asyncio.gather(*(sandbox.run_python(code) for code in hostile.values()))
        return dict(zip(hostile, results, strict=True))

    start = time.monotonic()
    r = asyncio.run(all_at_once())
    # Four slots, six programs, each stopped by the 2.5 s wall at the latest: two rounds, plus startup (room for a
    # loaded machine; the sleeper alone would take 60 s unstopped).
    assert time.monotonic() - start < 2 * LIMITS.wall_s + 30

    assert r["loop"].signal in {"SIGXCPU", "SIGKILL"} and r["loop"].exit_code is None
    assert r["loop"].seconds < LIMITS.wall_s + 10  # the kill and the reaping, late under load
    assert not r["fork_bomb"].ok and r["fork_bomb"].seconds < LIMITS.wall_s + 10
    assert r["memory_hog"].exit_code == 1 and "MemoryError" in r["memory_hog"].stderr
    assert not r["write_outside"].ok and not outside.exists()
    # Landlock refuses it (no namespaces), or the path is not in the view at all (bwrap/unshare).
    assert any(m in r["write_outside"].stderr for m in ("Permission denied", "No such file", "Read-only"))
    assert not r["big_file"].ok and "File too large" in r["big_file"].stderr
    assert r["sleeper"].timed_out and r["sleeper"].signal == "SIGKILL"
    assert r["sleeper"].seconds < LIMITS.wall_s + 10  # not its 60 s

    after = run(sandbox, "print('still here')")
    assert after.ok and after.stdout == "still here\n"


def test_fork_bomb_leaves_no_processes(sandbox: Sandbox) -> None:
    if not sandbox.containment.own_uid:
        pytest.skip("the code runs as this user: its processes cannot be told apart from the test's")
    run(sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    deadline = time.monotonic() + 30  # killed processes leave /proc once reaped (a fixed 0.2 s before)
    while (left := [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox_uid(_uid_of(p))]) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert left == []


def _is_sandbox_uid(uid: int | None) -> bool:
    return uid is not None and RUN_UID_BASE <= uid < RUN_UID_BASE + RUN_UID_SPAN


def _uid_of(pid: str) -> int | None:
    try:
        for line in Path("/proc", pid, "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def test_no_network_where_contained(sandbox: Sandbox) -> None:
    if not sandbox.containment.network_blocked:
        pytest.skip("no network or Landlock containment on this machine (docs/sandbox.md)")
    r = run(sandbox, "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)")
    assert r.exit_code == 1 and ("Permission denied" in r.stderr or "unreachable" in r.stderr.lower()
                                 or "refused" in r.stderr.lower())  # fmt: skip


def test_cwd_is_a_fresh_dir_and_env_is_scrubbed(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "do-not-leak")
    code = "import os\nprint(sorted(os.listdir('.')))\nprint(os.environ.get('SECRET_TOKEN'))\nopen('x', 'w').write('1')"
    first, second = run(sandbox, code), run(sandbox, code)
    assert first.stdout == second.stdout == "['main.py']\nNone\n"


def test_output_is_truncated(sandbox: Sandbox) -> None:
    r = run(sandbox, "for _ in range(10000):\n    print('y' * 100)")
    assert r.truncated and len(r.stdout) == LIMITS.output_bytes


def test_parallel_runs_keep_their_own_io() -> None:
    sb = Sandbox(LIMITS, max_parallel=3)

    async def many() -> list[RunResult]:
        return await asyncio.gather(*(sb.run_python("print(int(input()) ** 2)", f"{i}\n") for i in range(8)))

    assert [r.stdout for r in asyncio.run(many())] == [f"{i * i}\n" for i in range(8)]


def test_files_beside_main_and_no_escape(sandbox: Sandbox) -> None:
    r = asyncio.run(sandbox.run_python("import helper\nprint(helper.X)", files={"helper.py": "X = 7"}))
    assert r.stdout == "7\n"
    with pytest.raises(ValueError, match="outside"):
        asyncio.run(sandbox.run_python("pass", files={"../evil.py": ""}))


def test_without_unshare_the_rest_still_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """No unshare(1) (a container without user namespaces): the run still works, with rlimits, the wall kill and
    Landlock, and `containment` says what is missing."""
    import runner.rewards.sandbox as sbx

    monkeypatch.setattr(sbx.shutil, "which", lambda name: None)
    sbx._setup.cache_clear()
    try:
        sb = Sandbox(LIMITS, max_parallel=2)
        assert not sb.containment.namespaces and any("unshare" in n for n in sb.containment.notes)

        async def both() -> list[RunResult]:
            return list(await asyncio.gather(sb.run_python("print(input())", "ok\n"),
                                             sb.run_python("import time\ntime.sleep(60)")))

        echo, sleeper = asyncio.run(both())
        assert echo.ok and echo.stdout == "ok\n"
        assert sleeper.timed_out and sleeper.seconds < LIMITS.wall_s + 10  # not its 60 s
    finally:
        sbx._setup.cache_clear()


# ------------------------------------------------------------------------------------- the view (bwrap / unshare)

ROOT = Path(__file__).resolve().parents[1]
DATASET = ROOT / "examples/data/code_problems.jsonl"


def isolated(isolation: str, limits: Limits = LIMITS) -> Sandbox:
    try:
        return Sandbox(limits, max_parallel=4, isolation=isolation)
    except RuntimeError as e:
        pytest.skip(f"{isolation} does not work here: {e}")


@pytest.mark.parametrize("isolation", ["bwrap", "unshare"])
def test_view_shows_only_the_run(isolation: str, tmp_path: Path) -> None:
    """Only the interpreter (read-only), its own work dir and its own processes: not the dataset, not the test's
    files, not the host's processes, and no path-named Unix socket (a listener in the host's tmp gets nothing)."""
    sb = isolated(isolation)
    assert sb.containment.isolation == isolation and sb.containment.namespaces
    sock_path = tmp_path / "listener.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)
    listener.setblocking(False)
    probe = f"""
import json, os, socket
procs = [p for p in os.listdir('/proc') if p.isdigit()]
cmds = [open(f'/proc/{{p}}/cmdline', 'rb').read() for p in procs]
out = {{"procs": len(procs), "pytest": any(b"pytest" in c for c in cmds), "root": sorted(os.listdir('/')),
       "tmp_entries": sorted(os.listdir('/tmp')) if os.path.isdir('/tmp') else []}}
for name, path in [("dataset", {str(DATASET)!r}), ("tmp", {str(tmp_path)!r})]:
    out[name] = os.path.exists(path)
try:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({str(sock_path)!r})
    s.sendall(b"leak")
    out["socket"] = "connected"
except OSError as e:
    out["socket"] = type(e).__name__
try:
    open('/usr/escape', 'w')
    out["ro"] = False
except OSError:
    out["ro"] = True
print(json.dumps(out))
"""
    try:
        r = run(sb, probe)
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()
    assert r.ok, r.stderr
    got = json.loads(r.stdout)
    # The launcher's PID 1 (bwrap's --as-pid-1: the launcher) and the program; unshare adds nothing.
    assert got["procs"] <= 3 and not got["pytest"]
    assert not got["dataset"] and not got["tmp"] and got["socket"] == "FileNotFoundError" and got["ro"]
    assert WORK.strip("/") in got["root"]
    # The host's /tmp is not there: a /tmp in the view holds at most the path down to the interpreter's own folders
    # (read-only), when the interpreter (a venv, say, as in a CI clone) lives under /tmp.
    homes = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.executable)}
    assert set(got["tmp_entries"]) <= {h.parts[2] for h in homes if len(h.parts) > 2 and h.parts[1] == "tmp"}


def test_without_namespaces_the_socket_and_processes_are_reachable() -> None:
    """What the fallback lacks (docs/sandbox.md), measured: a path socket in the host's tmp is reached and the host's
    processes are listed."""
    sb = isolated("none")
    assert not sb.containment.namespaces and any("no namespaces" in n for n in sb.containment.notes)
    # In a folder any uid may pass (pytest's tmp_path is under a 0700 folder, which would stop the run's uid).
    sock_path = Path(tempfile.mkdtemp(prefix="listener-")) / "listener.sock"
    os.chmod(sock_path.parent, 0o755)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock_path))
    listener.listen(1)
    listener.settimeout(10)
    os.chmod(sock_path, 0o777)
    code = (f"import os, socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(sock_path)!r})\n"
            "print(sum(p.isdigit() for p in os.listdir('/proc')))")  # fmt: skip
    try:
        r = run(sb, code)
        conn, _ = listener.accept()
        conn.close()
    finally:
        listener.close()
        shutil.rmtree(sock_path.parent)
    assert r.ok and int(r.stdout) > 3


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_concurrent_run_cannot_read_another(isolation: str) -> None:
    """Run B is given the exact host path of run A's program (and its stdin) while A runs, and reads neither."""
    sb = isolated(isolation, dataclasses.replace(LIMITS, wall_s=30))  # A outlives B however slow B's start
    if not sb.containment.namespaces and not sb.containment.own_uid:
        pytest.skip("no namespaces and no uid per run (a non-root parent): runs share a uid, files cannot part them")
    secret = f"secret-{os.getpid()}-{time.monotonic_ns()}"

    async def both() -> RunResult:
        # A runs until B is done, then is cancelled (the sandbox kills its process group): no fixed sleep.
        a = asyncio.create_task(sb.run_python(f"# {secret}\nimport time\ntime.sleep(60)", stdin=secret))
        paths: list[Path] = []
        deadline = time.monotonic() + 25  # within A's 30 s wall (100 x 30 ms before: a loaded machine's start)
        while time.monotonic() < deadline:
            paths = [p for p in Path(tempfile.gettempdir()).glob("sandbox-*/work/main.py") if _holds(p, secret)]
            if paths:
                break
            await asyncio.sleep(0.03)
        assert paths, "run A's files never appeared"
        targets = [str(paths[0]), str(paths[0].parent.parent / "out" / "stdin")]
        code = ("import sys\nfor p in sys.argv[1:] or " + repr(targets) + ":\n    try:\n        print(open(p).read())\n"
                "    except OSError as e:\n        print(type(e).__name__)")  # fmt: skip
        b = await sb.run_python(code)
        assert not a.done(), "run A ended before run B tried its files"
        a.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await a
        return b

    b = asyncio.run(both())
    assert b.ok and secret not in b.stdout
    expected = "FileNotFoundError" if isolation != "none" else "PermissionError"
    assert b.stdout.split() == [expected, expected]


def _holds(path: Path, text: str) -> bool:
    try:
        return text in path.read_text()
    except OSError:
        return False


@pytest.mark.parametrize("isolation", ["bwrap", "unshare"])
def test_sixteen_writers_fill_only_the_work_tmpfs(isolation: str) -> None:
    """16 processes writing as fast as they can share the work dir's tmpfs: together they write at most work_mb."""
    sb = isolated(isolation, Limits(cpu_s=5, wall_s=10.0, memory_mb=128, file_mb=4, nproc=32, work_mb=16))
    r = run(sb, WRITERS)
    assert r.ok, r.stderr
    written = int(r.stdout)
    assert 8 << 20 < written <= 16 << 20  # it did fill the tmpfs, and no more


def test_memory_of_eight_forked_hogs() -> None:
    """8 forked processes each holding 48 MiB: with a cgroup their total is capped at memory_mb (128 MiB: the rest
    are OOM-killed); without one each is capped alone, so all 8 hold theirs (384 MiB: the stated fallback,
    nproc × memory_mb)."""
    sb = Sandbox(Limits(cpu_s=5, wall_s=10.0, memory_mb=128, nproc=32), max_parallel=1)
    if not sb.containment.namespaces and not sb.containment.own_uid:
        pytest.skip("RLIMIT_NPROC counts all of this user's processes here: the 8 forks may be refused")
    r = run(sb, HOGS)
    assert r.ok, r.stderr
    held = int(r.stdout)
    if sb.containment.cgroup:
        assert held <= 128
    else:
        assert held == 8 * 48 and any("no cgroup" in n for n in sb.containment.notes)


def test_unknown_isolation_is_refused() -> None:
    with pytest.raises(ValueError, match="isolation must be one of"):
        Sandbox(LIMITS, isolation="docker")
