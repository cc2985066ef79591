"""Fused float32 CPU kernels for the packed trainer (the C source is kernels.c next to this file).

`load(device, dtype)` returns the kernels only where they run: float32 on the CPU (anything else gets None
without building: a CUDA run never compiles them). The first call compiles kernels.c with the system C compiler
(about a second) and caches the shared library under ~/.cache/runner/kernels (or $XDG_CACHE_HOME/runner/kernels;
a temporary directory when that one is not writable) by a hash of the source, the flags, the CPU model and
features, and the compiler's version. When there is no compiler, or the build or the load fails, it prints one
line on stderr (once per process) with the reason and the fix, and the trainer uses torch's eager ops (the same
results to float rounding, slower). RUNNER_KERNELS=0 in the environment turns the kernels off without a word.
docs/kernels.md has the details.

Why hand-written C and not torch.compile, the maintained way to fuse elementwise work: measured on the 25M
model of bench/bench_train.py (1 thread), torch.compile of the same norm/rotary/SwiGLU functions took 20 s of
compile per process (a cold start on every `runner run`) and saved about 8% of a step; these kernels build in
about a second once per machine and save more (bench/README.md). Both need a C compiler at run time; without
one nothing changes.

OpenMP: the library is linked against libgomp.so.1, which torch's wheel has already loaded by that name, so
it shares torch's OpenMP runtime and thread count (passed per call) instead of starting a second pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=fast: fused multiply-adds (ISO C mode, -std=c99, turns contraction off; the attention kernel is
# FMA-bound and 1.4x faster with it). Rounding differs from separate ops but is the same every call.
# The target is a fixed ISA level, not the build machine's: on x86-64, x86-64-v3 (AVX2 + FMA, every x86 server CPU
# since 2013-2015) where the CPU has it, so one compiler makes the same instructions, hence the same bits, on any
# such CPU (an AVX-512 machine too); -march=native would pick 512-bit vectors and other reductions there. On an
# AVX2 CPU the two choose the same vectors; docs/kernels.md has what was measured.
# RUNNER_KERNELS_NATIVE=1 builds for the machine itself (-march=native), for speed over reproducibility elsewhere.
# x86-64-v3 as /proc/cpuinfo names its features (abm: LZCNT).
_X86_V3 = ("avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm", "xsave")


def _target() -> list[str]:
    """The -march flags of this build: native when RUNNER_KERNELS_NATIVE=1, else a fixed ISA level (x86-64-v3 where
    the CPU has it, the compiler's default target otherwise: x86-64's baseline, or the platform's on ARM)."""
    if os.environ.get("RUNNER_KERNELS_NATIVE", "0") not in ("", "0"):
        return ["-march=native"]
    if platform.machine().lower() in ("x86_64", "amd64") and _has_x86_v3():
        return ["-march=x86-64-v3"]
    return []


def _has_x86_v3() -> bool:
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        return False
    return all(f in flags for f in _X86_V3)


def _flag_sets() -> tuple[list[str], ...]:
    march = _target()
    return (["-O3", *march, "-ffp-contract=fast", "-fopenmp"], ["-O3", *march, "-ffp-contract=fast"], ["-O3"])
_state: list[Kernels | None] = []  # once tried

_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_fwd": [_P, _P, _P, _P, _P, _P, _L, _L, _F, _I],
    "rms_bwd": [_P, _P, _P, _P, _P, _P, _L, _L, _I],
    "norm_rope_fwd": [_P, _P, _P, _P, _P, _P, _L, _L, _L, _F, _I],
    "norm_rope_bwd": [_P, _P, _P, _P, _P, _P, _P, _L, _L, _L, _I],
    "swiglu_fwd": [_P, _P, _P, _L, _I],
    "swiglu_bwd": [_P, _P, _P, _P, _P, _L, _I],
    **{f"tree_attn_fwd_{d}": [_P] * 5 + [_P, _L, _P, _L, _L, _F, _P, _L, _I] for d in (16, 32, 64, 128)},
    **{f"tree_attn_bwd_{d}": [_P] * 9 + [_P, _L, _P, _P, _P, _L, _L, _F, _P, _L, _I] for d in (16, 32, 64, 128)},
    "tree_attn_work": [_L, _L, _L],
}
# Head sizes the tree attention kernels are built for (packed.py uses torch's SDPA for others).
ATTN_HEAD_DIMS = (16, 32, 64, 128)
PART_LIMIT = 8  # tree_attn_bwd keeps the segments' dk, dv shares apart up to this many times dk's size
WORK_LIMIT = 256 << 20  # bytes of per-thread tree attention scratch, all threads together (one thread may pass it)
MAX_HEAD_DIM = 512  # norm_rope keeps one head's row on the stack


