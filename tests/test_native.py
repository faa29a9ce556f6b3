"""The fused CPU kernel for causal norm_linear_attn against the quadratic reference."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import on_one_and_two_threads, rel_err
from transnormer.ops import _native, norm_linear_attn, norm_linear_attn_reference

needs_kernel = pytest.mark.skipif(_native.load() is None, reason="fused CPU kernel unavailable")


@pytest.fixture
def native():
    before = _native.backend()
    _native.set_backend("native")
    yield
    _native.set_backend(before)


def test_kernel_builds_when_a_compiler_exists():
    if not (shutil.which("c++") or shutil.which("g++") or os.environ.get("CXX")):
        pytest.skip("no C++ compiler on this machine")
    if os.environ.get("TRANSNORMER_NATIVE") == "0":
        pytest.skip("the kernels are switched off (TRANSNORMER_NATIVE=0)")
    assert _native.load() is not None, _native._error


# AVX2 + FMA (the GEMM's 256-bit micro-kernel), and neither (the plain loops)
_NO_AVX512 = ("-mno-avx512f",)
_NO_AVX2 = ("-mno-avx512f", "-mno-avx2", "-mno-fma")


def _variant(flags):
    """The library built with these extra flags; the test is skipped where the compiler refuses them,
    and the AVX2 variant on a CPU without AVX-512, whose default build it is (the rest of the suite
    tests that one; building it again cost ~22 s of the suite on 2 cores)."""
    if flags == _NO_AVX512 and "avx512f" not in _native.cpu_info().flags:
        pytest.skip("no AVX-512 on this CPU: the default library is already the build without it")
    try:
        return _native.load_variant(flags)
    except (RuntimeError, OSError) as exc:
        if "unrecognized" in str(exc) or "unknown" in str(exc):
            pytest.skip(f"the compiler does not take {' '.join(flags)}: {exc}")
        raise


@pytest.mark.parametrize("flags", [_NO_AVX512, _NO_AVX2], ids=["avx2", "plain"])
@pytest.mark.parametrize("preset", ["t1-lm-tiny", "t2-lm-tiny", "flash-lm-tiny", "vanilla-lm-tiny"])
def test_a_cpu_without_avx512_builds_the_library_and_its_models_match_the_torch_forms(monkeypatch, preset, flags):
    """The library as a CPU without AVX-512 builds it (-mno-avx512f: AVX2 where -march=native has
    it; with -mno-avx2 -mno-fma too: plain loops) must build (tn_bmm_f32 named an AVX-512-only
    constant, and the whole library had been lost there, silently) and every kernel a model's step
    reaches must agree with the PyTorch forms."""
    from conftest import model_loss_and_grads
    from transnormer.models import TransNormerForCausalLM
    from transnormer.presets import get_config

    if _native.load() is None:
        pytest.skip("no kernels on this machine")
    lib = _variant(flags)
    torch.manual_seed(0)
    model = TransNormerForCausalLM(get_config(preset, num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                              vocab_size=97, dropout=0.0, attention_dropout=0.0))
    ids = torch.randint(0, 97, (2, 70))
    before = _native.backend()
    try:
        _native.set_backend("torch")
        ref = model_loss_and_grads(model, ids, amp=False)
        _native.set_backend("auto")
        monkeypatch.setattr(_native, "_lib", lib)
        monkeypatch.setattr(_native, "_build_flags", {})
        calls = []
        real_call = _native._call
        monkeypatch.setattr(_native, "_call", lambda name, *a: calls.append(name) or real_call(name, *a))
        got = model_loss_and_grads(model, ids, amp=False)
    finally:
        _native.set_backend(before)
    assert calls, "no kernel ran"
    assert rel_err(got[0], ref[0]) < 1e-5 and rel_err(got[1], ref[1]) < 1e-4


def _fake_compiler(monkeypatch, fail_with: str | None = None, commands: list | None = None):
    """subprocess.run as a compiler that writes an empty output (and fails where ``fail_with`` is
    in the command), answering --version and -dumpmachine."""
    def run(cmd, **kw):
        if commands is not None:
            commands.append(cmd)
        if "-o" not in cmd:  # --version, -dumpmachine
            return subprocess.CompletedProcess(cmd, 0, "c++ (fake) 1.0", "")
        if fail_with is not None and fail_with in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "x.cpp:3:1: error: 'round_to' was not declared")
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(_native.subprocess, "run", run)
    monkeypatch.setattr(_native, "_compiler", lambda: ["c++"])


class _FakeLib:
    def __init__(self, path):
        if Path(path).read_bytes() == b"garbage":
            raise OSError(f"{path}: invalid ELF header")
        if Path(path).read_bytes() == b"class32":
            raise OSError(f"{path}: wrong ELF class: ELFCLASS32")
        if Path(path).read_bytes() == b"newer":
            raise OSError(f"/lib/libstdc++.so.6: version `GLIBCXX_3.4.32' not found (required by {path})")
        if Path(path).read_bytes() == b"no-omp":
            raise OSError("libomp.so: cannot open shared object file: No such file or directory")

    def tn_abi_version(self):
        return _native._ABI


def test_a_build_without_the_fast_flags_says_why_at_every_load(monkeypatch, tmp_path):
    """A compile error under -march=native must not pass silently as a portable (slow) build: not in
    the run that built it, nor in the runs that load it from the cache."""
    _fake_compiler(monkeypatch, fail_with="-march=native")
    monkeypatch.setenv("TRANSNORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(_native.ctypes, "CDLL", _FakeLib)
    monkeypatch.setattr(_native, "_declare", lambda lib: None)
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match=r"without -march=native \(slower\).*round_to"):
            _native._open()
    assert len(list((tmp_path / "native").glob("kernels_*.so"))) == 1


def test_a_build_without_one_flag_names_that_flag(monkeypatch, tmp_path):
    # a compiler without OpenMP: the note had said "built without -fopenmp -march=native"
    _fake_compiler(monkeypatch, fail_with="-fopenmp")
    monkeypatch.setenv("TRANSNORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(_native.ctypes, "CDLL", _FakeLib)
    monkeypatch.setattr(_native, "_declare", lambda lib: None)
    with pytest.warns(RuntimeWarning, match=r"built without -fopenmp \(slower\).*delete .*kernels_\w+\.so to build"):
        _native._open()


def test_a_killed_builders_temporary_files_are_removed(tmp_path):
    # a builder killed by SIGKILL or timeout's SIGTERM (no finally runs) left tmp*.so and tmp*/ for good
    import time

    old_so, old_dir, fresh = tmp_path / "tmpa1.so", tmp_path / "tmpb2", tmp_path / "tmpc3.so"
    old_so.write_bytes(b"")
    (old_dir / "x.o").parent.mkdir()
    (old_dir / "x.o").write_bytes(b"o")
    fresh.write_bytes(b"")  # another build's, under way
    keep = tmp_path / "kernels_0123.so"
    keep.write_bytes(b"lib")
    hour_ago = time.time() - 2 * _native._ORPHAN_AGE_S
    for f in (old_so, old_dir, keep):
        os.utime(f, (hour_ago, hour_ago))
    _native._remove_orphans(tmp_path)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["kernels_0123.so", "tmpc3.so"]


def test_an_interrupted_build_is_tried_again(monkeypatch):
    # a Ctrl-C during the first-use build had turned the kernels off for the rest of the process
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_error", None)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(_native, "_open", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _native.load()
    lib = object()
    monkeypatch.setattr(_native, "_open", lambda: lib)
    assert _native.load() is lib


def test_the_kernel_cache_expands_a_home_tilde(monkeypatch, tmp_path):
    # TRANSNORMER_CACHE='~/c' (a quoted value, a Docker ENV) had built the kernels in ./~/c/native
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TRANSNORMER_CACHE", "~/c")
    assert _native._cache_dir() == tmp_path / "c" / "native"


def _fake_library_builds(monkeypatch, tmp_path) -> list:
    """_open on a cache in tmp_path whose builds write b"ok" (listed in the returned list) and whose
    loads are _FakeLib's."""
    built = []
    monkeypatch.setattr(_native, "_compile", lambda out, extra=(): (out.write_bytes(b"ok"), built.append(out)))
    monkeypatch.setenv("TRANSNORMER_CACHE", str(tmp_path))
    monkeypatch.setattr(_native.ctypes, "CDLL", _FakeLib)
    monkeypatch.setattr(_native, "_declare", lambda lib: None)
    return built


