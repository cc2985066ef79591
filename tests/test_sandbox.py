"""runner/rewards/sandbox.py: hostile programs are killed or refused within their limits, and the next run works."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from runner.rewards.sandbox import RUN_UID_BASE, RUN_UID_SPAN, Limits, RunResult, Sandbox

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
    # Four slots, six programs, each stopped by the 2.5 s wall at the latest: two rounds, plus startup.
    assert time.monotonic() - start < 2 * LIMITS.wall_s + 4

    assert r["loop"].signal in {"SIGXCPU", "SIGKILL"} and r["loop"].exit_code is None
    assert r["loop"].seconds < LIMITS.wall_s + 1
    assert not r["fork_bomb"].ok and r["fork_bomb"].seconds < LIMITS.wall_s + 1
    assert r["memory_hog"].exit_code == 1 and "MemoryError" in r["memory_hog"].stderr
    assert not r["write_outside"].ok and not outside.exists()
    # Landlock refuses it (no namespaces), or the path is not in the view at all (bwrap/unshare).
    assert any(m in r["write_outside"].stderr for m in ("Permission denied", "No such file", "Read-only"))
    assert not r["big_file"].ok and "File too large" in r["big_file"].stderr
    assert r["sleeper"].timed_out and r["sleeper"].signal == "SIGKILL"
    assert r["sleeper"].seconds < LIMITS.wall_s + 1

    after = run(sandbox, "print('still here')")
    assert after.ok and after.stdout == "still here\n"


def test_fork_bomb_leaves_no_processes(sandbox: Sandbox) -> None:
    if not sandbox.containment.own_uid:
        pytest.skip("the code runs as this user: its processes cannot be told apart from the test's")
    run(sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    time.sleep(0.2)
    left = [p for p in os.listdir("/proc") if p.isdigit() and _is_sandbox_uid(_uid_of(p))]
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
        assert sleeper.timed_out and sleeper.seconds < LIMITS.wall_s + 1
    finally:
        sbx._setup.cache_clear()
