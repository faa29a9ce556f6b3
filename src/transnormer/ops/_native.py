"""Fused CPU kernels, built at first use: ``norm_linear_attn``, causal and bidirectional
(``_native_linear_attn.cpp`` for fp32/fp64, ``_native_amx.cpp`` for bf16), softmax attention for
``softmax_attn`` and ``block_attn`` (``_native_softmax_amx.cpp`` for bf16, ``_native_softmax.cpp``
for fp32), and the row kernels of a training step: the LRPE feature map (``_native_lrpe.cpp``),
the LM loss's softmax cross-entropy rows (``_native_xent.cpp``), SimpleRMSNorm
(``_native_norm.cpp``), the GLU's SiLU gate (``_native_glu.cpp``) and the GAU/FLASH query-key
heads (``_native_heads.cpp``). The bf16 kernels run their products on AMX tiles or, on a CPU
without AMX, on AVX512-BF16 dot products (``_native_amx.h``; see :func:`bf16_engine`).

The C++ sources are compiled once per machine with the system compiler (``-O3 -march=native
-fopenmp``) into one library in a cache directory and loaded with ctypes: no torch headers, so
the build takes a few seconds. When there is no compiler, the build fails, or
``TRANSNORMER_NATIVE=0`` is set, the kernels are simply unavailable and every op runs its
PyTorch form (``set_backend("torch")`` forces that; exported as
``transnormer.ops.set_kernel_backend``). The kernels read their tensors in place (q, k, v in
their [B, T, H, D] layout) and split rows or heads over ``torch.get_num_threads()`` threads.

Cache directory: ``$TRANSNORMER_CACHE/native`` if set, else ``~/.cache/transnormer/native``.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import torch

from ._checks import first_order_only
from ._dtypes import state_dtype_for

_SOURCES = tuple(Path(__file__).with_name(f) for f in (
    "_native_linear_attn.cpp", "_native_lrpe.cpp", "_native_xent.cpp", "_native_norm.cpp", "_native_glu.cpp",
    "_native_heads.cpp", "_native_amx.cpp", "_native_softmax_amx.cpp", "_native_softmax.cpp", "_native_prefix.cpp",
    "_native_flash.cpp", "_native_bmm.cpp"))
_HEADERS = tuple(Path(__file__).with_name(f) for f in ("_native_common.h", "_native_simd.h", "_native_amx.h",
                                                      "_native_gemm.h", "_native_softmax_walk.h"))
# -fno-tree-loop-distribute-patterns: keep the tile copies inline (GCC would call memcpy per row).
# -fno-trapping-math: the kernels never read floating-point exception flags, so the compiler may
# compute both sides of a select; without it GCC leaves every loop with a select on floats (exp's
# clamp, sigmoid's sign) scalar, and the row kernels' portable loops (the path of a CPU without
# AVX-512) ran 1.3-5x slower than PyTorch. It does not change any result.
_FLAGS_TRIED_FIRST = ("-fopenmp", "-march=native")
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-tree-loop-distribute-patterns",
          "-fno-trapping-math"]
_ABI = 13
_lock = threading.Lock()
# The causal kernels keep c x c score tiles per thread (2 x 64 MB at c = 4096 in fp32): longer
# chunks take the PyTorch form (in backend "native", a ValueError).
MAX_KERNEL_CHUNK = 1024
_lib: ctypes.CDLL | None = None
_variants: dict[tuple[str, ...], ctypes.CDLL | Exception] = {}  # load_variant's libraries (or errors) by flags
_tried = False
_error: str | None = None
_mode = "auto"  # "auto": native when available; "torch": never; "native": required


def _cache_dir() -> Path:
    root = os.environ.get("TRANSNORMER_CACHE")  # (~ expanded, as the data caches do: it had built in ./~/)
    return Path(root).expanduser() / "native" if root else Path.home() / ".cache" / "transnormer" / "native"


class CpuInfo(NamedTuple):
    vendor: str  # "AuthenticAMD", "GenuineIntel", ...
    model: str
    flags: frozenset[str]  # "avx512f", "amx_bf16", ...


@functools.cache
def cpu_info() -> CpuInfo:
    """The first CPU of /proc/cpuinfo; empty fields where a line or the file is missing (not
    Linux). Read once for the kernel cache key, the fp32 GEMM routing (ops/dense.py) and the
    benchmarks' environment."""
    fields = {"vendor_id": "", "model name": "", "flags": "", "Features": ""}  # Features: ARM's flags
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if fields.get(name.strip(), None) == "":
                    fields[name.strip()] = value.strip()
                if fields["vendor_id"] and fields["model name"] and (fields["flags"] or fields["Features"]):
                    break
    except OSError:
        pass
    return CpuInfo(fields["vendor_id"], fields["model name"], frozenset((fields["flags"] or fields["Features"]).split()))


def _cpu_signature() -> str:
    # -march=native code is only valid on the CPU it was built for: key the cache by its flags.
    return platform.machine() + platform.processor() + " ".join(sorted(cpu_info().flags))


def _compiler() -> list[str] | None:
    """The C++ compiler's command: $CXX split as a shell would (CXX="ccache g++"), else the first
    of c++, g++, clang++ on the PATH."""
    if os.environ.get("CXX", "").strip():  # (a blank one had run the first compiler flag as the program)
        return shlex.split(os.environ["CXX"])
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return [found] if found else None


@functools.cache
def _compiler_identity(compiler: tuple[str, ...]) -> str:
    """The compiler's --version and target, for the cache key: a library built by a newer compiler
    can need a newer libstdc++ than another machine sharing the cache has."""
    try:
        return " ".join(subprocess.run([*compiler, flag], capture_output=True, text=True, timeout=60).stdout.strip()
                        for flag in ("--version", "-dumpmachine"))
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(compiler: list[str], flags: list[str], out: str,
           sources: tuple[Path, ...] = _SOURCES) -> subprocess.CompletedProcess:
    """Compile each source to an object file, as many at once as there are cores (the largest
    first), then link them into ``out``; returns the first failed step's result, else the link's.
    In one compiler process the sources took 32 s on 2 cores of an AVX2 EPYC: every first use of
    the library, and three builds in each clean test run. (``sources``: another checkout's, for
    benchmarks/ab_kernels.py.)"""
    with tempfile.TemporaryDirectory(dir=Path(out).parent) as objdir:
        sources = sorted(sources, key=lambda f: f.stat().st_size, reverse=True)
        objects = [str(Path(objdir) / f"{src.stem}.o") for src in sources]

        def one(src: Path, obj: str) -> subprocess.CompletedProcess:
            try:
                return subprocess.run([*compiler, *flags, "-c", str(src), "-o", obj], capture_output=True, text=True)
            except OSError as exc:  # (the warning had said "No such file or directory: '/x'", not what /x is)
                raise RuntimeError(f"the C++ compiler {' '.join(compiler)!r} ($CXX, else c++/g++/clang++ on the "
                                   f"PATH) cannot be run: {exc}") from exc

        with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
            for proc in list(pool.map(one, sources, objects)):
                if proc.returncode != 0:
                    return proc
        return subprocess.run([*compiler, *flags, *objects, "-o", out], capture_output=True, text=True)


def _fallback_note(lib: Path) -> Path:
    """Beside a library built without the first-tried flags: why (read again at every load)."""
    return lib.with_suffix(".fallback")


_ORPHAN_AGE_S = 3600.0  # a build takes minutes: a temporary file this old is a killed builder's


def _remove_orphans(folder: Path) -> None:
    """Remove the temporary library and object folder a builder killed by a signal (SIGKILL, or the
    SIGTERM of `timeout`: no finally runs) left in the cache; they had stayed there for good."""
    import shutil
    import time

    now = time.time()
    for f in folder.glob("tmp*"):
        try:
            if now - f.stat().st_mtime < _ORPHAN_AGE_S:
                continue
            if f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            elif f.suffix == ".so":
                f.unlink()
        except OSError:  # (another process's, or gone already)
            pass


def _compile(out: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Build the library at ``out``. With ``extra_flags`` (a variant build) only builds for this
    CPU (-march=native) plus those are tried: a failure raises rather than falling back to a
    portable build. Where the CPU's flags cannot be read (no /proc/cpuinfo) the cache key holds no
    ISA, so the build is portable: a -march=native one shared with another CPU could die of SIGILL."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(out.parent)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        # -fopenmp: share PyTorch's OpenMP threads (_native_common.h); some compilers lack it, and
        # some compilers (or CPUs) reject -march=native
        first_error = None
        if extra_flags:
            attempts = ([*_FLAGS_TRIED_FIRST, *extra_flags], ["-march=native", *extra_flags])
        elif cpu_info().flags:
            attempts = (list(_FLAGS_TRIED_FIRST), ["-march=native"], ["-fopenmp"], [])
        else:
            attempts = (["-fopenmp"], [])
        for extra in attempts:
            proc = _build(compiler, [*_FLAGS, *extra], tmp)
            if proc.returncode == 0:
                break
            first_error = first_error or proc.stderr
        else:
            raise RuntimeError(f"compiling {' '.join(f.name for f in _SOURCES)} failed:\n{proc.stderr[-2000:]}")
        note = _fallback_note(out)
        if first_error is not None and not extra_flags:  # a portable build runs, slowly: say why, at every load
            lines = [ln for ln in first_error.splitlines() if "error" in ln] or first_error.splitlines()
            missing = [f for f in _FLAGS_TRIED_FIRST if f not in extra]  # (all had been named, whichever failed)
            note.write_text(f"the CPU kernels ({out.name}) were built without {' '.join(missing)} (slower): "
                            f"{lines[0] if lines else 'compiler failed'}; delete {out} to build them again")
        else:
            note.unlink(missing_ok=True)
        # mkstemp made the file 0600 (the compiler adds only x bits): other users of a shared cache
        # could not dlopen it and would run the slow PyTorch forms for good
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)
        with open(tmp, "rb") as f:  # on disk before it is named: a crash must not leave a cut library
            os.fsync(f.fileno())
        os.replace(tmp, out)  # atomic: concurrent ranks never load a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
# Exported functions: name -> (suffixes, argument types); every one returns an int status and
# takes the thread count last.
_SIGNATURES = {
    "tn_causal_fwd": (("f32", "f64", "bf16"), [_P] * 6 + [_I64] * 6),  # bf16: _native_amx.cpp
    "tn_causal_bwd": (("f32", "f64", "bf16"), [_P] * 10 + [_I64] * 6),
    "tn_bidir_fwd": (("f32", "f64", "bf16"), [_P] * 6 + [_I64] * 5),
    "tn_bidir_bwd": (("f32", "f64", "bf16"), [_P] * 10 + [_I64] * 5),
    # bf16: _native_softmax_amx.cpp
    "tn_softmax_fwd": (("f32", "bf16"), [_P] * 3 + [_I64] * 3 + [_P] * 2 + [_I64] * 6 + [_I32, _F32]),
    "tn_softmax_bwd": (("f32", "bf16"), [_P] * 3 + [_I64] * 3 + [_P] * 6 + [_I64] * 6 + [_I32, _F32]),
    "tn_lrpe_fwd": (("f32", "bf16"), [_P] * 5 + [_F32, _I32] + [_I64] * 4),
    "tn_lrpe_bwd": (("f32", "bf16"), [_P] * 8 + [_F32, _I32] + [_I64] * 4),
    "tn_xent_rows": (("f32", "bf16"), [_P] + [_I64] * 3 + [_P] * 4 + [_I32]),
    "tn_transpose_acc": (("bf16",), [_P, _I64, _I64, _P, _I32]),
    "tn_srms_fwd": (("f32", "bf16"), [_P] * 2 + [_I64, _I64, _F32, _I32, _F32, _I32]),
    "tn_srms_bwd": (("f32", "bf16"), [_P] * 3 + [_I64, _I64, _F32, _I32, _F32, _P, _I32]),
    "tn_add_upcast": (("f32",), [_P] * 3 + [_I64]),
    "tn_silu_gate_fwd": (("f32", "bf16"), [_P] * 3 + [_I64] * 2),
    "tn_silu_gate_bwd": (("f32", "bf16"), [_P] * 6 + [_I64] * 4),
    "tn_silu_split_fwd": (("f32", "bf16"), [_P] * 4 + [_I32, _I64, _I64]),
    "tn_silu_split_bwd": (("f32", "bf16"), [_P] * 4 + [_I32, _P, _P, _P] + [_I64] * 5),
    "tn_silu_mul_fwd": (("f32", "bf16"), [_P] * 4 + [_I64] * 3),
    "tn_silu_mul_bwd": (("f32", "bf16"), [_P] * 8 + [_I64] * 6),
    "tn_cast_transpose": (("f32", "bf16"), [_P, _I32, _P, _I64, _I64, _I64]),
    "tn_heads_fwd": (("f32", "bf16"), [_P] * 6 + [_I64] * 5 + [_I32, _I64]),
    "tn_heads_bwd": (("f32", "bf16"), [_P] * 8 + [_I64] * 6 + [_I32, _I64]),
    "tn_chunk_prefix": (("f32", "bf16"), [_P] * 3 + [_I64] * 3 + [_I32]),
    "tn_relu2_fwd": (("f32", "bf16"), [_P] * 5 + [_I64] * 2 + [_I32]),
    "tn_relu2_bwd": (("f32", "bf16"), [_P] * 2 + [_I64]),
    "tn_bmm": (("f32",), [_P] + [_I64] * 3 + [_P] + [_I64] * 2 + [_P] + [_I64] * 6 + [_I32]),
    "tn_exp2_pair": (("f32",), [_P] * 3 + [_I64, _I32]),  # test hooks (_native_softmax.cpp)
    "tn_exp2_kernel": (("f32",), [_P] * 3 + [_I64]),
}


def _declare(lib: ctypes.CDLL) -> None:
    for name, (suffixes, args) in _SIGNATURES.items():
        for sfx in suffixes:
            fn = getattr(lib, f"{name}_{sfx}")
            fn.argtypes = [*args, _I32]
            fn.restype = _I32


@contextlib.contextmanager
def _build_lock(lib: Path):
    """One build of a library at a time across processes (torchrun ranks, a shared home): the
    others wait, then load what it built, instead of each running its own compilers. Best effort:
    where the lock file cannot be opened (a read-only cache) or locked (no flock: not POSIX, some
    network filesystems), the build runs unlocked, as each publishes its file atomically anyway."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    lib.parent.mkdir(parents=True, exist_ok=True)
    fd = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # (another user's lock file: read-only serves)
        try:
            fd = os.open(lib.with_suffix(".lock"), flags, 0o666)
            break
        except OSError:
            pass
    try:
        if fd is not None:
            with contextlib.suppress(OSError):  # (no flock on this filesystem: the build runs unlocked)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    print(f"transnormer: waiting for another process to build the CPU kernels ({lib.name})",
                          file=sys.stderr, flush=True)
                    fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # (releases the lock)


# dlopen's words for a file that is not a whole library (cut short, or its header damaged: "invalid
# ELF header", "wrong ELF class", "ELF file version does not match"): building it again can help.
# Other load errors (a libstdc++ older than the one it was built against) raise: a rebuild would not,
# as do these words said of another file (a dependency missing: "libomp.so: cannot open shared
# object file" had deleted and rebuilt the library at every start).
_DAMAGED = ("ELF", "file too short", "cannot open shared object file", "no loadable segments")


def _elf_cut_short(path: Path) -> bool:
    """Whether ``path`` is an ELF file shorter than its own header says (its section table, written
    last, lies past the end): dlopen of such a file dies of SIGBUS, which no Python code can catch."""
    import struct

    with open(path, "rb") as f:
        head = f.read(64)
    if head[:4] != b"\x7fELF" or len(head) < 6:
        return False  # (not ELF: dlopen says so in words, _DAMAGED)
    if len(head) < (64 if head[4] == 2 else 52):  # (a cut inside a 64-bit header had raised struct.error)
        return True
    end = "<" if head[5] == 1 else ">"
    if head[4] == 2:  # 64-bit
        shoff, = struct.unpack_from(end + "Q", head, 0x28)
        entsize, count = struct.unpack_from(end + "HH", head, 0x3A)
    else:
        shoff, = struct.unpack_from(end + "I", head, 0x20)
        entsize, count = struct.unpack_from(end + "HH", head, 0x2E)
    return path.stat().st_size < shoff + entsize * count


def _load_cached(path: Path) -> ctypes.CDLL | None:
    """The cached library at ``path`` (RTLD_LOCAL: variants load beside the default one); None when
    it is not there, or damaged (truncated, not a library), which is removed to be built again."""
    if not path.exists():
        return None
    if _elf_cut_short(path):  # (a 64-byte header read: no cost worth counting at each load)
        path.unlink(missing_ok=True)
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        # dlopen names the file its words are about; only this library's own damage is rebuilt
        said = str(exc)
        if not said.startswith(f"{path}:") or not any(word in said[len(str(path)):] for word in _DAMAGED):
            raise
        path.unlink(missing_ok=True)
        return None


def _open(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The library built with ``extra_flags``, compiled first if the cache does not hold it (or
    holds a damaged file); the lock is taken only to build."""
    compiler = _compiler() or []
    ident = " ".join([*_FLAGS, *_FLAGS_TRIED_FIRST, *extra_flags, *compiler, _compiler_identity(tuple(compiler)),
                      _cpu_signature()]).encode()
    key = hashlib.sha256(b"".join(f.read_bytes() for f in _SOURCES + _HEADERS) + ident).hexdigest()
    path = _cache_dir() / f"kernels_{key[:16]}.so"
    lib = _load_cached(path)
    if lib is None:
        with _build_lock(path):
            lib = _load_cached(path)  # built by another process while this one waited
            if lib is None:
                _compile(path, extra_flags)
                lib = ctypes.CDLL(str(path))
    try:
        warnings.warn(_fallback_note(path).read_text(), RuntimeWarning, stacklevel=3)
    except FileNotFoundError:  # a build with the first-tried flags
        pass
    if lib.tn_abi_version() != _ABI:
        raise RuntimeError(f"stale library {path} (ABI {lib.tn_abi_version()}, expected {_ABI})")
    _declare(lib)
    return lib


def load_variant(extra_flags: tuple[str, ...]) -> ctypes.CDLL:
    """The kernel library built with extra compiler flags, beside the default one, for tests of a
    code path this CPU would not take: ``("-mno-amx-tile", "-mno-amx-bf16")`` builds the bf16
    kernels on the AVX512-BF16 engine on a CPU with AMX. Raises RuntimeError (or OSError) when it
    cannot be built (or loaded)."""
    if isinstance(extra_flags, str):  # (a str had been split into one "flag" per character)
        raise TypeError(f"extra_flags must be a tuple of flags, got the str {extra_flags!r}")
    if not extra_flags:
        raise ValueError("extra_flags must name at least one flag (the default build is load())")
    key = tuple(extra_flags)
    with _lock:
        if key not in _variants:
            try:
                _variants[key] = _open(key)
            except (OSError, RuntimeError) as exc:  # kept: a failed build is not retried per call
                _variants[key] = exc
        if isinstance(_variants[key], Exception):
            raise _variants[key]
        return _variants[key]


def native_disabled() -> bool:
    """``TRANSNORMER_NATIVE=0`` (``1``, the default, uses the kernels); any other value is refused:
    "false" or "off" had left the kernels on without a word."""
    raw = os.environ.get("TRANSNORMER_NATIVE", "").strip() or "1"  # (empty: unset, as the other variables)
    if raw not in ("0", "1"):
        raise ValueError(f"TRANSNORMER_NATIVE must be 0 (the PyTorch forms) or 1 (the native kernels), got {raw!r}")
    return raw == "0"


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None when it cannot be built."""
    global _lib, _tried, _error
    if _tried:
        return _lib
    disabled = native_disabled()  # (before _tried: a bad value raises every time, not once)
    with _lock:
        if _tried:
            return _lib
        interrupted = False
        try:
            if disabled:
                _error = "disabled by TRANSNORMER_NATIVE=0"
            else:
                _lib = _open()
        except (OSError, RuntimeError) as exc:
            _error = str(exc)
            warnings.warn(f"transnormer: fused CPU kernel unavailable, using the PyTorch form ({exc})", stacklevel=2)
        except KeyboardInterrupt:  # a Ctrl-C during the build: the next call builds (it had turned the
            interrupted = True  # kernels off for the rest of the process, without a word)
            raise
        finally:  # only now (a thread on the unlocked fast path must not read _lib mid-build), and
            _tried = not interrupted  # also after a warning raised as an error: not a new build at every call
        return _lib


def set_backend(mode: str) -> None:
    """Choose the CPU backend of the fused kernels.

    ``"auto"`` (default) uses each fused kernel where it applies (``norm_linear_attn``:
    fp32/fp64, and bf16 on a CPU with AMX or AVX512-BF16 when D, E and the chunk are multiples of
    32; softmax attention: see :func:`softmax_usable`; the row kernels: fp32/bf16) when the library
    builds;
    ``"torch"`` always runs the PyTorch forms;
    ``"native"`` is ``"auto"`` that raises if the library is absent, and also if
    ``norm_linear_attn`` gets tensors neither of its kernels can take.
    """
    global _mode
    if mode not in ("auto", "torch", "native"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'native', got {mode!r}")
    if mode == "native" and load() is None:
        raise RuntimeError(f"the fused CPU kernel is unavailable: {_error}")
    _mode = mode


def backend() -> str:
    """The mode set by ``set_backend`` ("auto", "torch" or "native")."""
    return _mode


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernel runs for these tensors under the current backend mode."""
    if _mode == "torch" or torch.compiler.is_compiling():  # ctypes calls cannot be traced
        return False
    ok = all(t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) for t in tensors)
    ok = ok and len({t.dtype for t in tensors}) == 1
    if _mode == "native" and not ok:
        raise RuntimeError("backend 'native' needs CPU float32/float64 tensors of one dtype, or bfloat16 with D, E "
                           "and the chunk multiples of 32 on a CPU with AMX or AVX512-BF16")
    return ok and load() is not None


_build_flags: dict[str, bool] = {}


def _build_flag(symbol: str) -> bool:
    """Whether the library's ``symbol()`` (a readiness probe of one kernel family) returns 1; asked once."""
    if symbol not in _build_flags:
        lib = load()
        _build_flags[symbol] = lib is not None and getattr(lib, symbol)() == 1
    return _build_flags[symbol]


def bf16_ready() -> bool:
    """Whether the bf16 kernels can run: the library was built with AVX512-BF16 (``-march=native``
    on such a CPU), and, where it was built for AMX, Linux grants this process the AMX tile state."""
    return _build_flag("tn_bf16_ready")


def bf16_engine() -> str | None:
    """What the bf16 kernels run their products on: ``"amx"`` (tiles), ``"avx512-bf16"`` (dot
    products on vectors, e.g. AMD Zen 4/5), or None when they cannot run."""
    if not bf16_ready():
        return None
    return {1: "amx", 2: "avx512-bf16"}.get(load().tn_bf16_engine())


def softmax_f32_ready() -> bool:
    """Whether the fp32 softmax-attention kernel was built (AVX-512, or AVX2 with FMA)."""
    return _build_flag("tn_softmax_f32_ready")


def bf16_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int) -> bool:
    """Whether ``norm_linear_attn`` runs on the bf16 kernel: CPU bf16 q, k, v with D, E and the chunk
    multiples of 32, under the current backend mode (the bidirectional form walks chunks of 32 rows
    on AMX, 64 on AVX512-BF16: BIDIR_CHUNK stands for either in this check)."""
    if _mode == "torch" or torch.compiler.is_compiling():
        return False
    if not all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in (q, k, v)):
        return False
    return q.shape[-1] % 32 == 0 and v.shape[-1] % 32 == 0 and chunk % 32 == 0 and bf16_ready()


def upcast_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether bf16 q, k, v run an fp32 kernel on fp32 copies: CPU bf16 tensors on a machine whose bf16
    kernels cannot run (AVX-512 without AVX512-BF16, AVX2 only, or an AMX build whose tile state
    Linux refused), under the current backend mode.
    There the PyTorch bf16 forms of causal ``norm_linear_attn`` and of softmax attention are the
    slower ones (docs/benchmarks.md, twelfth round); see also :func:`softmax_upcast_usable`."""
    if _mode == "torch" or torch.compiler.is_compiling():
        return False
    if not all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in (q, k, v)):
        return False
    return load() is not None and not bf16_ready()


BIDIR_CHUNK = 64  # a chunk the bidirectional kernels accept (their walk: kBidirChunk, 64; 32 on AMX)


def bidir_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the bidirectional ``norm_linear_attn`` runs a fused kernel (bf16, fp32 or fp64)."""
    return bf16_usable(q, k, v, BIDIR_CHUNK) or usable(q, k, v)


def _ptr(x: torch.Tensor | None):
    return None if x is None else ctypes.c_void_p(x.data_ptr())


_DTYPE_SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}


def _call(name: str, dtype: torch.dtype, *args) -> None:
    """Run kernel ``name`` for ``dtype`` (its suffix in ``_SIGNATURES``) on the PyTorch thread count."""
    suffixes = _SIGNATURES[name][0]
    if _DTYPE_SUFFIX.get(dtype) not in suffixes:
        names = " or ".join(str(d).removeprefix("torch.") for d, sfx in _DTYPE_SUFFIX.items() if sfx in suffixes)
        raise TypeError(f"{name}: the kernel takes {names} tensors, got {dtype}")
    lib = load()
    try:
        rc = getattr(lib, f"{name}_{_DTYPE_SUFFIX[dtype]}")(*args, torch.get_num_threads())
    finally:  # (taken even if an interrupt lands here, so that no later call reads this one's error)
        err = lib.tn_take_error()
    if err == 1:
        raise MemoryError(f"{name}: out of memory for the kernel's scratch buffers")
    if err or rc:
        raise RuntimeError(f"{name} failed ({'an exception in the kernel' if err else f'code {rc}'})")


class NativeCausalLinearAttn(torch.autograd.Function):
    """q, k: [B, T, H, D], v: [B, T, H, E], contiguous, one dtype (fp32, fp64, or bf16 on the bf16
    kernel), T >= 1; init: [B, H, D, E] or None, in the state dtype (fp32 for bf16)."""

    @staticmethod
    def forward(ctx, q, k, v, init, chunk: int):
        B, T, H, D = q.shape
        E = v.shape[-1]
        o = torch.empty(B, T, H, E, dtype=q.dtype)
        fin = torch.empty(B, H, D, E, dtype=state_dtype_for(q.dtype))
        _call("tn_causal_fwd", q.dtype, _ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(init), _ptr(fin), B, T, H, D, E, chunk)
        ctx.save_for_backward(q, k, v, init)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)  # an unused final state needs no zero gradient tensor
        return o, fin

    @staticmethod
    @first_order_only
    def backward(ctx, do, dfin):
        q, k, v, init = ctx.saved_tensors
        return (*_backward_call("tn_causal_bwd", q, k, v, do, init, dfin, init, ctx.chunk), None)


def _backward_call(name: str, q, k, v, do, state, dfin, dinit_like, *extra):
    """(dq, dk, dv, dinit) from backward kernel ``name``, whose fifth argument is ``state`` (the
    initial state for the causal form, the final one for the bidirectional); dinit is None when
    ``dinit_like`` is. A gradient autograd did not materialise (None) counts as zero."""
    B, T, H, D = q.shape
    E = v.shape[-1]
    do = torch.zeros(B, T, H, E, dtype=q.dtype) if do is None else do.contiguous()
    dfin = None if dfin is None else dfin.to(state_dtype_for(q.dtype)).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dinit = None if dinit_like is None else torch.empty_like(dinit_like)
    _call(name, q.dtype, _ptr(q), _ptr(k), _ptr(v), _ptr(do), _ptr(state), _ptr(dfin), _ptr(dq), _ptr(dk), _ptr(dv),
          _ptr(dinit), B, T, H, D, E, *extra)
    return dq, dk, dv, dinit


def native_causal_linear_attn(q, k, v, init, *, chunk: int):
    """(o [B, T, H, E], final state [B, H, D, E]) from the fused kernel; T >= 1."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    init = None if init is None else init.to(state_dtype_for(q.dtype)).contiguous()
    return NativeCausalLinearAttn.apply(q, k, v, init, chunk)


class NativeBidirLinearAttn(torch.autograd.Function):
    """Bidirectional form: q, k [B, T, H, D], v [B, T, H, E] contiguous, one dtype, T >= 1; init
    [B, H, D, E] or None in the state dtype. The final state S is saved for the backward (it is
    the op's output, [B, H, D, E]; nothing per row or chunk is kept)."""

    @staticmethod
    def forward(ctx, q, k, v, init):
        B, T, H, D = q.shape
        E = v.shape[-1]
        o = torch.empty(B, T, H, E, dtype=q.dtype)
        fin = torch.empty(B, H, D, E, dtype=state_dtype_for(q.dtype))
        _call("tn_bidir_fwd", q.dtype, _ptr(q), _ptr(k), _ptr(v), _ptr(o), _ptr(init), _ptr(fin), B, T, H, D, E)
        ctx.save_for_backward(q, k, v, fin)
        ctx.has_init = init is not None
        ctx.set_materialize_grads(False)
        return o, fin

    @staticmethod
    @first_order_only
    def backward(ctx, do, dfin):
        q, k, v, S = ctx.saved_tensors
        dq, dk, dv, dinit = _backward_call("tn_bidir_bwd", q, k, v, do, S, dfin, S)  # the kernel always forms dS
        return dq, dk, dv, (dinit if ctx.has_init else None)


def native_bidir_linear_attn(q, k, v, init):
    """(o [B, T, H, E], final state [B, H, D, E]) of the bidirectional form from the fused kernel; T >= 1."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    init = None if init is None else init.to(state_dtype_for(q.dtype)).contiguous()
    return NativeBidirLinearAttn.apply(q, k, v, init)


# ------------------------------------------------------------------------------------------------
# Softmax attention (vanilla attention and DiagAttention blocks): bf16 on AMX tiles or
# AVX512-BF16 (_native_softmax_amx.cpp), fp32 on AVX-512 or AVX2 with FMA (_native_softmax.cpp)
# ------------------------------------------------------------------------------------------------
def softmax_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> bool:
    """Whether softmax attention of q, k [B, T, H, D], v [B, T, H, E] runs a fused CPU kernel: bf16 on
    the bf16 kernel (D, E and ``window`` multiples of 32) or fp32 on AVX-512 or AVX2 (D, E multiples of 16,
    ``window`` of 64); ``window`` 0 means all keys. Also: no empty dim, backend mode not "torch",
    not being traced."""
    if _mode == "torch" or torch.compiler.is_compiling():
        return False
    if not all(t.device.type == "cpu" and t.dtype == q.dtype for t in (q, k, v)) or 0 in q.shape or 0 in v.shape:
        return False
    D, E = q.shape[-1], v.shape[-1]
    if q.dtype == torch.bfloat16:
        return D % 32 == 0 and E % 32 == 0 and window % 32 == 0 and bf16_ready()
    if q.dtype == torch.float32:
        return D % 16 == 0 and E % 16 == 0 and window % 64 == 0 and softmax_f32_ready()
    return False


def softmax_upcast_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0) -> bool:
    """Whether bf16 softmax attention runs the fp32 kernel on fp32 copies: CPU bf16 q, k, v with D, E
    multiples of 16, on a machine whose library has no bf16 kernel. Blocks (``window`` > 0) only
    without AVX-512: on AVX-512 (Zen 5, before its bf16 engine) the PyTorch bf16 form of
    ``block_attn`` was as fast; on AVX2 (Zen 3) its bf16 products are emulated and it ran 10x slower
    (blocks of 64, T = 4k, 8 heads, fwd+bwd: 311-400 ms against 23-37 ms here)."""
    if 0 in q.shape or 0 in v.shape:
        return False
    # upcast_usable first: it checks the device before anything loads (a CUDA run had built the CPU
    # library inside its first timed step)
    return (q.shape[-1] % 16 == 0 and v.shape[-1] % 16 == 0 and upcast_usable(q, k, v) and softmax_f32_ready()
            and not (window and _build_flag("tn_rows_avx512")))  # (the build's AVX-512 probe)


class NativeSoftmaxAttn(torch.autograd.Function):
    """q, k [B, T, H, D], v [B, T, H, E] of one dtype (bf16: the bf16 kernel, fp32: the AVX-512 or AVX2 one) with
    token rows readable in place (:func:`token_rows_ok`).
    Saves q, k, v, o and the per-query stats [B, H, 2, T] (fp32: the raw score max and log2 of the
    sum of exponentials) for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, window: int):
        B, T, H, D = q.shape
        E = v.shape[-1]
        o = torch.empty(B, T, H, E, dtype=q.dtype)
        stats = torch.empty(B, H, 2, T, dtype=torch.float32)
        _call("tn_softmax_fwd", q.dtype, _ptr(q), _ptr(k), _ptr(v), *map(token_row_stride, (q, k, v)), _ptr(o),
              _ptr(stats), B, T, H, D, E, window, int(causal), scale)
        ctx.save_for_backward(q, k, v, o, stats)
        ctx.args = (window, int(causal), scale)
        return o

    @staticmethod
    @first_order_only
    def backward(ctx, do):
        q, k, v, o, stats = ctx.saved_tensors
        B, T, H, D = q.shape
        E = v.shape[-1]
        do = do.contiguous()
        dq, dk, dv = torch.empty(B, T, H, D, dtype=q.dtype), torch.empty(B, T, H, D, dtype=q.dtype), torch.empty_like(o)
        _call("tn_softmax_bwd", q.dtype, _ptr(q), _ptr(k), _ptr(v), *map(token_row_stride, (q, k, v)), _ptr(o), _ptr(do),
              _ptr(stats), _ptr(dq), _ptr(dk), _ptr(dv), B, T, H, D, E, *ctx.args)
        return dq, dk, dv, None, None, None


def autocast_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as CPU autocast feeds its lower-precision ops (SDPA, matmul): CPU fp32 tensors
    cast to the autocast dtype while CPU autocast is on, so that a kernel called instead of such an
    op sees (and returns) the same dtype; unchanged otherwise."""
    if not torch.is_autocast_enabled("cpu"):
        return xs
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(x.to(dtype) if x.device.type == "cpu" and x.dtype == torch.float32 else x for x in xs)


_LOG2E_F32 = ctypes.c_float(math.log2(math.e)).value  # the kernels' kLog2e


def _kernel_scale_ok(x: float) -> bool:
    """Whether the softmax kernels can take x as their scale: a finite number whose fp32 rounding is
    finite and > 0 (a ctypes float argument: 3.5e38 rounds to inf there), and whose fp32 product
    with log2(e), the kernels' exponent factor, is finite too (above ~2.36e38 it is inf, and
    every exponent (s - m) scale log2(e) with s = m was 0·inf, NaN)."""
    if not math.isfinite(x):
        return False
    v = ctypes.c_float(x).value
    # (two fp32 values multiply exactly in a double: rounding it to fp32 is the kernels' product)
    return math.isfinite(v) and v > 0 and math.isfinite(ctypes.c_float(v * _LOG2E_F32).value)


def fused_softmax_attn(q, k, v, *, causal: bool, scale: float, window: int = 0) -> torch.Tensor | None:
    """o from a fused softmax-attention kernel, or None where none takes these inputs (the caller's
    PyTorch form runs then). Inputs are cast as CPU autocast would first (:func:`autocast_inputs`);
    scale must be > 0 (the kernels keep the running max of the unscaled scores) and an fp32 above
    0 (the kernels take it as one: 1e-46 had reached them as 0 and failed), at most ~2.36e38
    (:func:`_kernel_scale_ok`)."""
    if _mode == "torch" or torch.compiler.is_compiling() or not _kernel_scale_ok(scale):
        # (before anything that loads the library: its lock breaks a fullgraph torch.compile trace)
        return None
    q, k, v = autocast_inputs(q, k, v)
    if softmax_usable(q, k, v, window):
        return _softmax_walk(q, k, v, causal=causal, scale=scale, window=window)
    if not softmax_upcast_usable(q, k, v, window):
        return None
    # bf16 on a CPU without a bf16 kernel: the fp32 kernel on fp32 copies, 1.7-3.5x the SDPA bf16
    # fallback (vanilla shapes, fwd+bwd, docs/benchmarks.md); fp32 math, the output rounds once to
    # bf16. Blocks the fp32 kernel cannot tile stay with the caller's bf16 form.
    q32, k32, v32 = q.float(), k.float(), v.float()
    if not softmax_usable(q32, k32, v32, window):
        return None
    return _softmax_walk(q32, k32, v32, causal=causal, scale=scale, window=window).to(q.dtype)


def _softmax_walk(q, k, v, *, causal: bool, scale: float, window: int) -> torch.Tensor:
    """o from the kernel that takes q, k, v as they are (:func:`softmax_usable`), whole blocks as
    sequences of their own."""
    B, T = q.shape[:2]
    if window and T % window == 0:
        # Whole blocks: each block a sequence of its own ([B·T/w, w, H, D], views of the same
        # rows), so the kernel packs one block at a time. The windowed walk packs a whole head
        # first, which at 16k tokens outgrows L2: 39 against 21 ms (T = 512) for the same 16k
        # tokens, bf16 fwd+bwd. Blocks that are not whole tiles (softmax_usable's window rule)
        # stay with the caller's form: padded to a tile each, blocks of 4-16 ran 2-7x slower.
        o = native_softmax_attn(*(x.reshape(B * (T // window), window, *x.shape[2:]) for x in (q, k, v)),
                                causal=causal, scale=scale)
        return o.reshape(B, T, *o.shape[2:])
    return native_softmax_attn(q, k, v, causal=causal, scale=scale, window=window)


def native_softmax_attn(q, k, v, *, causal: bool, scale: float, window: int = 0) -> torch.Tensor:
    """softmax(scale q kᵀ + mask) v: o [B, T, H, E] from a fused kernel (check :func:`softmax_usable`).

    Query i sees all keys (``window`` 0) or those of its block of ``window`` tokens, and only
    keys j <= i when ``causal``."""
    if not _kernel_scale_ok(float(scale)):
        raise ValueError("scale must be finite and > 0 in fp32, and so must scale * log2(e) (the kernels' exponent "
                         f"factor), got {scale!r}")
    q, k, v = (x if token_rows_ok(x) else x.contiguous() for x in (q, k, v))
    return NativeSoftmaxAttn.apply(q, k, v, causal, float(scale), window)


# ------------------------------------------------------------------------------------------------
# Row kernels (fp32 or bf16 storage, fp32 arithmetic): LM loss rows, LRPE, SRMSNorm, SiLU gate
# ------------------------------------------------------------------------------------------------
# Row-kernel families that run slower than their PyTorch forms on some builds, by dtype: the build
# flag each needs in "auto". The row kernels' portable loops vectorize without AVX-512 (AVX2:
# -fno-trapping-math, no branch in a loop) and beat PyTorch (benchmarks/fused_rows.py on an AVX2
# EPYC, fp32: SiLU gate 2.55x, split SiLU 1.15x, LRPE 2.44x). FLASH's fused mixer also writes
# d(pre)ᵀ for its weight gradient: column by column, before the AVX2 transposes, one flash-lm layer
# fwd+bwd at 4k fp32 on that EPYC took ~565 ms fused against ~526 ms composed; with them the two
# are level (fused / composed 0.97-1.04 over five alternating runs, benchmarks/flash_mixer.py), and
# the fused form keeps 11% less for the backward (125 against 141 MB a layer at 4k): fused there
# (docs/benchmarks.md, twenty-fifth round). Its bf16 copies are still a column loop without AVX-512
# (and bf16 products are slow on such CPUs): composed there. "native" still runs the kernels.
_NEEDS_BUILD_FLAG = {"flash_mixer": {torch.float32: "tn_rows_avx2", torch.bfloat16: "tn_rows_avx512"}}


def rows_usable(dtype: torch.dtype, device: torch.device, family: str | None = None) -> bool:
    """Whether the row kernels run for tensors of this dtype and device (CPU fp32/bf16, the library
    built, backend mode not "torch", not being traced by torch.compile). ``family``
    ("flash_mixer"): also not a kernel that this build runs slower than its PyTorch form, in "auto"
    mode (``_NEEDS_BUILD_FLAG``)."""
    ok = (_mode != "torch" and not torch.compiler.is_compiling() and device.type == "cpu"
          and dtype in (torch.float32, torch.bfloat16) and load() is not None)
    flag = _NEEDS_BUILD_FLAG.get(family, {}).get(dtype)
    if ok and _mode == "auto" and flag:
        return _build_flag(flag)
    return ok




def xent_rows(x: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, *, write_grad: bool):
    """Per-row log-sum-exp and loss term of ``x`` [n, V]; optionally ``x`` := the loss gradient.

    ``labels`` [n] integers in [0, V) (clamp ignored rows' labels first), ``valid`` [n] bool
    (False rows get a zero gradient row). Returns ``(lse, loss)``, both fp32 [n], ``loss`` =
    (max − target logit) + log Σ exp(x − max), not lse − target (an fp32 lse loses the loss's
    low digits once logits are large). With
    ``write_grad`` the block is overwritten in place with ``valid * (softmax(x) - onehot(labels))``
    in its own dtype, the arithmetic in fp32 (``_native_xent.cpp``).
    """
    n, V = x.shape
    if x.stride(1) != 1:
        raise ValueError("xent_rows: x must have contiguous rows")
    labels = labels.to(torch.int64).contiguous()
    valid = valid.to(torch.uint8).contiguous()
    lse = torch.empty(n, dtype=torch.float32)
    loss = torch.empty(n, dtype=torch.float32)
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= V):
        raise ValueError(f"xent_rows: labels must lie in [0, {V})")
    _call("tn_xent_rows", x.dtype, _ptr(x), n, V, x.stride(0), _ptr(labels), _ptr(valid), _ptr(lse), _ptr(loss),
          int(write_grad))
    return lse, loss


def transpose_acc(src: torch.Tensor, dst: torch.Tensor, *, accumulate: bool) -> None:
    """dst (fp32 [C, R], contiguous) = or += srcᵀ for contiguous bf16 src [R, C] (``_native_xent.cpp``)."""
    R, C = src.shape
    if src.dtype != torch.bfloat16 or dst.dtype != torch.float32 or dst.shape != (C, R) or not (
            src.is_contiguous() and dst.is_contiguous()):
        raise ValueError(f"transpose_acc needs contiguous bf16 src [R, C] and fp32 dst [C, R], got {src.dtype} "
                         f"{tuple(src.shape)} and {dst.dtype} {tuple(dst.shape)}")
    _call("tn_transpose_acc", src.dtype, _ptr(src), R, C, _ptr(dst), int(accumulate))


LRPE_KERNELS = {"identity": 0, "elu": 1, "1+elu": 2, "relu": 3}


def token_rows_ok(x: torch.Tensor) -> bool:
    """Whether the kernels can read x [B, T, ...] in place with one row stride: each token's trailing
    dims one contiguous row, rows at one stride (q, k views of a fused qkv; a projection's slice)."""
    B, T, *inner = x.shape
    width, want = 1, []
    for n in reversed(inner):
        want.append(width)
        width *= n
    return (list(x.stride()[2:]) == want[::-1] and x.stride(1) >= width
            and (B == 1 or x.stride(0) == T * x.stride(1)))


def token_row_stride(x: torch.Tensor) -> int:
    """The stride ld the kernels read x [B, T, ...] with, token row r = b·T + t at r·ld, for x that
    :func:`token_rows_ok` accepts or that is contiguous. PyTorch leaves a length-1 dim's stride
    arbitrary even in a contiguous tensor ([B, H, 1, D].transpose(1, 2) has stride(1) = D), so at
    T = 1 the rows are batch rows: the batch stride, or a row's width when there is one row."""
    B, T = x.shape[0], x.shape[1]
    if T > 1:
        return x.stride(1)
    return x.stride(0) if B > 1 else math.prod(x.shape[2:])


def lrpe_fwd(x, cos, sin, u, scale: float, kernel: str):
    """y [B, T, H, D] (x's dtype, contiguous) from x (see :func:`token_rows_ok`), fp32 cos/sin [B, T, D/2],
    fp32 u [D] or None."""
    B, T, H, D = x.shape
    y = torch.empty(B, T, H, D, dtype=x.dtype)
    _call("tn_lrpe_fwd", x.dtype, _ptr(x), _ptr(y), _ptr(cos), _ptr(sin), _ptr(u), scale, LRPE_KERNELS[kernel],
          B * T, H, D, token_row_stride(x))
    return y


def lrpe_bwd(x, dy, cos, sin, u, scale: float, kernel: str):
    """(dx [B, T, H, D], dcos, dsin [B, T, D/2] fp32) for :func:`lrpe_fwd`'s inputs and contiguous dy."""
    B, T, H, D = x.shape
    dx = torch.empty(B, T, H, D, dtype=x.dtype)
    dcos = torch.empty(B, T, D // 2, dtype=torch.float32)
    dsin = torch.empty_like(dcos)
    _call("tn_lrpe_bwd", x.dtype, _ptr(x), _ptr(dy), _ptr(dx), _ptr(dcos), _ptr(dsin), _ptr(cos), _ptr(sin), _ptr(u),
          scale, LRPE_KERNELS[kernel], B * T, H, D, token_row_stride(x))
    return dx, dcos, dsin


def srms_fwd(x: torch.Tensor, eps: float, inside: bool, gain: float = 1.0,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """gain times SimpleRMSNorm of the last dim of contiguous x (``_native_norm.cpp``), in x's
    dtype or bf16 (``out_dtype``, rounded once)."""
    y = torch.empty_like(x, dtype=out_dtype or x.dtype)
    _call("tn_srms_fwd", x.dtype, _ptr(x), _ptr(y), x.numel() // x.shape[-1], x.shape[-1], eps, int(inside), gain,
          int(y.dtype == torch.bfloat16 and x.dtype != torch.bfloat16))
    return y


def srms_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float, inside: bool, gain: float = 1.0,
             gain_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx, d gain) of :func:`srms_fwd` for contiguous dy in x's dtype or bf16; d gain (fp32, 0-d)
    only with ``gain_grad``."""
    N = x.numel() // x.shape[-1]
    dx = torch.empty_like(x)
    rowdot = torch.empty(N, dtype=torch.float32) if gain_grad else None
    _call("tn_srms_bwd", x.dtype, _ptr(x), _ptr(dy), _ptr(dx), N, x.shape[-1], eps, int(inside), gain, _ptr(rowdot),
          int(dy.dtype == torch.bfloat16 and x.dtype != torch.bfloat16))
    return dx, None if rowdot is None else rowdot.sum()


def add_upcast(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x + h for contiguous fp32 x and bf16 h of one shape, in fp32 (``_native_norm.cpp``)."""
    out = torch.empty_like(x)
    _call("tn_add_upcast", x.dtype, _ptr(x), _ptr(h), _ptr(out), x.numel())
    return out


def silu_gate_fwd(ab: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """silu(a + b₁) * (b + b₂) for contiguous ab = [..., 2F] = [a | b] and bias = [b₁ | b₂]
    (contiguous fp32 [2F]) or None (``_native_glu.cpp``)."""
    F = ab.shape[-1] // 2
    h = torch.empty(*ab.shape[:-1], F, dtype=ab.dtype)
    _call("tn_silu_gate_fwd", ab.dtype, _ptr(ab), _ptr(bias), _ptr(h), h.numel() // max(F, 1), F)
    return h


def silu_gate_bwd(ab: torch.Tensor, dh: torch.Tensor, bias: torch.Tensor | None = None, bias_grad: bool = False,
                  dab_t: torch.Tensor | None = None):
    """(d(ab) [..., 2F], d(bias) fp32 [2F] or None) of :func:`silu_gate_fwd` for contiguous dh;
    with ``dab_t`` [2F, N], d(ab)ᵀ is written into it too (the same rounded values)."""
    F = ab.shape[-1] // 2
    N = dh.numel() // max(F, 1)
    dab = torch.empty_like(ab)
    parts = _row_parts(N)
    db = torch.zeros(parts, 2 * F, dtype=torch.float32) if bias_grad else None
    ldt = _transposed_rows(dab_t, 2 * F, N, ab.dtype)
    _call("tn_silu_gate_bwd", ab.dtype, _ptr(ab), _ptr(bias), _ptr(dh), _ptr(dab), _ptr(dab_t), _ptr(db), N, F, ldt,
          parts)
    return dab, None if db is None else db.sum(0)


def _row_block(x: torch.Tensor) -> int:
    """Row stride of x [..., W] whose rows are evenly spaced with unit column stride: contiguous,
    or a column block of a wider contiguous tensor (as the kernels' ld arguments take it)."""
    if x.is_contiguous():
        return x.shape[-1]
    if x.stride(-1) != 1 or any(x.stride(i) != x.stride(i + 1) * x.shape[i + 1] for i in range(x.dim() - 2)):
        raise ValueError(f"rows must be evenly spaced with unit column stride, got strides {x.stride()}")
    return x.stride(-2)


def silu_split_fwd(pre: torch.Tensor, widths: list[int], bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """silu(pre + bias) of pre [..., W] (rows uniformly spaced; bias: contiguous fp32 [W] or None),
    split into contiguous column groups of ``widths``."""
    n = len(widths)
    outs = [torch.empty(*pre.shape[:-1], w, dtype=pre.dtype) for w in widths]
    _call("tn_silu_split_fwd", pre.dtype, _ptr(pre), _ptr(bias), (ctypes.c_void_p * n)(*[o.data_ptr() for o in outs]),
          (ctypes.c_long * n)(*widths), n, pre.numel() // max(pre.shape[-1], 1), _row_block(pre))
    return outs


_ROW_PARTS = 8  # parameter gradients summed over rows in this many fixed row ranges, then added:
# the kernels' results do not depend on the thread count


def _row_parts(rows: int) -> int:
    return max(1, min(_ROW_PARTS, rows))


def _transposed_rows(dpre_t: torch.Tensor | None, W: int, N: int, dtype: torch.dtype) -> int:
    """Row stride of ``dpre_t``, the [W, N] transposed copy of a gradient (rows unit-strided)."""
    if dpre_t is None:
        return N
    if dpre_t.dim() != 2 or dpre_t.shape != (W, N) or dpre_t.stride(1) != 1 or dpre_t.stride(0) < N:
        raise ValueError(f"dpre_t must be [{W}, {N}] with unit-strided rows, got {tuple(dpre_t.shape)} "
                         f"strides {dpre_t.stride()}")
    if dpre_t.dtype != dtype:
        raise TypeError(f"dpre_t must be {dtype} like the gradient it copies, got {dpre_t.dtype}")
    return dpre_t.stride(0)


def silu_split_bwd(pre: torch.Tensor, grads: list[torch.Tensor | None], widths: list[int],
                   bias: torch.Tensor | None = None, bias_grad: bool = False, dpre: torch.Tensor | None = None,
                   dpre_t: torch.Tensor | None = None):
    """(d(pre), d(bias) fp32 [W] or None) from the groups' contiguous gradients (None = zero);
    d(pre) is written into ``dpre`` when given (a [..., W] block with uniformly spaced rows) and,
    when ``dpre_t`` [W, N] is given, also transposed into it (the same rounded values)."""
    n, N = len(widths), pre.numel() // max(pre.shape[-1], 1)
    dpre = torch.empty_like(pre, memory_format=torch.contiguous_format) if dpre is None else dpre
    parts = _row_parts(N)
    db = torch.zeros(parts, pre.shape[-1], dtype=torch.float32) if bias_grad else None
    ldt = _transposed_rows(dpre_t, pre.shape[-1], N, pre.dtype)
    _call("tn_silu_split_bwd", pre.dtype, _ptr(pre), _ptr(bias), (ctypes.c_void_p * n)(*[_ptr(g) for g in grads]),
          (ctypes.c_long * n)(*widths), n, _ptr(dpre), _ptr(dpre_t), _ptr(db), N, _row_block(pre), _row_block(dpre),
          ldt, parts)
    return dpre, None if db is None else db.sum(0)


def silu_mul_fwd(pre: torch.Tensor, bias: torch.Tensor | None, o: torch.Tensor) -> torch.Tensor:
    """silu(pre + bias) * o for pre [..., F] (uniformly spaced rows), contiguous o [..., F], bias
    contiguous fp32 [F] or None (``_native_glu.cpp``)."""
    F = pre.shape[-1]
    y = torch.empty_like(o)
    _call("tn_silu_mul_fwd", pre.dtype, _ptr(pre), _ptr(bias), _ptr(o), _ptr(y), o.numel() // F, F, _row_block(pre))
    return y


def silu_mul_bwd(pre, bias, o, dy, dpre: torch.Tensor, bias_grad: bool, dpre_t: torch.Tensor | None = None):
    """(do, d(bias) fp32 [F] or None) of :func:`silu_mul_fwd` for contiguous dy; d(pre) is written
    into ``dpre`` (a [..., F] block with uniformly spaced rows) and, when ``dpre_t`` [F, N] is
    given, also transposed into it."""
    F = pre.shape[-1]
    N = o.numel() // F
    do = torch.empty_like(o)
    parts = _row_parts(N)
    db = torch.zeros(parts, F, dtype=torch.float32) if bias_grad else None
    ldt = _transposed_rows(dpre_t, F, N, pre.dtype)
    _call("tn_silu_mul_bwd", pre.dtype, _ptr(pre), _ptr(bias), _ptr(o), _ptr(dy), _ptr(do), _ptr(dpre), _ptr(dpre_t),
          _ptr(db), N, F, _row_block(pre), _row_block(dpre), ldt, parts)
    return do, None if db is None else db.sum(0)


def cast_transpose(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w.transpose(-2, -1) contiguous in ``dtype`` (fp32 or bf16; rounded once) from contiguous fp32
    or bf16 w [R, C] or [nb, R, C] (``_native_glu.cpp``)."""
    if w.dim() not in (2, 3) or not w.is_contiguous():
        raise ValueError(f"cast_transpose needs a contiguous [R, C] or [nb, R, C] tensor, got {tuple(w.shape)}")
    *nb, R, C = w.shape
    out = torch.empty(*nb, C, R, dtype=dtype)
    _call("tn_cast_transpose", dtype, _ptr(w), int(w.dtype == torch.bfloat16), _ptr(out), nb[0] if nb else 1, R, C)
    return out


def chunk_prefix(x: torch.Tensor, scales: torch.Tensor, *, reverse: bool) -> torch.Tensor:
    """FLASH's causal chunk prefix of contiguous x [B, G, n] (fp32 or bf16, fp32 sums, one rounding;
    ``_native_prefix.cpp``): y_g = scale_g Σ_{h<g} x_h, or with ``reverse`` its adjoint
    y_h = Σ_{g>h} scale_g x_g. scales: [G]."""
    B, G, n = x.shape
    y = torch.empty_like(x)
    sc = scales.float().contiguous()  # held here: the kernel reads it through a raw pointer
    _call("tn_chunk_prefix", x.dtype, _ptr(x), _ptr(y), _ptr(sc), B, G, n, int(reverse))
    return y


def relu2_fwd(scores: torch.Tensor, bias: torch.Tensor | None, *, causal: bool):
    """(r, a, aᵀ), each [n, C, C] in scores' dtype, of FLASH's local branch from contiguous scores
    [n, C, C]: r = relu(scores + bias) (0 above the diagonal when ``causal``), a = r², aᵀ per
    chunk; bias [C, C] is rounded to the scores' dtype first, as PyTorch's add of bias.to(dtype)
    (``_native_flash.cpp``)."""
    n, C, _ = scores.shape
    b = None if bias is None else bias.to(scores.dtype).float().contiguous()
    r, a, at = (torch.empty_like(scores) for _ in range(3))
    _call("tn_relu2_fwd", scores.dtype, _ptr(scores), _ptr(b), _ptr(r), _ptr(a), _ptr(at), n, C, int(causal))
    return r, a, at


def relu2_bwd_(da: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """da ← 2 r da in place (contiguous, one dtype; rounded as PyTorch's da.mul_(r).mul_(2)): the
    gradient of the scores from that of a = r²."""
    _call("tn_relu2_bwd", da.dtype, _ptr(da), _ptr(r), da.numel())
    return da


def bmm_ready() -> bool:
    """Whether :func:`bmm` is the faster path: a build with the AVX-512 micro-kernel. (It computes on
    every build, on AVX2 vectors or plain loops, but there PyTorch's bmm, MKL's AVX2 code, is the
    path FLASH takes.)"""
    return _build_flag("tn_bmm_ready")


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, accumulate: bool = False) -> torch.Tensor:
    """a @ b for fp32 CPU a [n, M, K] (any strides: a transposed view costs no copy) and b [n, K, N]
    with unit column stride, written to (or with ``accumulate`` added to) ``out`` [n, M, N] with
    unit column stride, a new tensor if None (``_native_bmm.cpp``). Each product sums over k in
    order on one thread. Not differentiable: for Functions that do their own products."""
    n, M, K = a.shape
    N = b.shape[-1]
    if b.shape != (n, K, N) or b.stride(-1) != 1 and N > 1:
        raise ValueError(f"bmm: b must be [{n}, {K}, N] with unit column stride, got {tuple(b.shape)}, "
                         f"strides {b.stride()}")
    if out is None:
        if accumulate:
            raise ValueError("bmm: accumulate=True needs out")
        out = torch.empty(n, M, N, dtype=a.dtype, device=a.device)
    elif out.shape != (n, M, N) or out.stride(-1) != 1 and N > 1:
        raise ValueError(f"bmm: out must be [{n}, {M}, {N}] with unit column stride, got {tuple(out.shape)}, "
                         f"strides {out.stride()}")
    if not (a.dtype == b.dtype == out.dtype):
        raise TypeError(f"bmm: a, b and out must share one dtype, got {a.dtype}, {b.dtype}, {out.dtype}")
    if not (a.device.type == b.device.type == out.device.type == "cpu"):
        raise ValueError(f"bmm: a, b and out must be CPU tensors, got {a.device}, {b.device}, {out.device}")
    _call("tn_bmm", a.dtype, _ptr(a), a.stride(0), a.stride(1), a.stride(2), _ptr(b), b.stride(0), b.stride(1),
          _ptr(out), out.stride(0), out.stride(1), n, M, N, K, int(accumulate))
    return out


def heads_fwd(z, gamma, beta, cos, sin, out_dtype: torch.dtype = torch.float32):
    """RoPE(z * gamma_h + beta_h) [B, T, n, s] in ``out_dtype`` (fp32 or bf16, rounded once) from z
    [B, T, s] (see :func:`token_rows_ok`), fp32 gamma, beta [n, s] and cos, sin [B, T, P]
    contiguous (``_native_heads.cpp``). Stored head-outer (an [n, B, T, s] tensor seen as
    [B, T, n, s]), so that each head ``y[:, :, h]`` is contiguous and reshapes to chunks as a view."""
    B, T, s = z.shape
    n, P = gamma.shape[0], cos.shape[-1]
    y = torch.empty(n, B, T, s, dtype=out_dtype)
    _call("tn_heads_fwd", z.dtype, _ptr(z), _ptr(gamma), _ptr(beta), _ptr(cos), _ptr(sin), _ptr(y), B * T, n, s, P,
          token_row_stride(z), int(out_dtype == torch.bfloat16), B * T)
    return y.permute(1, 2, 0, 3)


def heads_bwd(z, gamma, cos, sin, dy):
    """(dz [B, T, s] in z's dtype, dgamma [n, s], dbeta [n, s]) for fp32 or bf16 dy [B, T, n, s],
    contiguous or head-outer (as :func:`heads_fwd` stores its output)."""
    B, T, s = z.shape
    n, P = gamma.shape[0], cos.shape[-1]
    head_outer = not dy.is_contiguous() and dy.permute(2, 0, 1, 3).is_contiguous()
    if not (head_outer or dy.is_contiguous()):
        raise ValueError(f"dy must be contiguous or head-outer, got strides {dy.stride()}")
    parts = _row_parts(B * T)
    dz = torch.empty(B, T, s, dtype=z.dtype)
    dg = torch.zeros(parts, n, s, dtype=torch.float32)
    db = torch.zeros(parts, n, s, dtype=torch.float32)
    _call("tn_heads_bwd", z.dtype, _ptr(z), _ptr(gamma), _ptr(cos), _ptr(sin), _ptr(dy), _ptr(dz), _ptr(dg), _ptr(db),
          B * T, n, s, P, token_row_stride(z), parts, int(dy.dtype == torch.bfloat16), B * T if head_outer else 0)
    return dz, dg.sum(0), db.sum(0)
