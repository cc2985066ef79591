"""Run untrusted code (a policy's reply) in a subprocess with limits. docs/sandbox.md says what it does and does not
contain; in short, per run:

- its own view of the files where bubblewrap or unshare(1) works (`Containment.isolation`: "bwrap", "unshare" or
  "none"): mount, PID and network namespaces holding only the interpreter and system libraries (read-only), a fresh
  /proc, and a size-limited tmpfs work dir (cwd, HOME, TMPDIR) with a copy of the run's files;
- a cgroup v2 per run (memory.max, pids.max over all its processes) where one can be made;
- rlimits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), processes (RLIMIT_NPROC,
  counted per user: it binds only a non-root user, so a root parent runs each program as a fresh uid of its own),
  open files, no core;
- a wall-clock timeout that SIGKILLs the process group (and, with a PID namespace, every process the code made);
- where the kernel has Landlock: writes refused everywhere but the work dir, and TCP bind/connect refused (Landlock
  ABI >= 4) even without a network namespace;
- the environment scrubbed to a few fixed variables; stdout/stderr go to files outside the work dir, capped by the
  file-size limit and read back truncated.

`Sandbox.run_python(code, stdin)` runs one program; any number may be awaited at once, at most `max_parallel` run
at a time (the rest wait for a slot). `Sandbox.run(..., harness=True)` runs a judge that keeps its uid and runs the
untrusted part itself (runner/rewards/harness.py).
"""

from __future__ import annotations

import asyncio
import atexit
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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.types import Json

# Runs inside the namespaces, before the untrusted program: the private file system view (the unshare path; bwrap
# builds its own), limits, Landlock, uid, then exec. argv[1] is JSON. Only the standard library: it runs with -I -S.
_LAUNCHER = r"""
import ctypes, json, os, platform, resource, shutil, signal, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
# Not dumpable: a process of the run with the same uid (a non-root parent) cannot open our /proc/1/fd/* (the run's
# stdin and stdout: a harness's job and verdict) or trace us; execve makes the program dumpable again.
libc.prctl(4, 0, 0, 0, 0)
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18

def mount(src, dst, kind, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(kind), ctypes.c_ulong(flags), enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {kind or src} on {dst}: {os.strerror(err)}")

def own(path, uid):
    for d, dirs, files in os.walk(path):
        for name in [d, *(os.path.join(d, f) for f in dirs + files)]:
            os.lchown(name, uid, uid)

fs, uid, work = cfg["fs"], cfg["uid"], cfg["writable"][0]
if fs["mode"] == "unshare":
    # A new root on a small tmpfs: the interpreter and its libraries bound read-only, a size-limited tmpfs work dir
    # holding a copy of the run's files, a fresh /proc (this PID namespace's), four /dev nodes; then pivot_root.
    root = fs["root"]
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
    for p in fs["ro"]:
        dst = root + p
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(p):
            os.symlink(os.readlink(p), dst)
            continue
        if os.path.isdir(p):
            os.makedirs(dst, exist_ok=True)
        else:
            open(dst, "w").close()
        mount(p, dst, None, BIND | REC)
        mount(None, dst, None, BIND | REMOUNT | RDONLY | NOSUID | NODEV)
    os.mkdir(root + "/dev")
    mount("tmpfs", root + "/dev", "tmpfs", NOSUID | NOEXEC, "size=64k,mode=755")
    for node in ("null", "zero", "random", "urandom"):
        open(f"{root}/dev/{node}", "w").close()
        mount(f"/dev/{node}", f"{root}/dev/{node}", None, BIND)
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.mkdir(root + work)
    mount("tmpfs", root + work, "tmpfs", NOSUID | NODEV, f"size={fs['work_mb']}m,mode=700")
    shutil.copytree(fs["src"], root + work, dirs_exist_ok=True)
    os.chdir(root)
    nr = {"x86_64": 155, "aarch64": 41}.get(platform.machine())
    if nr is not None and libc.syscall(nr, b".", b".") == 0:
        libc.umount2(b".", 2)  # MNT_DETACH: the old root, stacked under the new one
    else:
        os.chroot(".")
    os.chdir("/")
    mount(None, "/", None, REMOUNT | RDONLY | NOSUID | NODEV, "size=1m,mode=755")
if fs["mode"] != "none":
    os.chdir(work)
    if uid is not None:
        own(work, uid)
# The launcher forks: the parent (PID 1 of the namespace in the unshare path, where a process ignores signals it has
# no handler for) waits and writes the child's fate to the status fd; the child applies the limits and execs.
status_fd = cfg["status_fd"]
pid = os.fork()
if pid:
    _, status = os.waitpid(pid, 0)
    if status_fd >= 0:
        os.write(status_fd, json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
    sys.exit(0)
if status_fd >= 0:
    os.close(status_fd)
done = {"landlock": 0, "nproc": False, "uid": os.geteuid(), "fs": fs["mode"]}
for name, (soft, hard) in cfg["rlimits"].items():
    try:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    except (ValueError, OSError):
        pass
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
# A harness keeps its uid (root, or the namespace's root) and runs the code itself as `uid` (harness.py).
if uid is not None and not cfg["harness"]:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    done["uid"] = uid
nproc = resource.getrlimit(resource.RLIMIT_NPROC)[0]
done["nproc"] = nproc == cfg["rlimits"]["RLIMIT_NPROC"][0]
if cfg["probe"]:
    done["root"] = sorted(os.listdir("/"))
    done["procs"] = sum(p.isdigit() for p in os.listdir("/proc"))
    print(json.dumps(done), flush=True)
os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])
"""