def test_a_cached_library_that_does_not_load_is_built_again(monkeypatch, tmp_path):
    # (a truncated file, or one built against another libstdc++, had turned the kernels off for good)
    built = _fake_library_builds(monkeypatch, tmp_path)
    _native._open()
    (path,) = built
    _native._open()
    assert len(built) == 1  # cached
    path.write_bytes(b"garbage")
    _native._open()
    assert built == [path, path] and path.read_bytes() == b"ok"
    path.write_bytes(b"class32")  # a damaged header in other words (it had stayed, the kernels off for good)
    _native._open()
    assert built == [path] * 3 and path.read_bytes() == b"ok"
    # a library this machine's libstdc++ is too old for: a rebuild would not help (every rank would
    # delete and build it in turn), so the error stands and the file stays
    path.write_bytes(b"newer")
    with pytest.raises(OSError, match="GLIBCXX"):
        _native._open()
    assert len(built) == 3 and path.read_bytes() == b"newer"
    # a dependency missing is said in the words of a damaged file, of another file: it stands too (it had
    # deleted and rebuilt the library at every start)
    path.write_bytes(b"no-omp")
    with pytest.raises(OSError, match="libomp.so: cannot open shared object file"):
        _native._open()
    assert len(built) == 3 and path.read_bytes() == b"no-omp"


