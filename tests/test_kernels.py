"""The fused CPU kernels (backends/local/kernels.c) against torch's eager ops, forward and backward, on shapes
that exercise the vector tails; their build cache and their fallbacks."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from backends.local import kernels as kmod

# Where a C compiler exists the kernels must build: a broken build fails these tests (K is None, BUILD_ERROR says
# why) instead of skipping them. Only a machine without any compiler skips.
COMPILER = kmod.find_compiler()
K: kmod.Kernels | None = None
BUILD_ERROR = ""
if COMPILER is not None:
    try:
        K = kmod.build()
    except kmod.KernelsUnavailable as exc:
        BUILD_ERROR = f"{exc.reason} (fix: {exc.fix})"
needs_kernels = pytest.mark.skipif(COMPILER is None, reason="no C compiler: the fused kernels are not built")


def _norm(x: torch.Tensor, w: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else w * y


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., h:], x[..., :h]), -1) * sin[:, None]


def _tables(t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = (torch.arange(t) % 97).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos().contiguous(), emb.sin().contiguous()


@needs_kernels
@pytest.mark.parametrize("n", [64, 83])  # 83: not a multiple of the 16 lanes
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_forward_and_backward(n, residual):
    assert K is not None, BUILD_ERROR
    g = torch.Generator().manual_seed(n)
    x, r = torch.randn(37, n, generator=g) * 3, torch.randn(37, n, generator=g)
    w = torch.rand(n, generator=g) + 0.5
    dy, dres = torch.randn(37, n, generator=g), torch.randn(37, n, generator=g)
    xo, y, rstd = K.rms_fwd(x, w, 1e-6, r if residual else None)
    xr = (x + r if residual else x).requires_grad_()
    ref = _norm(xr, w)
    ref.backward(dy)
    torch.testing.assert_close(xo, xr.detach(), atol=0, rtol=0)
    torch.testing.assert_close(y, ref.detach(), atol=1e-5, rtol=1e-5)
    dx = K.rms_bwd(dy, xo, w, rstd, dres if residual else None)
    assert xr.grad is not None
    torch.testing.assert_close(dx, xr.grad + (dres if residual else 0), atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("d", [64, 10])
def test_norm_rope_forward_and_backward(with_norm, d):
    assert K is not None, BUILD_ERROR
    g = torch.Generator().manual_seed(d)
    x = torch.randn(29, 3, d, generator=g) * 2
    w = torch.rand(d, generator=g) + 0.5 if with_norm else None
    cos, sin = _tables(29, d)
    xr = x.clone().requires_grad_()
    ref = _rope(_norm(xr, w) if w is not None else xr, cos, sin)
    dy = torch.randn(ref.shape, generator=g)
    ref.backward(dy)
    out, rstd = K.norm_rope_fwd(x, w, cos, sin, 1e-6)
    assert (rstd is None) == (w is None)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    dx = K.norm_rope_bwd(dy, x, w, cos, sin, rstd)
    assert xr.grad is not None
    torch.testing.assert_close(dx, xr.grad, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_swiglu_forward_and_backward_including_extremes():
    assert K is not None, BUILD_ERROR
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(61, 77, generator=g) * 6
    gate[0, :8] = torch.tensor([-200.0, -100.0, -87.5, -80.0, 0.0, 80.0, 100.0, 200.0])
    up = torch.randn(61, 77, generator=g)
    dp = torch.randn(61, 77, generator=g)
    gr, ur = gate.clone().requires_grad_(), up.clone().requires_grad_()
    ref = F.silu(gr) * ur
    ref.backward(dp)
    p = K.swiglu_fwd(gate, up)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p, ref.detach(), atol=1e-5, rtol=1e-5)
    dg, du = K.swiglu_bwd(dp, gate, up)
    assert gr.grad is not None and ur.grad is not None
    torch.testing.assert_close(dg, gr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(du, ur.grad, atol=1e-5, rtol=1e-5)


@needs_kernels
def test_results_do_not_depend_on_the_thread_count():
    assert K is not None, BUILD_ERROR
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(300, 256, generator=g), torch.randn(300, 256, generator=g), torch.rand(256, generator=g)
    gate, up = torch.randn(300, 512, generator=g), torch.randn(300, 512, generator=g)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            xo, y, rstd = K.rms_fwd(x, w, 1e-6, r)
            outs.append([y, K.rms_bwd(x, xo, w, rstd, r), K.swiglu_fwd(gate, up), *K.swiglu_bwd(x.repeat(1, 2), gate, up)])
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def _tree_case(segments: list[tuple[int, list[int]]], h: int, kv: int, d: int, seed: int = 0):
    """A packed chunk of segments (rows, ancestor segment indices, root first), laid out in order: the inputs of
    the tree attention kernels and torch's math attention over the chunk with the equivalent T x T mask."""
    starts = [sum(n for n, _ in segments[:i]) for i in range(len(segments))]
    t = sum(n for n, _ in segments)
    allowed = torch.zeros(t, t, dtype=torch.bool)
    seg, anc = [], []
    for (n, ancestors), s0 in zip(segments, starts):
        a0 = len(anc)
        for a in ancestors:
            anc.append((starts[a], segments[a][0]))
            allowed[s0:s0 + n, starts[a]:starts[a] + segments[a][0]] = True
        allowed[s0:s0 + n, s0:s0 + n] = torch.ones(n, n, dtype=torch.bool).tril()
        seg.append((s0, n, a0, len(anc)))
    keys = [n + sum(segments[a][0] for a in ancestors) for n, ancestors in segments]
    plan = (torch.tensor(seg, dtype=torch.int64), torch.tensor(anc or [(0, 0)], dtype=torch.int64),
            torch.tensor([0, *itertools.accumulate(keys)], dtype=torch.int64), max(n for n, _ in segments))
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(t, h, d, generator=g), torch.randn(t, kv, d, generator=g), torch.randn(t, kv, d, generator=g)
    do = torch.randn(t, h, d, generator=g)
    scale = d ** -0.5
    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        o = F.scaled_dot_product_attention(qr.transpose(0, 1), kr.transpose(0, 1), vr.transpose(0, 1),
                                           attn_mask=allowed, scale=scale, enable_gqa=h != kv)
    o.backward(do.transpose(0, 1))
    sc = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(h // kv, 1)) * scale
    lse = sc.masked_fill(~allowed, float("-inf")).logsumexp(-1).t()
    assert qr.grad is not None and kr.grad is not None and vr.grad is not None
    return (q, k, v, do, plan, scale), (o.detach().transpose(0, 1), lse, qr.grad, kr.grad, vr.grad)


# (rows, ancestors) per segment
TREE = [(9, []), (37, [0]), (5, [0]), (20, [0, 2]), (1, [0, 2]), (3, [])]


@needs_kernels
@pytest.mark.parametrize(("segments", "h", "kv", "d"), [
    ([(1, [])], 2, 2, 32),  # one token
    ([(7, []), (7, []), (7, [])], 4, 2, 32),  # a run of sequences
    (TREE, 8, 4, 64),  # a nested tree: two levels of ancestors, keys past one tile, a one-row node
    ([(50, []), (70, [0])], 4, 1, 64),  # one KV head for four query heads
    ([(70, [])], 2, 2, 64),  # no grouping
    (TREE, 4, 2, 16),
    ([(30, []), (45, [0])], 4, 2, 128),
])
def test_tree_attention_matches_torch(segments, h, kv, d):
    assert K is not None and d in kmod.ATTN_HEAD_DIMS
    (q, k, v, do, plan, scale), (ro, rlse, rdq, rdk, rdv) = _tree_case(segments, h, kv, d)
    o, lse = K.tree_attn_fwd(q, k, v, *plan, scale)
    torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(lse, rlse, atol=1e-5, rtol=1e-5)
    got = K.tree_attn_bwd(q, k, v, o, do, lse, *plan, scale)
    for name, a, b in zip("qkv", got, (rdq, rdk, rdv)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda e, name=name: f"d{name}: {e}")


@needs_kernels
def test_tree_attention_does_not_depend_on_the_thread_count(monkeypatch):
    # 1 thread: the backward adds each segment's dk, dv share at once; 2 and 3: all tasks in parallel, shares
    # kept apart, then added; 3 with no room for the shares: threads split the KV heads; 3 with no room for more
    # than one thread's scratch: one thread. The same bits.
    assert K is not None, BUILD_ERROR
    (q, k, v, do, plan, scale), _ = _tree_case(TREE, 8, 4, 64, seed=3)
    before = torch.get_num_threads()
    outs = []
    try:
        for n, limit, work in ((1, 8, 1 << 30), (2, 8, 1 << 30), (3, 8, 1 << 30), (3, 0, 1 << 30), (3, 8, 1)):
            # work 1: no room for a second thread's scratch, so one thread runs it
            monkeypatch.setattr(kmod, "PART_LIMIT", limit)
            monkeypatch.setattr(kmod, "WORK_LIMIT", work)
            torch.set_num_threads(n)
            o, lse = K.tree_attn_fwd(q, k, v, *plan, scale)
            outs.append([o, lse, *K.tree_attn_bwd(q, k, v, o, do, lse, *plan, scale)])
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@needs_kernels
def test_a_present_compiler_builds_the_kernels():
    assert K is not None, BUILD_ERROR


@needs_kernels
def test_build_is_cached_and_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kmod, "_state", [])
    monkeypatch.setattr(kmod, "_flag_sets", lambda: (["-O0"],))  # a real build of the real source, 1.6 s, not -O3's 17
    first = kmod.load()
    assert first is not None, BUILD_ERROR
    built = list((tmp_path / "runner" / "kernels").glob("kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(kmod, "_state", [])
    assert kmod.load() is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded from the cache, not rebuilt
    monkeypatch.setattr(kmod, "_state", [])
    monkeypatch.setenv("RUNNER_KERNELS", "0")
    assert kmod.load() is None


def _no_build(monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("the kernels were built")

    monkeypatch.setattr(kmod, "_state", [])
    monkeypatch.setattr(kmod, "build", fail)


@pytest.mark.parametrize(("device", "dtype"), [("cuda", torch.float32), ("meta", torch.float32), ("cpu", torch.bfloat16)])
def test_nothing_is_built_where_the_kernels_do_not_run(monkeypatch, capsys, device, dtype):
    _no_build(monkeypatch)
    assert kmod.load(torch.device(device), dtype) is None
    assert kmod._state == [] and capsys.readouterr().err == ""


def test_runner_kernels_0_is_silent(monkeypatch, capsys):
    _no_build(monkeypatch)
    monkeypatch.setenv("RUNNER_KERNELS", "0")
    assert kmod.load() is None
    assert capsys.readouterr().err == ""


def _assert_one_warning(err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("runner: fused CPU kernels off:") and "RUNNER_KERNELS=0" in lines[0], lines[0]
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_a_broken_compiler_falls_back_with_one_line_on_stderr(tmp_path, monkeypatch, capsys):
    """CC=/bin/false: no kernels, torch's ops, and exactly one line (not per PackedLM, not per step) saying why
    and what to do."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("RUNNER_KERNELS", raising=False)
    monkeypatch.setattr(kmod, "_state", [])
    monkeypatch.setenv("CC", "/bin/false")
    assert kmod.load() is None
    assert kmod.load() is None  # decided once per process
    _assert_one_warning(capsys.readouterr().err, "/bin/false", "CC")


def test_a_failing_build_falls_back_with_its_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("RUNNER_KERNELS", raising=False)
    monkeypatch.setattr(kmod, "_state", [])
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'fakecc 1.0'; exit 0; }\n"
                    "echo 'cc: error: no such thing' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    assert kmod.load() is None
    _assert_one_warning(capsys.readouterr().err, "failed to compile", "no such thing")


def test_no_compiler_says_install_one(monkeypatch, capsys):
    monkeypatch.delenv("RUNNER_KERNELS", raising=False)
    monkeypatch.setattr(kmod, "_state", [])
    monkeypatch.setattr(kmod, "find_compiler", lambda: None)
    assert kmod.load() is None
    _assert_one_warning(capsys.readouterr().err, "no C compiler", "install a C compiler")


def test_a_missing_source_falls_back(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("RUNNER_KERNELS", raising=False)
    monkeypatch.setattr(kmod, "_state", [])
    monkeypatch.setattr(kmod, "find_compiler", lambda: "cc")
    monkeypatch.setattr(kmod, "SOURCE", tmp_path / "gone.c")
    assert kmod.load() is None
    _assert_one_warning(capsys.readouterr().err, "gone.c", "reinstall")


@needs_kernels
def test_a_read_only_cache_builds_in_a_temporary_directory(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o500)
    if os.access(cache, os.W_OK):  # root writes anywhere: a cache path under a regular file cannot be created
        cache = tmp_path / "a-file"
        cache.write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(kmod.tempfile, "gettempdir", lambda: str(tmp))
    monkeypatch.delenv("RUNNER_KERNELS", raising=False)
    monkeypatch.setattr(kmod, "_state", [])
    monkeypatch.setattr(kmod, "_flag_sets", lambda: (["-O0"],))  # where it builds is the point, not how fast it runs
    try:
        assert kmod.load() is not None, capsys.readouterr().err
        assert capsys.readouterr().err == ""  # kernels built: nothing to warn about
        assert len(list(tmp.glob("runner-kernels-*/kernels-*.so"))) == 1
        assert not cache.is_dir() or not list(cache.rglob("*.so"))
    finally:
        (tmp_path / "ro").chmod(0o700)


def test_cache_key_names_the_cpu_model_and_the_compiler_version(tmp_path, monkeypatch):
    """Two machines that differ only in CPU model (Apple M1 vs M2 both say "arm") or only in compiler version
    build two libraries, not one that -march=native made for the other."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kmod, "_flag_sets", lambda: (["-O0"],))
    versions = iter(["cc 1.0", "cc 1.0", "cc 2.0"])
    cpus = iter(["Apple M1", "Apple M2", "Apple M2"])
    monkeypatch.setattr(kmod, "_compiler_version", lambda cc: next(versions))
    monkeypatch.setattr(kmod, "_cpu_id", lambda: next(cpus))
    fake = tmp_path / "cc"  # writes its -o argument
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && { touch "$2"; exit 0; }; shift; done\nexit 1\n')
    fake.chmod(0o755)
    paths = {kmod._build(str(fake)) for _ in range(3)}
    assert len(paths) == 3


def test_the_build_targets_a_fixed_isa_unless_native_is_asked_for(monkeypatch):
    """Portable by default: one ISA level (x86-64-v3 where the CPU has it), so the same compiler makes the same
    instructions and the same bits on every CPU of that level; RUNNER_KERNELS_NATIVE=1 builds for this CPU only."""
    monkeypatch.delenv("RUNNER_KERNELS_NATIVE", raising=False)
    first = kmod._flag_sets()[0]
    assert "-march=native" not in first and "-ffp-contract=fast" in first
    monkeypatch.setattr(kmod.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(kmod, "_has_x86_v3", lambda: True)
    assert "-march=x86-64-v3" in kmod._flag_sets()[0]
    monkeypatch.setattr(kmod, "_has_x86_v3", lambda: False)
    assert not any(f.startswith("-march") for f in kmod._flag_sets()[0])
    monkeypatch.setenv("RUNNER_KERNELS_NATIVE", "1")
    assert "-march=native" in kmod._flag_sets()[0] and "-march=native" in kmod._flag_sets()[1]


def test_the_cpu_id_names_a_model_where_the_os_tells_it():
    cpu = kmod._cpu_id()
    assert cpu.strip()
    if Path("/proc/cpuinfo").exists() and "model name" in Path("/proc/cpuinfo").read_text():
        assert "model name" in cpu


def test_a_process_with_a_broken_compiler_prints_exactly_one_line(tmp_path):
    """What a user sees: CC=/bin/false and an empty cache, the kernels asked for three times (as by the
    trainer's models), and stderr holds one line."""
    code = "from backends.local import kernels as k\nassert [k.load(), k.load(), k.load()] == [None] * 3\n"
    env = {**os.environ, "CC": "/bin/false", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("RUNNER_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    _assert_one_warning(proc.stderr, "/bin/false")
