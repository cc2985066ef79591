"""A judge for assert tests that the code under test cannot forge (docs/sandbox.md, "The code env's harness").

The old way appended the asserts to the program and counted exit 0 as a pass, so `os._exit(0)`, `sys.exit(0)`, an
`atexit` hook, or a patched `AssertionError` passed every test. Here two processes share the sandbox run:

- the **harness** (this file, run with `-I -S`, keeping the launcher's uid: root or the namespace's root) reads its
  job (the check code and a per-run nonce) from stdin, forks the **worker** and runs the check code itself, with
  its own builtins and modules, in a namespace where the program's other top-level names are proxies
  (check_namespace: a program's `set = ...`, `abs = ...`, fake or patched `math` never reach the check);
- the **worker** (the same source with `--worker`) drops to the run's fresh uid (or, without one, all capabilities),
  runs the program as `__main__` with stdin on /dev/null and stdout sent to stderr, and then answers the harness's
  calls over two pipes: call, attribute, iterate, length, item. Only exact builtin data (what `marshal` writes:
  None, bool, int, float, complex, str, bytes, tuple, list, set, frozenset, dict) comes back as a value; anything
  else (a function, an instance, a subclass of int with its own `__eq__`) stays in the worker as a handle, which
  compares equal to nothing but itself.

The harness writes `<nonce> passed` to its stdout (fd 1, which the worker does not hold) only after the whole check
ran without an exception. The worker cannot read the nonce (it is in the harness's memory; the harness is not
dumpable and runs as another uid) and cannot write to the harness's stdout, so its exit code, its output and
anything it patches in its own process count for nothing. A worker killed by a signal (SIGXCPU) is reported as the
harness's own death by that signal, so the env still sees the timeout.

Only the standard library: this runs inside the sandbox's view, which holds the interpreter and nothing of runner.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import importlib
import json
import marshal
import os
import signal
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any, Literal

REQ_FD, RESP_FD = 3, 4
MAX_MESSAGE = 16 << 20
# A value in a request to the worker: data as itself, or a handle to one of the worker's objects.
Tag = tuple[Literal["v"], object] | tuple[Literal["h"], int]


def _dumps(value: Any) -> bytes:
    """marshal's bytes for exact builtin data; ValueError for anything else (marshal takes any object and refuses
    what it cannot write, which is how the worker tells data from a handle)."""
    return marshal.dumps(value)


def _send(fd: int, msg: tuple[object, ...]) -> None:
    data = _dumps(msg)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data) :]


def _recv(fd: int) -> object:
    head = _read_exact(fd, 8)
    n = int.from_bytes(head, "little")
    if n > MAX_MESSAGE:
        raise RuntimeError(f"the program sent a {n}-byte message (at most {MAX_MESSAGE})")
    return marshal.loads(_read_exact(fd, n))


def _read_exact(fd: int, n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the program ended before it answered")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


# ---------------------------------------------------------------------------------------------------- the worker


def _worker() -> None:
    handles: dict[int, Any] = {}  # the program's objects, used as they are (what fails goes back as the error)

    def tag(value: object) -> tuple[object, ...]:
        try:
            _dumps(value)  # exact builtin data only: a subclass (with its own __eq__) is refused
            return ("v", value)
        except ValueError:
            handles[id(value)] = value
            return ("h", id(value), type(value).__name__)

    def untag(t: Tag) -> object:
        return handles[t[1]] if t[0] == "h" else t[1]

    def error(e: BaseException) -> tuple[str, str, str]:
        return ("err", type(e).__name__, str(e)[:2000])

    with open("main.py") as f:
        source = f.read()
    g: dict[str, object] = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
    try:
        exec(compile(source, "main.py", "exec"), g)
        # A module is only named (a claim: the harness binds its own import of that name, never this object).
        top = {k: ("m", str(getattr(v, "__name__", ""))) if isinstance(v, types.ModuleType) else tag(v)
               for k, v in g.items() if not (k.startswith("__") and k.endswith("__"))}  # fmt: skip
        reply: tuple[object, ...] = ("ok", top)
    except BaseException as e:  # SystemExit included: a program that exits while loading defines nothing
        reply = error(e)
    _send(RESP_FD, reply)
    if reply[0] != "ok":
        return
    while True:
        try:
            request = _recv(REQ_FD)
        except EOFError:
            return
        if not isinstance(request, tuple):  # the harness sends tuples only
            return
        op, h, *rest = request
        try:
            obj = handles[h]
            if op == "call":
                args, kwargs = rest
                value = obj(*map(untag, args), **{k: untag(v) for k, v in kwargs.items()})
            elif op == "getattr":
                value = getattr(obj, rest[0])
            elif op == "iter":  # item by item: a list holding one handle would otherwise be a handle itself
                _send(RESP_FD, ("items", [tag(x) for x in obj]))
                continue
            elif op == "len":
                value = len(obj)
            elif op == "getitem":
                value = obj[untag(rest[0])]
            else:
                raise ValueError(f"unknown request {op!r}")
            reply = ("ok", tag(value))
        except BaseException as e:
            reply = error(e)
        _send(RESP_FD, reply)


# --------------------------------------------------------------------------------------------------- the harness


class RemoteError(Exception):
    """An exception in the program that is not a builtin one (builtin ones are raised as themselves)."""


class Remote:
    """A value that stayed in the worker. Equal only to itself; calls, attributes, iteration, len and indexing go
    to the worker and come back as data or as another Remote."""

    _link: _Link
    _handle: int
    _kind: str

    def __init__(self, link: _Link, handle: int, kind: str):
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_kind", kind)

    def __call__(self, *args: object, **kwargs: object) -> object:
        return self._link.ask("call", self._handle, [self._link.tag(a) for a in args],
                              {k: self._link.tag(v) for k, v in kwargs.items()})  # fmt: skip

    def __getattr__(self, name: str) -> object:
        return self._link.ask("getattr", self._handle, name)

    def __iter__(self) -> Iterator[object]:
        items = self._link.ask("iter", self._handle)
        if not isinstance(items, list):
            raise RuntimeError("the program answered an iteration with something that is not its items")
        return iter(items)

    def __len__(self) -> int:
        n = self._link.ask("len", self._handle)
        if type(n) is not int:
            raise TypeError("len() of the program's object is not an int")
        return n

    def __getitem__(self, key: object) -> object:
        return self._link.ask("getitem", self._handle, self._link.tag(key))

    def __bool__(self) -> bool:  # `assert f(x)` must not pass on any object the program returns
        raise TypeError(f"the program returned {self!r}, not data: it has no truth value here")

    def __repr__(self) -> str:
        return f"<the program's {self._kind}>"


class _Link:
    def __init__(self, rd: int, wr: int):
        self.rd, self.wr = rd, wr

    def tag(self, value: object) -> tuple[object, ...]:
        if isinstance(value, Remote):
            return ("h", object.__getattribute__(value, "_handle"))
        return ("v", value)

    def untag(self, t: object) -> object:
        """("v", data) or ("h", handle, kind); anything else is refused (the worker's replies are untrusted)."""
        if type(t) is tuple and len(t) == 2 and t[0] == "v":
            return t[1]
        if type(t) is tuple and len(t) == 3 and t[0] == "h" and type(t[1]) is int and type(t[2]) is str:
            return Remote(self, t[1], t[2])
        raise RuntimeError("the program answered with something that is neither data nor a handle")

    def ask(self, *request: object) -> object:
        _send(self.wr, request)
        return self.answer(_recv(self.rd))

    def answer(self, reply: object) -> object:
        reply = _fields(reply)
        if reply[0] == "ok":
            return self.untag(reply[1])
        if reply[0] == "items":
            items = reply[1]
            if not isinstance(items, (tuple, list)):
                raise RuntimeError("the program answered an iteration with something that is not its items")
            return [self.untag(t) for t in items]
        _, name, message = reply
        kind = getattr(builtins, name, None) if isinstance(name, str) else None
        # Raised as itself (a check may expect a ValueError), but never a StopIteration: `all(map(f, xs))` would take
        # it for the end of the items and pass.
        if (isinstance(kind, type) and issubclass(kind, Exception) and kind.__module__ == "builtins"
                and not issubclass(kind, (StopIteration, StopAsyncIteration))):  # fmt: skip
            raise kind(message)
        raise RemoteError(f"{name}: {message}")


def _fields(message: object) -> Sequence[object]:
    """A reply's fields (a tuple or a list); anything else is refused (the worker's replies are untrusted)."""
    if not isinstance(message, (tuple, list)) or not message:
        raise RuntimeError("the program answered with something that is not a reply")
    return message


# Standard modules the harness never imports for a check (side effects on import: a browser, a window, text).
_NO_IMPORT = frozenset({"__main__", "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"})


def _real_module(name: str) -> types.ModuleType | None:
    """The harness's own import of a standard module (never the program's object of that name), or None."""
    if not isinstance(name, str) or not name or name.split(".")[0] not in sys.stdlib_module_names:
        return None
    if name.split(".")[0] in _NO_IMPORT:
        return None
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _module_names(check: str) -> set[str]:
    """Names the check uses only as `name.attr` that are standard modules (`math.isclose(...)` with math left to the
    program's import): these are the harness's own modules, whatever the program bound to that name."""
    uses: dict[str, bool] = {}
    bases = set()
    tree = ast.parse(check)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            bases.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            uses[node.id] = uses.get(node.id, True) and id(node) in bases
    return {n for n, only_attr in uses.items() if only_attr and n in sys.stdlib_module_names}


def check_namespace(link: _Link, names: object, check: str) -> dict[str, object]:
    """The namespace the check runs in. What the program bound at its top level resolves to the program (data, or a
    handle to its function or object) except what would change the check's own meaning:

    - builtin names (`set`, `abs`, `str`, `range`, `ValueError`, ...) are always the harness's builtins;
    - a module the program imported is the harness's own import of that standard module (a fake or patched `math`
      counts for nothing), and a non-standard one is not bound (the check imports what it needs itself);
    - a standard module's name the check uses only as `name.attr` is the harness's own module, whatever the program
      bound to it (`import cmath as math`, `class math: ...`);
    - dunder names are the harness's.

    The worker's reply is untrusted (the program can write anything to its pipe): everything here is checked again.
    """
    ns: dict[str, object] = {}
    if not isinstance(names, dict):
        raise RuntimeError("the program's names did not come back as a dict")
    for name, tagged in names.items():
        if not (isinstance(name, str) and name.isidentifier()) or name.startswith("__") or hasattr(builtins, name):
            continue
        if not (isinstance(tagged, tuple) and tagged and tagged[0] in ("v", "h", "m")):
            raise RuntimeError(f"the program's name {name!r} came back malformed")
        if tagged[0] == "m":
            module = _real_module(tagged[1] if len(tagged) > 1 else "")
            if module is not None:
                ns[name] = module
            continue
        ns[name] = link.untag(tagged)
    for name in _module_names(check):
        module = _real_module(name)
        if module is not None:
            ns[name] = module
    ns.update(__name__="__check__", __builtins__=builtins)
    return ns


def _no_dump() -> None:
    """Not dumpable: a process of the same uid can neither ptrace us nor open our /proc files (fds, memory)."""
    try:
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def _drop_privileges(uid: int | None) -> None:
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        return
    # No uid of its own (a non-root parent: we are the user namespace's root): drop every capability, so the
    # worker cannot ptrace the harness or read its memory.
    try:
        libc = ctypes.CDLL(None)
        for cap in range(64):
            if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                break
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        data = (ctypes.c_uint32 * 6)()
        libc.capset(ctypes.byref(Header(0x20080522, 0)), data)
    except (OSError, AttributeError):
        pass


def _harness() -> None:
    _no_dump()
    job = json.loads(sys.stdin.read())
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # the job (with the nonce) is read: nothing of it stays open
    os.close(null)
    uid_text = os.environ.get("SANDBOX_UID", "")
    uid = int(uid_text) if uid_text else None
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(2, 1)
            req, resp = os.dup(req_r), os.dup(resp_w)  # above 4, so neither dup2 below overwrites the other
            os.dup2(req, REQ_FD)
            os.dup2(resp, RESP_FD)
            os.closerange(RESP_FD + 1, 1 << 16)
            _drop_privileges(uid)
            src = job["source"]
            os.execv(sys.executable, [sys.executable, "-E", "-s", "-c", src, "--worker"])
        finally:
            os._exit(127)
    os.close(req_r)
    os.close(resp_w)
    link = _Link(resp_r, req_w)
    try:
        loaded = _fields(_recv(resp_r))
        if loaded[0] != "ok":
            link.answer(loaded)
        code = compile(job["check"], "<check>", "exec")
        ns = check_namespace(link, loaded[1], job["check"])
        sys.stdout = sys.stderr  # the check's own prints: not where the verdict goes
        exec(code, ns)
    except EOFError:
        _exit_like_worker(pid)
        raise
    os.write(1, f"{job['nonce']} passed\n".encode())
    os.kill(pid, signal.SIGKILL)


def _exit_like_worker(pid: int) -> None:
    """The worker died before answering: die by its signal (SIGXCPU: the env counts a timeout)."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        sys.stderr.write(f"the program was killed by {signal.Signals(sig).name}\n")
        sys.stderr.flush()
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        _worker()
    else:
        _harness()