def test_a_library_cut_short_is_built_again_not_loaded(tmp_path):
    # dlopen of an ELF file cut anywhere past its first bytes died of SIGBUS (uncatchable): every later run
    # crashed with "Bus error" until the file was deleted by hand
    lib = _native.load()
    if lib is None:
        pytest.skip("no compiled library")
    whole = Path(lib._name).read_bytes()
    good = tmp_path / "good.so"
    shutil.copyfile(lib._name, good)
    assert not _native._elf_cut_short(good)
    cuts = [int(len(whole) * frac) for frac in (0.01, 0.1, 0.5, 0.9, 0.999)]
    for n in [*cuts, 6, 52, 58, 60, 63]:  # (a cut inside the 64-bit header had raised struct.error at every run)
        cut = tmp_path / "cut.so"
        cut.write_bytes(whole[:n])
        assert _native._elf_cut_short(cut)
        assert _native._load_cached(cut) is None and not cut.exists()  # removed, to be built again


def test_compiler_settings_and_variant_flags_are_named(monkeypatch):
    # a blank CXX had run the first flag as the compiler ("No such file or directory: '-O3'"); a CXX that
    # cannot be run was named by its path alone; a str of flags was split into one flag per character
    monkeypatch.setenv("CXX", "  ")
    assert _native._compiler() != []
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(RuntimeError, match=r"the C\+\+ compiler '/nonexistent/c\+\+' \(\$CXX"):
        _native._build(["/nonexistent/c++"], ["-O0"], "/tmp/never.so", sources=(_native._SOURCES[0],))
    with pytest.raises(TypeError, match="extra_flags must be a tuple of flags, got the str '-mno-avx512f'"):
        _native.load_variant("-mno-avx512f")


def test_a_lock_that_cannot_be_taken_does_not_stop_the_build(monkeypatch, tmp_path):
    # (a read-only cache or another user's lock file had turned the kernels off: the lock is best effort)
    built = _fake_library_builds(monkeypatch, tmp_path)
    real_open = os.open

    def no_lock(path, *a, **k):
        if str(path).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(_native.os, "open", no_lock)
    _native._open()
    assert len(built) == 1


def test_a_filesystem_without_flock_builds_unlocked(monkeypatch, tmp_path):
    # (some network filesystems: the lock file opens, flock fails with ENOLCK)
    import errno
    import fcntl

    built = _fake_library_builds(monkeypatch, tmp_path)

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    _native._open()
    assert len(built) == 1


def test_the_compiler_may_come_with_arguments_and_the_cpu_unknown(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "ccache g++")  # had been run as one program name: kernels off
    assert _native._compiler() == ["ccache", "g++"]
    # no /proc/cpuinfo: the cache key holds no ISA, so no -march=native build to share with another CPU
    commands = []
    _fake_compiler(monkeypatch, commands=commands)
    monkeypatch.setattr(_native, "cpu_info", lambda: _native.CpuInfo("", "", frozenset()))
    _native._compile(tmp_path / "lib.so")
    assert commands and not any("-march=native" in c for c in commands)