class KernelsUnavailable(Exception):
    """Why the kernels cannot be had here (`reason`) and what to do about it (`fix`)."""

    def __init__(self, reason: str, fix: str):
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def _cache_dirs() -> list[Path]:
    """Where a built library may live: the user's cache, then a private temporary directory (a read-only or
    unwritable home)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return [Path(base) / "runner" / "kernels", Path(tempfile.gettempdir()) / f"runner-kernels-{uid}"]


def _private_dir(path: Path) -> bool:
    """Whether `path` is (made) a directory this user owns that no one else may write: a library loaded from a
    shared temporary directory must not be one another user could have planted."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _cpu_id() -> str:
    """The CPU the library is built on: its model and its feature flags, so a shared home on another CPU (or
    another Apple chip, where platform.processor() only says "arm") builds its own (a native build is for that CPU
    alone; a portable one would do, but a build per CPU is a second of compile)."""
    parts: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "CPU implementer", "CPU part", "flags", "Features")) and line not in parts:
                parts.append(" ".join(line.split()))
    except OSError:
        pass
    if not parts and sys.platform == "darwin":
        for key in ("machdep.cpu.brand_string", "machdep.cpu.features", "hw.optional.arm64"):
            try:
                out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=10, check=False)
            except (OSError, subprocess.SubprocessError):
                continue
            if out.returncode == 0 and out.stdout.strip():
                parts.append(f"{key}: {out.stdout.strip()}")
    return "; ".join(parts) or f"{platform.machine()} {platform.processor()}"


def find_compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compiler_version(cc: str) -> str:
    try:
        proc = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelsUnavailable(f"C compiler {cc!r} does not run ({exc})", _fix_cc(cc)) from None
    first = (proc.stdout or proc.stderr).strip().splitlines()[:1]
    if proc.returncode != 0 or not first:
        raise KernelsUnavailable(f"C compiler {cc!r} does not run (`{cc} --version` exited {proc.returncode})",
                                 _fix_cc(cc))
    return first[0]


def _fix_cc(cc: str) -> str:
    if os.environ.get("CC"):
        return f"point CC at a working C compiler (now {cc!r}) or unset it"
    return f"repair or reinstall the C compiler {cc!r}, or set CC to another one"