# A root parent runs each program as a uid of its own, drawn from this range (no passwd entry needed): RLIMIT_NPROC
# counts a user's processes machine-wide, so a shared uid (e.g. nobody) would let one run's fork bomb starve the
# others' forks and execs.
RUN_UID_BASE, RUN_UID_SPAN = 1_500_000_000, 500_000_000
# The work dir inside the bwrap/unshare view (cwd, HOME and TMPDIR); a tmpfs of Limits.work_mb.
WORK = "/sandbox"
# How a run is isolated, most preferred first (docs/sandbox.md): bubblewrap where installed, else unshare(1) with
# the same view built by the launcher, else no namespaces at all.
ISOLATIONS = ("bwrap", "unshare", "none")
# System paths bound read-only into the view (those that exist), besides the interpreter's prefixes.
SYSTEM_RO = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/ld.so.conf",
             "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives")  # fmt: skip


def fresh_uid() -> int:
    return RUN_UID_BASE + secrets.randbelow(RUN_UID_SPAN)


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 5.0
    # Per process (RLIMIT_AS); with a cgroup also the whole run's memory.max.
    memory_mb: int = 512
    file_mb: int = 8
    nproc: int = 32
    open_files: int = 64
    # stdout/stderr kept per stream (the rest is dropped, and `truncated` set).
    output_bytes: int = 64_000
    # Size of the tmpfs work dir (bwrap/unshare): all the run's processes together write at most this much.
    work_mb: int = 64


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
    """What this machine lets the sandbox enforce (probed once per process and isolation)."""

    # "bwrap" or "unshare": own mount, PID, network (and with bwrap IPC/UTS) namespaces, a view of only the
    # interpreter (read-only), a tmpfs work dir and a fresh /proc; "none": none of these.
    isolation: str
    landlock: int  # Landlock ABI in force (0: none): writes outside the work dir refused; >= 4: no TCP either
    nproc: bool  # RLIMIT_NPROC binds (the code runs as a non-root user)
    # The code runs as a fresh uid per run (RUN_UID_BASE + random) when the parent is root; else as the parent's user.
    own_uid: bool
    # A cgroup v2 per run (memory.max = memory_mb, pids.max = nproc for all its processes together): the parent
    # group it is made in, or "" (then memory is bounded per process only: nproc × memory_mb in all).
    cgroup: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def namespaces(self) -> bool:
        return self.isolation != "none"

    @property
    def network_blocked(self) -> bool:
        return self.namespaces or self.landlock >= 4