def test_the_built_library_is_readable_by_other_users(monkeypatch, tmp_path):
    """mkstemp's 0600 stayed on the library (0711 after the compiler): another user of a shared cache
    could not dlopen it and ran the PyTorch forms for good."""
    _fake_compiler(monkeypatch)
    old = os.umask(0o022)
    try:
        _native._compile(tmp_path / "lib.so")
    finally:
        os.umask(old)
    assert (tmp_path / "lib.so").stat().st_mode & 0o777 == 0o755


def _case(B, T, H, D, E, dtype=torch.float64):
    g = torch.Generator().manual_seed(T * 1000 + D * 10 + E)
    q, k, v = (torch.randn(B, T, H, x, dtype=dtype, generator=g).requires_grad_() for x in (D, D, E))
    S0 = torch.randn(B, H, D, E, dtype=dtype, generator=g).requires_grad_()
    go = torch.randn(B, T, H, E, dtype=dtype, generator=g)
    gs = torch.randn(B, H, D, E, dtype=dtype, generator=g)
    return q, k, v, S0, go, gs


def _outputs_and_grads(fn, q, k, v, S0, go, gs):
    o, s = fn(q, k, v, S0)
    grads = torch.autograd.grad((o * go).sum() + (s * gs).sum(), (q, k, v, S0))
    return (o, s, *grads)


@needs_kernel
@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 200])
@pytest.mark.parametrize("H,D,E,chunk", [(2, 64, 64, 64), (3, 16, 40, 16), (1, 7, 130, 10), (2, 33, 17, 1000), (1, 80, 24, 7)])
def test_outputs_state_and_grads_match_reference_fp64(native, T, H, D, E, chunk):
    """Odd lengths, head dims that leave vector tails (7, 17, 33) or span two panels (80, 130)."""
    q, k, v, S0, go, gs = _case(2, T, H, D, E)
    got = _outputs_and_grads(
        lambda q, k, v, S0: norm_linear_attn(q, k, v, causal=True, chunk_size=chunk, initial_state=S0,
                                             output_final_state=True), q, k, v, S0, go, gs)
    ref = _outputs_and_grads(lambda q, k, v, S0: norm_linear_attn_reference(q, k, v, causal=True, initial_state=S0),
                             q, k, v, S0, go, gs)
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dS0"), got, ref):
        assert rel_err(a, b) < 1e-10, name


@needs_kernel
@pytest.mark.parametrize("flags", [_NO_AVX512, _NO_AVX2], ids=["avx2", "plain"])
def test_builds_without_avx512_match_reference_fp64(native, monkeypatch, flags):
    """The GEMM of a build without AVX-512 (the AVX2 micro-kernel, whose masked tails and 16-column
    panels differ from AVX-512's, or plain loops), causal and bidirectional, fp64 at odd lengths
    and head dims that leave vector tails: on an AVX-512 machine only this test reaches it."""
    lib = _variant(flags)
    monkeypatch.setattr(_native, "_lib", lib)
    monkeypatch.setattr(_native, "_build_flags", {})
    calls = []
    real_call = _native._call
    monkeypatch.setattr(_native, "_call", lambda name, *a: calls.append((name, _native.load())) or real_call(name, *a))
    for causal in (True, False):
        for T, (H, D, E, chunk) in [(1, (2, 64, 64, 64)), (63, (1, 7, 130, 10)), (65, (2, 33, 17, 1000)),
                                    (200, (1, 80, 24, 7))]:
            q, k, v, S0, go, gs = _case(2, T, H, D, E)
            got = _outputs_and_grads(
                lambda q, k, v, S0, c=causal, n=chunk: norm_linear_attn(
                    q, k, v, causal=c, chunk_size=n, initial_state=S0, output_final_state=True), q, k, v, S0, go, gs)
            ref = _outputs_and_grads(
                lambda q, k, v, S0, c=causal: norm_linear_attn_reference(q, k, v, causal=c, initial_state=S0),
                q, k, v, S0, go, gs)
            for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dS0"), got, ref):
                assert rel_err(a, b) < 1e-10, (causal, T, name)
    assert all(lib_ is lib for _, lib_ in calls) and {n for n, _ in calls} >= {"tn_causal_fwd", "tn_causal_bwd",
                                                                                "tn_bidir_fwd", "tn_bidir_bwd"}


