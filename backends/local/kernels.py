"""Fused float32 CPU kernels for the packed trainer (the C source is kernels.c next to this file).

`load()` compiles kernels.c with the system C compiler on first use (about a second), caches the shared
library under ~/.cache/runner/kernels (or $XDG_CACHE_HOME/runner/kernels) by a hash of the source, the flags
and the CPU, and returns the functions; it returns None, once logging why, when there is no compiler or the
build fails, and the trainer then uses torch's eager ops (the same results to float rounding). RUNNER_KERNELS=0
in the environment turns the kernels off.

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
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=fast: fused multiply-adds (ISO C mode, -std=c99, turns contraction off; the attention kernel is
# FMA-bound and 1.4x faster with it). Rounding differs from separate ops but is the same every call.
_FLAG_SETS = (["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"], ["-O3", "-march=native", "-ffp-contract=fast"],
              ["-O3"])
_state: list[Any] = []  # [Kernels | None] once tried

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


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "runner" / "kernels"


def _cpu_id() -> str:
    """The CPU the library is built for (-march=native): its flags, so a shared home on another CPU rebuilds."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(cc: str) -> Path | None:
    try:
        source = SOURCE.read_bytes()
    except OSError as exc:  # an install without the C source
        log.info("fused kernels not built (%s); using torch's ops", exc)
        return None
    errors = []
    machine = [cc.encode(), _cpu_id().encode(), sys.platform.encode()]
    for flags in _FLAG_SETS:
        key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), *machine])).hexdigest()[:16]
        target = _cache_dir() / f"kernels-{key}.so"
        if target.exists():
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                out = Path(tmp) / target.name
                proc = subprocess.run([cc, *flags, "-shared", "-fPIC", "-std=c99", "-o", str(out), str(SOURCE)],
                                      check=False, capture_output=True, text=True, timeout=120)
                if proc.returncode != 0:
                    errors.append(f"{cc} {' '.join(flags)}: {proc.stderr.strip().splitlines()[-1:]}")
                    continue
                os.replace(out, target)  # atomic: a concurrent build of the same key writes the same bytes
                return target
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{cc} {' '.join(flags)}: {exc}")
    log.info("fused kernels not built (%s); using torch's ops", "; ".join(errors))
    return None


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


def load() -> Kernels | None:
    """The kernels, built and loaded once per process; None when off, unbuildable or unloadable."""
    if _state:
        return _state[0]
    kernels = None
    if os.environ.get("RUNNER_KERNELS", "1") != "0":
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
        if cc is None:
            log.info("fused kernels off: no C compiler found (cc, gcc, clang); using torch's ops")
        else:
            path = _build(cc)
            if path is not None:
                try:
                    kernels = Kernels(ctypes.CDLL(str(path)))
                except (OSError, AttributeError) as exc:
                    log.info("fused kernels not loaded (%s); using torch's ops", exc)
    _state.append(kernels)
    return kernels