def _ro_paths(python: str) -> list[str]:
    """What the view binds read-only: the system's libraries and the interpreter's prefixes (a venv and its base)."""
    paths = [p for p in SYSTEM_RO if os.path.lexists(p)]
    for exe in (python, os.path.realpath(python)):
        prefix = str(Path(exe).parent.parent)
        if prefix != "/" and not any(prefix == p or prefix.startswith(p + "/") for p in paths):
            paths.append(prefix)
    bad = [p for p in paths if p == WORK or p.startswith(WORK + "/")]
    if bad:
        raise RuntimeError(f"the interpreter lives under {WORK}, the sandbox's work dir: {bad[0]}")
    return paths


def _prefix(isolation: str, root: bool) -> list[str] | None:
    """The command that enters the namespaces (before the per-run arguments), or None where unavailable."""
    if isolation == "none":
        return []
    if isolation == "bwrap":
        exe = shutil.which("bwrap")
        if exe is None:
            return None
        # --as-pid-1: the launcher is the namespace's PID 1 and stays in our process group (no --new-session; the
        # run has no terminal), so the wall-clock killpg kills it and the kernel then kills every process inside.
        caps = ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN"] if root else []
        return [exe, "--die-with-parent", "--as-pid-1", "--unshare-ipc", "--unshare-pid", "--unshare-net",
                "--unshare-uts", "--unshare-cgroup-try", *([] if root else ["--unshare-user"]), *caps]  # fmt: skip
    exe = shutil.which("unshare")
    if exe is None:
        return None
    return [exe, "--mount", "--net", "--pid", "--fork", "--kill-child", *([] if root else ["--map-root-user"])]


@dataclass(frozen=True)
class _Setup:
    isolation: str
    prefix: tuple[str, ...]
    python: str
    ro: tuple[str, ...]
    containment: Containment


@cache
def _setup(python: str, want: str | None = None) -> _Setup:
    """The first isolation (or `want`) that runs a program here through the whole chain, with the interpreter and
    uid that work, and what they contain."""
    root = os.geteuid() == 0
    ro = tuple(_ro_paths(python))
    failures = []
    for isolation in [want] if want else ISOLATIONS:
        if isolation not in ISOLATIONS:
            raise ValueError(f"sandbox isolation must be one of {ISOLATIONS}, not {isolation!r}")
        prefix = _prefix(isolation, root)
        if prefix is None:
            failures.append(f"{isolation}: not installed")
            continue
        # A root parent runs the code as a fresh unprivileged uid (so RLIMIT_NPROC binds and file permissions
        # apply), with this interpreter if that uid may run it, else the system's python3; as itself if neither.
        tries = [(python, True), ("/usr/bin/python3", True), (python, False)] if root else [(python, False)]
        for interpreter, own_uid in tries:
            run_as = fresh_uid() if own_uid else None
            try:
                proc = _probe(isolation, prefix, python, interpreter, ro, run_as)
            except (OSError, subprocess.SubprocessError) as e:
                failures.append(f"{isolation}: {e}")
                continue
            lines = proc.stdout.splitlines()
            if proc.returncode == 0 and lines[-1:] == ["ran"]:
                done = json.loads(lines[0])
                return _Setup(isolation, tuple(prefix), interpreter, ro,
                              _containment(isolation, done, own_uid, root))  # fmt: skip
            failures.append(f"{isolation}: {proc.stderr.strip()[-300:] or f'exit {proc.returncode}'}")
    raise RuntimeError(f"the sandbox cannot run {python} here: " + "; ".join(failures))