def _build(cc: str) -> Path:
    """The cached library for this source, CPU and compiler, compiled if missing; KernelsUnavailable if it
    cannot be."""
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:  # an install without the C source
        raise KernelsUnavailable(f"{SOURCE.name} is missing from the install ({exc})", "reinstall runner") from None
    machine = [cc.encode(), _compiler_version(cc).encode(), _cpu_id().encode(), sys.platform.encode()]
    dirs = [d for d in _cache_dirs() if _private_dir(d)]
    if not dirs:  # neither the cache nor the usual temporary directory: a fresh private one for this process
        dirs = [Path(tempfile.mkdtemp(prefix="runner-kernels-"))]
    if dirs[0] != _cache_dirs()[0]:
        log.info("kernel cache %s is not writable; building under %s", _cache_dirs()[0], dirs[0])
    errors = []
    for flags in _flag_sets():
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), *machine])).hexdigest()[:16]
        name = f"kernels-{key}.so"
        for d in _cache_dirs():
            if (d / name).exists() and (d in dirs or _private_dir(d)):
                return d / name
        target = dirs[0] / name
        try:
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                proc = subprocess.run([cc, *flags, "-shared", "-fPIC", "-std=c99", "-o", str(out), str(SOURCE)],
                                      check=False, capture_output=True, text=True, timeout=120)
                if proc.returncode != 0:
                    why = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
                    errors.append(f"{' '.join(flags)}: {why[0]}")
                    continue
                os.replace(out, target)  # atomic: a concurrent build of the same key writes the same bytes
                return target
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{' '.join(flags)}: {exc}")
    raise KernelsUnavailable(f"{cc} failed to compile {SOURCE.name} ({'; '.join(errors)})", _fix_cc(cc))


class Kernels:
    """The library's functions, taking tensors (contiguous float32 on the CPU: callers check `usable`)."""

    def __init__(self, lib: ctypes.CDLL):
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, None
        lib.tree_attn_work.restype = _L
        self.lib = lib

    @staticmethod
    def usable(*ts: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in ts)

    def rms_fwd(self, x: torch.Tensor, w: torch.Tensor | None, eps: float, r: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x + r or x, norm(x + r) * w, rstd) over the last dim."""
        n = x.shape[-1]
        rows = x.numel() // n
        xo = torch.empty_like(x) if r is not None else x
        y = torch.empty_like(x)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32)
        self.lib.rms_fwd(x.data_ptr(), _ptr(r), _ptr(w), xo.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, n,
                         eps, torch.get_num_threads())
        return xo, y, rstd

    def rms_bwd(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None, rstd: torch.Tensor,
                dres: torch.Tensor | None = None) -> torch.Tensor:
        n = x.shape[-1]
        dx = torch.empty_like(x)
        self.lib.rms_bwd(dy.data_ptr(), x.data_ptr(), _ptr(w), rstd.data_ptr(), _ptr(dres), dx.data_ptr(),
                         x.numel() // n, n, torch.get_num_threads())
        return dx

    def norm_rope_fwd(self, x: torch.Tensor, w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (T, H, D), cos/sin (T, D): (rope(norm(x) * w), rstd) (no norm, rstd None, when w is None)."""
        t, h, d = x.shape
        out = torch.empty_like(x)
        rstd = torch.empty(t, h, dtype=torch.float32) if w is not None else None
        self.lib.norm_rope_fwd(x.data_ptr(), _ptr(w), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), _ptr(rstd),
                               t, h, d, eps, torch.get_num_threads())
        return out, rstd

    def norm_rope_bwd(self, dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, rstd: torch.Tensor | None) -> torch.Tensor:
        t, h, d = x.shape
        dx = torch.empty_like(x)
        self.lib.norm_rope_bwd(dy.data_ptr(), x.data_ptr(), _ptr(w), cos.data_ptr(), sin.data_ptr(), _ptr(rstd),
                               dx.data_ptr(), t, h, d, torch.get_num_threads())
        return dx

    def swiglu_fwd(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        p = torch.empty_like(g)
        self.lib.swiglu_fwd(g.data_ptr(), u.data_ptr(), p.data_ptr(), g.numel(), torch.get_num_threads())
        return p

    def swiglu_bwd(self, dp: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dg, du = torch.empty_like(g), torch.empty_like(u)
        self.lib.swiglu_bwd(dp.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(), du.data_ptr(), g.numel(),
                            torch.get_num_threads())
        return dg, du


    def tree_attn_fwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor, anc: torch.Tensor,
                      koff: torch.Tensor, nmax: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over a packed chunk of segments (kernels.c, tree attention): q (T, H, D), k/v (T, KV, D); seg
        (nseg, 4) and anc (x, 2) int64; koff (nseg + 1) int64, the running count of the segments' keys (their
        ancestors' rows and their own); nmax, the most rows of a segment -> (o (T, H, D), lse (T, H)). Every
        row must belong to a segment."""
        t, h, d = q.shape
        o, lse = torch.empty_like(q), torch.empty(t, h, dtype=torch.float32)
        work, per, nt = self._work(koff, nmax, d)
        getattr(self.lib, f"tree_attn_fwd_{d}")(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(),
                                                seg.data_ptr(), seg.shape[0], anc.data_ptr(), h, k.shape[1], scale,
                                                work.data_ptr(), per, nt)
        return o, lse

    def tree_attn_bwd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
                      lse: torch.Tensor, seg: torch.Tensor, anc: torch.Tensor, koff: torch.Tensor, nmax: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) of tree_attn_fwd, given its o and lse and the output's gradient do (T, H, D)."""
        d, kv = q.shape[-1], k.shape[1]
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        work, per, nt = self._work(koff, nmax, d)
        # Each segment's share of dk, dv, kept apart so that all (segment, KV head) tasks run in parallel: only with
        # threads to use, and not when it would outgrow dk and dv 4x over (long shared prompts, many samples), where
        # threads split the KV heads instead. The bits are the same either way.
        size = 2 * int(koff[-1]) * kv * d
        part = torch.empty(size, dtype=torch.float32) if nt > 1 and size <= PART_LIMIT * dk.numel() else None
        getattr(self.lib, f"tree_attn_bwd_{d}")(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), do.data_ptr(),
                                                lse.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                                seg.data_ptr(), seg.shape[0], anc.data_ptr(), koff.data_ptr(),
                                                _ptr(part), q.shape[1], kv, scale, work.data_ptr(), per, nt)
        return dq, dk, dv

    def _work(self, koff: torch.Tensor, nmax: int, d: int) -> tuple[torch.Tensor, int, int]:
        """Per-thread scratch from torch's allocator, which reuses it call to call (the C side allocates nothing),
        and the thread count: fewer threads than torch's where their scratch would pass WORK_LIMIT bytes (a very
        long sequence on many cores; the bits do not depend on the count)."""
        per = int(self.lib.tree_attn_work(int((koff[1:] - koff[:-1]).max()), nmax, d))
        nt = max(1, min(torch.get_num_threads(), WORK_LIMIT // (4 * per)))
        return torch.empty(nt * per, dtype=torch.float32), per, nt


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def build() -> Kernels:
    """Build (or find in the cache) and load the library, whatever RUNNER_KERNELS says; KernelsUnavailable with
    the reason and the fix when that cannot be done. The tests call this to fail, not skip, when a compiler
    exists but the build breaks."""
    cc = find_compiler()
    if cc is None:
        raise KernelsUnavailable("no C compiler found (cc, gcc, clang; $CC unset)", "install a C compiler or set CC")
    path = _build(cc)
    try:
        return Kernels(ctypes.CDLL(str(path)))
    except (OSError, AttributeError) as exc:
        raise KernelsUnavailable(f"cannot load {path} ({exc})", f"delete {path} to rebuild it") from None


def load(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Kernels | None:
    """The kernels for tensors on `device` in `dtype`, built and loaded once per process. None where they do not
    run (not float32 on the CPU: nothing is built), when RUNNER_KERNELS=0, or when they cannot be had: then one
    line on stderr, once per process, says why and how to fix it."""
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return None
    if _state:
        return _state[0]
    kernels = None
    if os.environ.get("RUNNER_KERNELS", "1") != "0":
        try:
            kernels = build()
        except KernelsUnavailable as exc:
            print(f"runner: fused CPU kernels off: {exc.reason}. Training uses torch's ops instead (same results, "
                  f"slower). To fix: {exc.fix}; or set RUNNER_KERNELS=0 to hide this line.", file=sys.stderr)
    _state.append(kernels)
    return kernels