@needs_kernel
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200, 1100])
@pytest.mark.parametrize("H,D,E", [(2, 64, 64), (3, 16, 40), (1, 7, 130), (2, 33, 17), (2, 16, 24)])
def test_bidirectional_kernel_matches_reference_fp64(native, monkeypatch, T, H, D, E):
    calls = []
    real = _native.native_bidir_linear_attn
    monkeypatch.setattr(_native, "native_bidir_linear_attn", lambda *a: calls.append(1) or real(*a))
    q, k, v, S0, go, gs = _case(2, T, H, D, E)
    got = _outputs_and_grads(
        lambda q, k, v, S0: norm_linear_attn(q, k, v, causal=False, initial_state=S0, output_final_state=True),
        q, k, v, S0, go, gs)
    ref = _outputs_and_grads(lambda q, k, v, S0: norm_linear_attn_reference(q, k, v, causal=False, initial_state=S0),
                             q, k, v, S0, go, gs)
    assert calls
    for name, a, b in zip(("o", "state", "dq", "dk", "dv", "dS0"), got, ref):
        assert rel_err(a, b) < 1e-10, name


@needs_kernel
@pytest.mark.parametrize("D,E", [(64, 32), (80, 130)])  # one panel of C: A read in place; wider: packed
def test_bidirectional_kernel_without_state_and_fp32(native, D, E):
    q, k, v, _, go, _ = _case(1, 300, 4, D, E, dtype=torch.float32)
    o, fin = norm_linear_attn(q, k, v, causal=False)
    assert fin is None
    grads = torch.autograd.grad((o * go).sum(), (q, k, v))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = norm_linear_attn_reference(qd, kd, vd, causal=False)
    ref_grads = torch.autograd.grad((ref * go.double()).sum(), (qd, kd, vd))
    for a, b in zip((o, *grads), (ref, *ref_grads)):
        assert a.dtype == torch.float32
        assert rel_err(a.double(), b) < 1e-5


@needs_kernel
@pytest.mark.parametrize("T", [63, 64, 65, 1000])
def test_fp32_matches_reference(native, T):
    q, k, v, S0, go, gs = _case(1, T, 4, 64, 64, dtype=torch.float32)
    got = _outputs_and_grads(
        lambda q, k, v, S0: norm_linear_attn(q, k, v, causal=True, initial_state=S0, output_final_state=True),
        q, k, v, S0, go, gs)
    qd, kd, vd, S0d = (x.detach().double().requires_grad_() for x in (q, k, v, S0))
    ref = _outputs_and_grads(lambda q, k, v, S0: norm_linear_attn_reference(q, k, v, causal=True, initial_state=S0),
                             qd, kd, vd, S0d, go.double(), gs.double())
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        assert rel_err(a.double(), b) < 1e-4


@needs_kernel
@pytest.mark.parametrize("causal,T", [(True, 300), (False, 300), (False, 1100)])
def test_same_result_on_one_and_two_threads(native, causal, T):
    """Heads are split over threads and each head is walked in the same order: bitwise equal."""
    q, k, v, S0, go, gs = _case(2, T, 3, 32, 32, dtype=torch.float32)

    def run():
        return _outputs_and_grads(
            lambda q, k, v, S0: norm_linear_attn(q, k, v, causal=causal, initial_state=S0, output_final_state=True),
            q, k, v, S0, go, gs)

    one, two = on_one_and_two_threads(run)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_chunks_past_the_kernel_limit_take_the_pytorch_form(monkeypatch):
    """The kernels allocate c x c tiles per thread: chunk_size = T = 32k asked 8 GiB per thread."""
    def refuse(*a, **k):
        raise AssertionError("kernel called")

    monkeypatch.setattr(_native, "native_causal_linear_attn", refuse)
    q = torch.randn(1, _native.MAX_KERNEL_CHUNK + 1, 1, 4, dtype=torch.float64)
    o, _ = norm_linear_attn(q, q, q, causal=True, chunk_size=q.shape[1])
    assert torch.allclose(o, norm_linear_attn_reference(q, q, q, causal=True)[0], atol=1e-9)
    if _native.load() is not None:  # backend "native" promises the kernels or an error
        monkeypatch.setattr(_native, "_mode", "native")
        with pytest.raises(ValueError, match="the causal kernels take chunk_size <= 1024"):
            norm_linear_attn(q, q, q, causal=True, chunk_size=q.shape[1])


_OUT_OF_MEMORY = """
import resource
import torch
from transnormer.ops import _native
q = torch.randn(1, 4096, 1, 1)
for nt in (1, 2):
    torch.set_num_threads(nt)
    _native.native_causal_linear_attn(q, q, q, None, chunk=64)  # the library and its threads, warm
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
    try:
        _native.native_causal_linear_attn(q, q, q, None, chunk=4096)  # two 64 MB score tiles a thread
        print(nt, "no error")
    except MemoryError as e:
        print(nt, "MemoryError:", e)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(nt, "then:", bool(torch.isfinite(_native.native_causal_linear_attn(q, q, q, None, chunk=64)[0]).all()))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc for the memory cap")
def test_a_kernel_out_of_memory_raises_memory_error(native):
    """std::bad_alloc in a kernel's thread had unwound out of the OpenMP region (or through ctypes)
    and ended the process; now the kernel records it and the call raises MemoryError."""
    out = subprocess.run([sys.executable, "-c", _OUT_OF_MEMORY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for nt in (1, 2):
        assert f"{nt} MemoryError: tn_causal_fwd: out of memory" in out.stdout and f"{nt} then: True" in out.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(0, 5, 2, 32), (1, 5, 0, 32), (1, 5, 2, 0)])
def test_empty_batch_heads_or_width_skip_the_kernels(dtype, shape):
    """Zero-size dims take the PyTorch form (the kernels need B, T, H, D, E >= 1)."""
    q = torch.zeros(shape, dtype=dtype)
    for causal in (True, False):
        o, s = norm_linear_attn(q, q, q, causal=causal, output_final_state=True)
        assert o.shape == shape and s.shape == (shape[0], shape[2], shape[3], shape[3])


@needs_kernel
def test_non_contiguous_inputs_and_unused_outputs(native):
    x = torch.randn(2, 3, 70, 16, dtype=torch.float64)  # [B, H, T, D]: permuted views below
    q, k, v = (x.permute(0, 2, 1, 3) * s for s in (1.0, 0.5, 2.0))
    q.requires_grad_()
    o, _ = norm_linear_attn(q, k, v, causal=True, chunk_size=16)  # final state unused: no gradient for it
    ref, _ = norm_linear_attn_reference(q, k, v, causal=True)
    assert rel_err(o, ref) < 1e-10
    (gq,) = torch.autograd.grad(o.sum(), q)
    (gq_ref,) = torch.autograd.grad(ref.sum(), q)
    assert rel_err(gq, gq_ref) < 1e-10


@needs_kernel
@pytest.mark.parametrize("causal", [True, False])
def test_gradcheck_through_the_kernel(native, causal):
    q, k, v, S0, _, _ = _case(1, 9, 2, 3, 2)

    def f(q, k, v, S0):
        return norm_linear_attn(q, k, v, causal=causal, chunk_size=4, initial_state=S0, output_final_state=True)

    assert torch.autograd.gradcheck(f, (q, k, v, S0))


def test_torch_backend_never_calls_the_kernel(monkeypatch):
    before = _native.backend()
    try:
        _native.set_backend("torch")

        def boom(*a, **k):
            raise AssertionError("kernel called")

        monkeypatch.setattr(_native, "native_causal_linear_attn", boom)
        monkeypatch.setattr(_native, "native_bidir_linear_attn", boom)
        q = torch.randn(1, 10, 1, 4, dtype=torch.float64)
        for causal in (True, False):
            o, _ = norm_linear_attn(q, q, q, causal=causal)
            assert rel_err(o, norm_linear_attn_reference(q, q, q, causal=causal)[0]) < 1e-12
    finally:
        _native.set_backend(before)


def test_bad_backend_name_and_unsupported_dtype():
    with pytest.raises(ValueError, match="backend"):
        _native.set_backend("cuda")
    if _native.load() is None:
        return
    before = _native.backend()
    try:
        _native.set_backend("native")
        # no kernel takes fp16: the op runs it in fp32 (its sums leave fp16's range), so the
        # forced kernels take it too
        q = torch.randn(1, 10, 1, 4, dtype=torch.float16)
        o, _ = norm_linear_attn(q, q, q, causal=True)
        assert o.dtype == torch.float16
        assert torch.allclose(o.float(), norm_linear_attn(q.float(), q.float(), q.float(), causal=True)[0].half().float())
    finally:
        _native.set_backend(before)


def test_disabled_by_environment(tmp_path):
    code = "from transnormer.ops import _native; print(_native.load() is None, _native._error)"
    env = dict(os.environ, TRANSNORMER_NATIVE="0", TRANSNORMER_CACHE=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("True disabled")


@needs_kernel
@pytest.mark.parametrize("T", [1, 63, 64, 65])
def test_bf16_without_bf16_kernel_runs_the_fp32_kernel_on_copies(monkeypatch, T):
    """No bf16 kernel (AVX-512 without AVX512-BF16): causal bf16 takes the fp32 kernel on fp32
    copies (faster there than the PyTorch bf16 form); the result is that kernel's, rounded once,
    and the gradients come back in bf16."""
    monkeypatch.setattr(_native, "bf16_ready", lambda: False)
    seen = []
    kernel = _native.native_causal_linear_attn
    monkeypatch.setattr(_native, "native_causal_linear_attn",
                        lambda q, k, v, init, chunk: seen.append(q.dtype) or kernel(q, k, v, init, chunk=chunk))
    q, k, v = (torch.randn(2, T, 3, 32, dtype=torch.bfloat16).mul_(0.3).requires_grad_() for _ in range(3))
    S0 = torch.randn(2, 3, 32, 32)
    o, fin = norm_linear_attn(q, k, v, causal=True, chunk_size=16, initial_state=S0, output_final_state=True)
    assert seen == [torch.float32] and o.dtype == torch.bfloat16 and fin.dtype == torch.float32
    want, want_fin = norm_linear_attn_reference(q.double(), k.double(), v.double(), causal=True,
                                                initial_state=S0.double())
    assert rel_err(o.double(), want) < 1e-2 and rel_err(fin.double(), want_fin) < 1e-5
    grads = torch.autograd.grad((o.float() ** 2).sum(), (q, k, v))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, _ = norm_linear_attn_reference(qd, kd, vd, causal=True, initial_state=S0.double())
    for g, r in zip(grads, torch.autograd.grad((ref ** 2).sum(), (qd, kd, vd))):
        assert g.dtype == torch.bfloat16 and rel_err(g.double(), r) < 2e-2
    monkeypatch.setattr(_native, "bf16_ready", lambda: True)  # with the bf16 kernel, never the upcast
    assert not _native.upcast_usable(q, k, v)


@needs_kernel
def test_native_mode_runs_bidirectional_bf16_without_bf16_kernel(monkeypatch, native):
    # causal bf16 ran on the upcast kernel under backend "native"; bidirectional raised
    monkeypatch.setattr(_native, "bf16_ready", lambda: False)
    q, k, v = (torch.randn(1, 70, 2, 32, dtype=torch.bfloat16).mul_(0.3) for _ in range(3))
    o, _ = norm_linear_attn(q, k, v, causal=False)
    want, _ = norm_linear_attn_reference(q.double(), k.double(), v.double(), causal=False)
    assert o.dtype == torch.bfloat16 and rel_err(o.double(), want) < 1e-2


def test_cpu_info_reads_the_first_cpu_and_tolerates_no_proc(monkeypatch):
    import io

    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9999\nflags\t\t: fpu avx512f avx512_bf16\n\n"
            "processor\t: 1\nvendor_id\t: Other\nmodel name\t: second\nflags\t\t: fpu\n")
    monkeypatch.setattr(_native, "open", lambda *a, **k: io.StringIO(text), raising=False)
    _native.cpu_info.cache_clear()
    try:
        info = _native.cpu_info()
        assert info == ("AuthenticAMD", "AMD EPYC 9999", frozenset({"fpu", "avx512f", "avx512_bf16"}))
        assert _native._cpu_signature().endswith("avx512_bf16 avx512f fpu")

        def missing(*a, **k):
            raise OSError("no /proc")

        monkeypatch.setattr(_native, "open", missing, raising=False)
        _native.cpu_info.cache_clear()
        assert _native.cpu_info() == ("", "", frozenset())
    finally:
        monkeypatch.undo()
        _native.cpu_info.cache_clear()


@needs_kernel
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_streamed_from_the_products_equal_the_tiled_path(native, dtype, causal):
    # outputs on 64-byte lines are streamed by the product that completes them (in the causal walk
    # the second of two, adding the first's partial sum from the tile); one element off the line
    # boundary they go through a tile and unpack(): the same values, bit for bit
    from transnormer.ops._native import _call, _ptr

    B, T, H, D = 1, 130, 2, 64
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, generator=g, dtype=dtype) for _ in range(4))
    n = B * T * H * D

    def outputs(aligned: bool):
        bufs = [torch.empty(n + 1, dtype=dtype) for _ in range(4)]
        o, dq, dk, dv = (b[:n] if aligned else b[1:] for b in bufs)
        assert all((x.data_ptr() % 64 == 0) == aligned for x in (o, dq, dk, dv))
        fin, dS = torch.empty(B, H, D, D, dtype=dtype), torch.empty(B, H, D, D, dtype=dtype)
        if causal:
            _call("tn_causal_fwd", dtype, _ptr(q), _ptr(k), _ptr(v), _ptr(o), None, _ptr(fin), B, T, H, D, D, 64)
            _call("tn_causal_bwd", dtype, _ptr(q), _ptr(k), _ptr(v), _ptr(do), None, _ptr(fin), _ptr(dq), _ptr(dk),
                  _ptr(dv), _ptr(dS), B, T, H, D, D, 64)
        else:
            _call("tn_bidir_fwd", dtype, _ptr(q), _ptr(k), _ptr(v), _ptr(o), None, _ptr(fin), B, T, H, D, D)
            _call("tn_bidir_bwd", dtype, _ptr(q), _ptr(k), _ptr(v), _ptr(do), _ptr(fin), None, _ptr(dq), _ptr(dk),
                  _ptr(dv), _ptr(dS), B, T, H, D, D)
        return o, dq, dk, dv, fin, dS

    for a, b in zip(outputs(True), outputs(False)):
        assert torch.equal(a, b)


def test_fullgraph_compile_of_softmax_ops_on_a_cold_start():
    """A fresh process (library not loaded yet): the fused-kernel probe took the library's lock
    inside the trace and fullgraph=True failed with 'Unsupported context manager'."""
    code = ("import torch\nfrom transnormer.ops import softmax_attn, block_attn\n"
            "q = torch.randn(1, 64, 2, 16)\n"
            "f = torch.compile(lambda q: softmax_attn(q, q, q, causal=True), fullgraph=True, backend='eager')\n"
            "g = torch.compile(lambda q: block_attn(q, q, q, causal=True, block_size=16), fullgraph=True, "
            "backend='eager')\n"
            "print(float((f(q) - softmax_attn(q, q, q, causal=True)).abs().max()), "
            "float((g(q) - block_attn(q, q, q, causal=True, block_size=16)).abs().max()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(float(x) < 1e-5 for x in proc.stdout.split())


def test_a_tensor_off_the_cpu_never_loads_the_cpu_kernels(monkeypatch):
    """softmax_upcast_usable asked whether the fp32 softmax kernel was ready before the device: a
    GPU run built the CPU library inside its first timed step (found with meta tensors)."""
    calls = []
    monkeypatch.setattr(_native, "load", lambda: calls.append(1))
    monkeypatch.setattr(_native, "_build_flags", {})  # (an earlier test's cached answer would hide a load)
    q = torch.empty(1, 64, 2, 64, dtype=torch.bfloat16, device="meta")
    assert not _native.softmax_upcast_usable(q, q, q)
    assert _native.fused_softmax_attn(q, q, q, causal=True, scale=0.125) is None
    assert calls == []