def _probe(
    isolation: str, prefix: list[str], launch: str, interpreter: str, ro: tuple[str, ...], uid: int | None
) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory(prefix="sandbox-probe-") as d:
        work = Path(d, "work")
        work.mkdir()
        if uid is not None:
            os.chown(work, uid, uid)
        argv = [interpreter, "-I", "-S", "-c", "print('ran')"]
        cmd, fds = _command(isolation, prefix, launch, ro, Limits(), argv, d, {}, uid, -1, probe=True)
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30, pass_fds=fds, cwd=work)
        finally:
            for fd in fds:
                os.close(fd)


def _containment(isolation: str, done: Json, own_uid: bool, root: bool) -> Containment:
    notes = []
    if isolation == "none":
        notes.append("no namespaces (neither bwrap nor unshare(1) works here): the code sees the whole file system "
                     "(reads: any file its uid may read, the dataset included), other processes, the network (unless "
                     "Landlock ABI >= 4) and path-named Unix sockets; its work dir is on the disk (no size cap)")  # fmt: skip
    if not done["landlock"]:
        notes.append("no Landlock: writes outside the work dir are limited only by file permissions"
                     + (" (the view is read-only besides it)" if isolation != "none" else ""))  # fmt: skip
    # RLIMIT_NPROC does not bind root; a non-root user is bound (per run inside a user namespace, else counting all
    # of the user's processes).
    nproc = bool(done["nproc"]) and (own_uid or not root)
    if not nproc:
        notes.append("RLIMIT_NPROC does not bind (root): process count bounded only by the wall timeout")
    elif not own_uid and isolation == "none":
        notes.append("RLIMIT_NPROC counts all of this user's processes (no user namespace)")
    cgroup = _cgroup_parent()
    if isinstance(cgroup, str):
        notes.append(f"no cgroup ({cgroup}): memory is bounded per process only (nproc × memory_mb in all)")
        cgroup = None
    return Containment(isolation, int(done["landlock"]), nproc, own_uid, str(cgroup or ""), notes)


@cache
def _cgroup_parent() -> Path | str:
    """A cgroup v2 group of ours with the memory and pids controllers for its children, or why there is none. Made
    once per process in RUNNER_SANDBOX_CGROUP (a delegated group) or else the cgroup2 root (root only), removed at
    exit; our own group cannot host children with controllers while it holds processes (cgroup v2's rule)."""
    mnt = next((line.split()[4] for line in _lines("/proc/self/mountinfo")
                if " - cgroup2 " in line), None)  # fmt: skip
    if mnt is None:
        return "no cgroup v2 mounted"
    bases = [os.environ["RUNNER_SANDBOX_CGROUP"]] if os.environ.get("RUNNER_SANDBOX_CGROUP") else [mnt]
    why = "no writable cgroup v2 group with the memory and pids controllers"
    for base in map(Path, bases):
        try:
            if not {"memory", "pids"} <= set(Path(base, "cgroup.controllers").read_text().split()):
                why = f"{base} lacks the memory/pids controllers"
                continue
            Path(base, "cgroup.subtree_control").write_text("+memory +pids")
            ours = base / f"runner-sandbox-{os.getpid()}-{secrets.token_hex(3)}"
            ours.mkdir()
            atexit.register(_remove_cgroup, ours)
            Path(ours, "cgroup.subtree_control").write_text("+memory +pids")
            trial = ours / "trial"  # what each run does: a child group with both limits
            trial.mkdir()
            Path(trial, "memory.max").write_text(str(64 << 20))
            Path(trial, "pids.max").write_text("8")
            trial.rmdir()
            return ours
        except OSError as e:
            why = f"{base}: {e.strerror or e}"
    return why


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _remove_cgroup(path: Path) -> None:
    """Kill what is left in a run's group (and its children) and remove it; best effort."""
    for child in sorted(path.glob("*/"), reverse=True):
        if child.is_dir():
            _remove_cgroup(child)
    for _ in range(50):
        try:
            if Path(path, "cgroup.kill").exists():
                Path(path, "cgroup.kill").write_text("1")
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def _env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"}  # fmt: skip


def _command(
    isolation: str,
    prefix: list[str] | tuple[str, ...],
    launch: str,
    ro: tuple[str, ...],
    limits: Limits,
    argv: list[str],
    top: str,
    files: dict[str, str],
    uid: int | None,
    status_fd: int,
    probe: bool = False,
    harness: bool = False,
    cgroup: str = "",
) -> tuple[list[str], list[int]]:
    """The full command for one run in `top` (its work/ holds the files) and the fds it must inherit."""
    mb = 1 << 20
    host_work = str(Path(top, "work"))
    inside = isolation != "none"
    work = WORK if inside else host_work
    rlimits = {
        # SIGXCPU at the soft limit (its default action kills), SIGKILL a second later if it is caught.
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
        "RLIMIT_AS": (limits.memory_mb * mb,) * 2,
        "RLIMIT_FSIZE": (limits.file_mb * mb,) * 2,
        "RLIMIT_NPROC": (limits.nproc,) * 2,
        "RLIMIT_NOFILE": (limits.open_files,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    env = _env(work)
    if harness:
        env["SANDBOX_UID"] = "" if uid is None else str(uid)
    fs: Json = {"mode": isolation}
    if isolation == "unshare":
        Path(top, "root").mkdir()
        fs.update(root=str(Path(top, "root")), ro=list(ro), src=host_work, work_mb=limits.work_mb)
    # Landlock is a Linux syscall (the same number on every architecture); elsewhere 444 means something else.
    cfg = {"rlimits": rlimits, "landlock": sys.platform.startswith("linux"), "writable": [work], "uid": uid,
           "probe": probe, "argv": argv, "env": env, "status_fd": status_fd, "fs": fs, "harness": harness}  # fmt: skip
    fds = [] if status_fd < 0 else [status_fd]
    view: list[str] = []
    if isolation == "bwrap":
        made: set[str] = set()
        for p in ro:
            # Parents made explicitly (mode 0755): ones bwrap makes itself copy the source's mode (/root: 0700).
            for parent in reversed(Path(p).parents[:-1]):
                if str(parent) not in made and not any(str(parent).startswith(q + "/") for q in ro):
                    view += ["--perms", "0755", "--dir", str(parent)]
                    made.add(str(parent))
            view += ["--symlink", os.readlink(p), p] if os.path.islink(p) else ["--ro-bind", p, p]
        view += ["--dev", "/dev", "--proc", "/proc", "--size", str(limits.work_mb * mb), "--tmpfs", WORK]
        for name in sorted(files):
            for parent in reversed(Path(name).parents[:-1]):
                view += ["--dir", f"{WORK}/{parent}"]
            fd = os.open(Path(host_work, name), os.O_RDONLY)
            fds.append(fd)
            view += ["--file", str(fd), f"{WORK}/{name}"]
        view += ["--chdir", WORK, "--"]
    join = ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', f"{cgroup}/cgroup.procs"] if cgroup else []
    return [*join, *prefix, *view, launch, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)], fds


class Sandbox:
    def __init__(
        self,
        limits: Limits | None = None,
        max_parallel: int | None = None,
        python: str | None = None,
        isolation: str | None = None,
    ):
        """`isolation` picks one of ISOLATIONS (RuntimeError where it does not work here); None: the first that
        works. `containment` says which ran and what it holds."""
        self.limits = limits or Limits()
        self._launch_with = python or sys.executable
        self.max_parallel = max_parallel or max(1, os.cpu_count() or 1)
        # One semaphore per event loop (a semaphore binds to the loop it first waits in).
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._setup = _setup(self._launch_with, isolation)
        self.python, self.containment = self._setup.python, self._setup.containment

    def __getstate__(self) -> dict[str, object]:  # picklable (group builders hold it): the semaphores stay behind
        return {**self.__dict__, "_slots": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state, _slots=weakref.WeakKeyDictionary())

    async def run_python(self, code: str, stdin: str = "", files: dict[str, str] | None = None) -> RunResult:
        """Run `code` as main.py with `files` beside it and `stdin` on standard input."""
        return await self.run({**(files or {}), "main.py": code}, ["main.py"], stdin, python=True)

    async def run(
        self, files: dict[str, str], argv: list[str], stdin: str = "", python: bool = False, harness: bool = False
    ) -> RunResult:
        """Write `files` into a fresh dir and run argv there (argv[0] relative to it, or an absolute program;
        python=True runs argv with this interpreter in isolated mode). harness=True: argv keeps the launcher's uid
        and gets the run's uid in $SANDBOX_UID, to run the untrusted part as that uid itself
        (runner/rewards/harness.py)."""
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.max_parallel))
        async with slots:
            return await self._run(files, argv, stdin, python, harness)

    async def _run(self, files: dict[str, str], argv: list[str], stdin: str, python: bool, harness: bool) -> RunResult:
        st = self._setup
        with tempfile.TemporaryDirectory(prefix="sandbox-") as top:
            work, out = Path(top, "work"), Path(top, "out")
            work.mkdir(mode=0o700)
            out.mkdir(mode=0o700)
            os.chmod(top, 0o711)  # without namespaces the run's uid passes through to work/, reads nothing else
            for name, text in files.items():
                path = (work / name).resolve()
                if not path.is_relative_to(work.resolve()):
                    raise ValueError(f"sandbox file {name!r} is outside the work dir")
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            uid = fresh_uid() if self.containment.own_uid else None
            if uid is not None and st.isolation == "none":
                for p in (work, *work.rglob("*")):
                    os.chown(p, uid, uid)
            stdin_path = out / "stdin"
            stdin_path.write_text(stdin)
            # -E -s: no PYTHON* variables, no user site (-I would also drop the script's dir from sys.path).
            full = [self.python, "-E", "-s", *argv] if python else list(argv)
            cgroup = self._cgroup(uid)
            status_fd = os.open(out / "status", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                cmd, fds = _command(st.isolation, st.prefix, self._launch_with, st.ro, self.limits, full, top, files,
                                    uid, status_fd, harness=harness, cgroup=str(cgroup or ""))  # fmt: skip
                start = time.monotonic()
                try:
                    with open(stdin_path, "rb") as fin, open(out / "o", "wb") as fo, open(out / "e", "wb") as fe:
                        proc = await asyncio.create_subprocess_exec(
                            *cmd, stdin=fin, stdout=fo, stderr=fe, cwd=work, env=_env(str(work)),
                            start_new_session=True, pass_fds=fds,
                        )  # fmt: skip
                finally:
                    for fd in fds:
                        os.close(fd)
                timed_out = False
                try:
                    await asyncio.wait_for(proc.wait(), self.limits.wall_s)
                except TimeoutError:
                    timed_out = True
                finally:
                    _kill_group(proc.pid)
                    await proc.wait()
            finally:
                if cgroup is not None:
                    _remove_cgroup(cgroup)
            seconds = time.monotonic() - start
            stdout, t1 = _read(out / "o", self.limits.output_bytes)
            stderr, t2 = _read(out / "e", self.limits.output_bytes)
            status = (out / "status").read_text()
            code: int | None = json.loads(status)["code"] if status else None
        sig = None
        if code is None:  # the launcher itself was killed: the wall timeout (or something outside)
            sig = "SIGKILL"
        elif code < 0:
            sig, code = signal.Signals(-code).name, None
        return RunResult(stdout, stderr, code, sig, timed_out, seconds, t1 or t2)

    def _cgroup(self, uid: int | None) -> Path | None:
        """A fresh group for one run: memory.max = memory_mb and pids.max = nproc over all its processes."""
        if not self.containment.cgroup:
            return None
        path = Path(self.containment.cgroup, f"run-{secrets.token_hex(6)}")
        path.mkdir()
        Path(path, "memory.max").write_text(str(self.limits.memory_mb << 20))
        if Path(path, "memory.swap.max").exists():
            Path(path, "memory.swap.max").write_text("0")
        Path(path, "pids.max").write_text(str(self.limits.nproc))
        return path


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit
