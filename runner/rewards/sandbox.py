"""Run untrusted code (a policy's reply) in a subprocess with limits. docs/sandbox.md says what it does and does not
contain; in short, per run:

- a fresh temp dir as cwd (and HOME), removed afterwards; the environment scrubbed to a few fixed variables;
- rlimits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC,
  counted per user: it binds only a non-root user, so a root parent runs each program as a fresh uid of its own), open files, no core;
- a wall-clock timeout that SIGKILLs the process group (and, with a PID namespace, every process the code made);
- where `unshare` works: new network namespace (no network, only a down loopback) and PID namespace;
- where the kernel has Landlock: writes refused everywhere but the temp dir (reads stay allowed), and TCP
  bind/connect refused (Landlock ABI >= 4) even without a network namespace;
- stdout/stderr go to files outside the temp dir, capped by the file-size limit and read back truncated.

`Sandbox.run_python(code, stdin)` runs one program; any number may be awaited at once, at most `max_parallel` run
at a time (the rest wait for a slot).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

# Runs inside the namespaces, before the untrusted program: limits, Landlock, uid, then exec. argv[1] is JSON.
_LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
cfg = json.loads(sys.argv[1])
# The launcher forks: the parent (PID 1 of the namespace when there is one, where a process ignores signals it has
# no handler for) waits and writes the child's fate to status_path; the child applies the limits and execs.
pid = os.fork()
if pid:
    _, status = os.waitpid(pid, 0)
    fate = {"code": os.waitstatus_to_exitcode(status)}
    if cfg["status_path"]:
        with open(cfg["status_path"], "w") as f:
            json.dump(fate, f)
    sys.exit(0)
done = {"landlock": 0, "nproc": False, "uid": os.geteuid()}
for name, (soft, hard) in cfg["rlimits"].items():
    try:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError):
        pass
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
abi = libc.syscall(444, None, 0, 1) if cfg["landlock"] else -1
if abi >= 1:
    write = 0b1111111110010 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    class Ruleset(ctypes.Structure):
        _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64)]
    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
    attr = Ruleset(write, 3 if abi >= 4 else 0)
    rs = libc.syscall(444, ctypes.byref(attr), 16 if abi >= 4 else 8, 0)
    if rs >= 0:
        ok = True
        for path in cfg["writable"]:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            ok = ok and libc.syscall(445, rs, 1, ctypes.byref(Beneath(write, fd)), 0) == 0
            os.close(fd)
        if ok and libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, rs, 0) == 0:
            done["landlock"] = abi
        os.close(rs)
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
    done["uid"] = cfg["uid"]
nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
done["nproc"] = nproc == cfg["rlimits"]["RLIMIT_NPROC"][0]
if cfg["probe"]:
    print(json.dumps(done), flush=True)
os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
"""

# A root parent runs each program as a uid of its own, drawn from this range (no passwd entry needed): RLIMIT_NPROC
# counts a user's processes machine-wide, so a shared uid (e.g. nobody) would let one run's fork bomb starve the
# others' forks and execs.
RUN_UID_BASE, RUN_UID_SPAN = 1_500_000_000, 500_000_000


def fresh_uid() -> int:
    return RUN_UID_BASE + secrets.randbelow(RUN_UID_SPAN)


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 512
    file_mb: int = 8
    nproc: int = 32
    open_files: int = 64
    # stdout/stderr kept per stream (the rest is dropped, and `truncated` set).
    output_bytes: int = 64_000


@dataclass(frozen=True)
class RunResult:
    stdout: str
    stderr: str
    # None when killed by a signal (then `signal` names it).
    exit_code: int | None
    signal: str | None
    timed_out: bool
    seconds: float
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class Containment:
    """What this machine lets the sandbox enforce (probed once per process)."""

    namespaces: bool  # network + PID namespaces via unshare(1)
    landlock: int  # Landlock ABI in force (0: none): writes outside the temp dir refused; >= 4: no TCP either
    nproc: bool  # RLIMIT_NPROC binds (the code runs as a non-root user)
    # The code runs as a fresh uid per run (RUN_UID_BASE + random) when the parent is root; else as the parent's user.
    own_uid: bool
    notes: list[str] = field(default_factory=list)

    @property
    def network_blocked(self) -> bool:
        return self.namespaces or self.landlock >= 4


def _unshare_prefix(root: bool) -> list[str]:
    exe = shutil.which("unshare")
    if exe is None:
        return []
    prefix = [exe, "--net", "--pid", "--fork", "--kill-child"]
    if not root:
        prefix.insert(1, "--map-root-user")
    try:
        ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else []


@cache
def _setup(python: str) -> tuple[tuple[str, ...], str, Containment]:
    """The unshare prefix, the interpreter and uid that work here, and what they contain (probed by running a
    program through the whole chain)."""
    root = os.geteuid() == 0
    prefix = _unshare_prefix(root)
    # A root parent runs the code as a fresh unprivileged uid (so RLIMIT_NPROC binds and file permissions apply),
    # with this interpreter if any user may run it, else the system's python3; as itself only when neither works.
    tries = [(python, True), ("/usr/bin/python3", True), (python, False)] if root else [(python, False)]
    done: dict[str, int | bool] = {"landlock": 0, "nproc": False}
    failure = "no interpreter tried"
    for interpreter, own_uid in tries:
        run_as = fresh_uid() if own_uid else None
        with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as d:
            if run_as is not None:
                os.chown(d, run_as, run_as)
            cfg = _config(Limits(), [interpreter, "-I", "-S", "-c", "print('ran')"], d, run_as, probe=True)
            try:
                proc = subprocess.run([*prefix, python, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)],
                                      capture_output=True, text=True, timeout=30)  # fmt: skip
            except (OSError, subprocess.SubprocessError) as e:
                failure = str(e)
                continue
        failure = proc.stderr.strip()[-300:]
        lines = proc.stdout.splitlines()
        if proc.returncode == 0 and lines[-1:] == ["ran"]:
            done = json.loads(lines[0])
            break
    else:
        raise RuntimeError(f"the sandbox cannot run {python} here: {failure}")
    notes = []
    if not prefix:
        notes.append("unshare(1) unavailable or refused: no network/PID namespaces")
    if not done["landlock"]:
        notes.append("no Landlock: writes outside the temp dir are limited only by file permissions")
    # RLIMIT_NPROC does not bind root; a non-root user is bound (per run inside a user namespace, else counting all
    # of the user's processes).
    nproc = bool(done["nproc"]) and (own_uid or not root)
    if not nproc:
        notes.append("RLIMIT_NPROC does not bind (root): process count bounded only by the wall timeout")
    elif not own_uid and not prefix:
        notes.append("RLIMIT_NPROC counts all of this user's processes (no user namespace)")
    return tuple(prefix), interpreter, Containment(bool(prefix), int(done["landlock"]), nproc, own_uid, notes)


def _config(
    limits: Limits, argv: list[str], workdir: str, uid: int | None, status_path: str = "", probe: bool = False
) -> dict[str, object]:
    mb = 1 << 20
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
    }
    rlimits = {
        # SIGXCPU at the soft limit (its default action kills), SIGKILL a second later if it is caught.
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
        "RLIMIT_AS": (limits.memory_mb * mb,) * 2,
        "RLIMIT_FSIZE": (limits.file_mb * mb,) * 2,
        "RLIMIT_NPROC": (limits.nproc,) * 2,
        "RLIMIT_NOFILE": (limits.open_files,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    # Landlock is a Linux syscall (the same number on every architecture); elsewhere 444 means something else.
    landlock = sys.platform.startswith("linux")
    return {"rlimits": rlimits, "landlock": landlock, "writable": [workdir], "uid": uid, "probe": probe,
            "argv": argv, "env": env, "status_path": status_path}  # fmt: skip


class Sandbox:
    def __init__(self, limits: Limits | None = None, max_parallel: int | None = None, python: str | None = None):
        self.limits = limits or Limits()
        self._launch_with = python or sys.executable
        self.max_parallel = max_parallel or max(1, os.cpu_count() or 1)
        # One semaphore per event loop (a semaphore binds to the loop it first waits in).
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._prefix, self.python, self.containment = _setup(self._launch_with)

    def __getstate__(self) -> dict[str, Any]:  # picklable (group builders hold it): the semaphores stay behind
        return {**self.__dict__, "_slots": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _slots=weakref.WeakKeyDictionary())

    async def run_python(self, code: str, stdin: str = "", files: dict[str, str] | None = None) -> RunResult:
        """Run `code` as main.py with `files` beside it and `stdin` on standard input."""
        return await self.run({**(files or {}), "main.py": code}, ["main.py"], stdin, python=True)

    async def run(self, files: dict[str, str], argv: list[str], stdin: str = "", python: bool = False) -> RunResult:
        """Write `files` into a fresh dir and run argv there (argv[0] relative to it, or an absolute program;
        python=True runs argv with this interpreter in isolated mode)."""
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.max_parallel))
        async with slots:
            return await self._run(files, argv, stdin, python)

    async def _run(self, files: dict[str, str], argv: list[str], stdin: str, python: bool) -> RunResult:
        with tempfile.TemporaryDirectory(prefix="sandbox-") as top:
            work, out = Path(top, "work"), Path(top, "out")
            work.mkdir()
            out.mkdir(mode=0o700)
            os.chmod(top, 0o711)  # the run's uid may pass through to work/, not list top or read out/
            for name, text in files.items():
                path = (work / name).resolve()
                if not path.is_relative_to(work.resolve()):
                    raise ValueError(f"sandbox file {name!r} is outside the work dir")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            uid = fresh_uid() if self.containment.own_uid else None
            if uid is not None:
                for p in (work, *work.rglob("*")):
                    os.chown(p, uid, uid)
            Path(top, "stdin").write_text(stdin)
            # -E -s: no PYTHON* variables, no user site (-I would also drop the script's dir from sys.path).
            full = [self.python, "-E", "-s", *argv] if python else list(argv)
            cfg = _config(self.limits, full, str(work), uid, str(out / "status"))
            cmd = [*self._prefix, self._launch_with, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)]
            start = time.monotonic()
            with open(Path(top, "stdin"), "rb") as fin, open(out / "o", "wb") as fo, open(out / "e", "wb") as fe:
                proc = await asyncio.create_subprocess_exec(
                    *cmd, stdin=fin, stdout=fo, stderr=fe, cwd=work, env=cfg["env"], start_new_session=True  # type: ignore[arg-type]
                )
                timed_out = False
                try:
                    await asyncio.wait_for(proc.wait(), self.limits.wall_s)
                except TimeoutError:
                    timed_out = True
                finally:
                    _kill_group(proc.pid)
                    await proc.wait()
            seconds = time.monotonic() - start
            stdout, t1 = _read(out / "o", self.limits.output_bytes)
            stderr, t2 = _read(out / "e", self.limits.output_bytes)
            status = out / "status"
            code: int | None = json.loads(status.read_text())["code"] if status.exists() else None
        sig = None
        if code is None:  # the launcher itself was killed: the wall timeout (or something outside)
            sig = "SIGKILL"
        elif code < 0:
            sig, code = signal.Signals(-code).name, None
        return RunResult(stdout, stderr, code, sig, timed_out, seconds, t1 or t2)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit
