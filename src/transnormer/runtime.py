"""Process-level settings for CPU training and benchmarks (called by the CLI, not on import).

PyTorch has no caching allocator on CPU: every tensor comes from glibc ``malloc``, which serves
large blocks with a fresh ``mmap`` and returns them to the kernel on ``free``. A training step
allocates and frees its activations every time, so every step pays page faults (the kernel
zeroes each 4 KiB page on first touch): measured here, a 32 MB activation costs about as much
to fault in as the linear-attention kernel takes to compute it. Keeping freed memory in the
heap (as jemalloc/tcmalloc-based launchers do) removes that cost; the price is that the
process keeps its peak footprint instead of shrinking between steps.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_done: bool | None = None


def threads_from_env() -> int | None:
    """``TRANSNORMER_THREADS`` as PyTorch's thread count for this process (the CLI applies it to
    every command; ``bench`` also passes it to its measuring processes). None when unset."""
    raw = os.environ.get("TRANSNORMER_THREADS", "").strip()
    if not raw:
        return None
    # (a huge one had failed in torch as "Overflow when unpacking long long")
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) < 2**16:
        raise ValueError(f"TRANSNORMER_THREADS must be a whole number in [1, 65535], got {raw!r}")
    import torch

    torch.set_num_threads(int(raw))
    return int(raw)


def cpu_has_bf16_products() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX, as oneDNN sees
    it). Without either, PyTorch's CPU bf16 matmul runs a slow fallback: 0.3 GFLOP/s for a 2048³
    product on an AVX2 AMD EPYC (Zen 3) that does 168 GFLOP/s in fp32, so bf16 autocast there makes
    a training step hundreds of times slower."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no fast bf16 products either
        return False


def malloc_opted_out() -> bool:
    """``TRANSNORMER_MALLOC=default`` leaves glibc's allocator alone; unset or ``tuned`` tunes it;
    any other value is refused (it had tuned silently)."""
    raw = os.environ.get("TRANSNORMER_MALLOC", "").strip().lower()
    if raw not in ("", "default", "tuned"):
        raise ValueError(f"TRANSNORMER_MALLOC must be 'default' (glibc's own) or 'tuned', got {raw!r}")
    return raw == "default"


def check_env() -> None:
    """Check the library's environment variables before any work: a typo had been found at the
    first forward, after a training run had moved --out's earlier run aside."""
    from .ops import _native
    from .ops.dense import env_leaves_mkl

    threads_from_env()
    malloc_opted_out()
    _native.native_disabled()
    env_leaves_mkl()


def tune_allocator() -> bool:
    """Make glibc keep freed memory for reuse (no ``mmap`` per large tensor, no trimming).

    Opt out with ``TRANSNORMER_MALLOC=default``. Returns whether the setting was applied
    (False on non-glibc systems or when opted out). Idempotent.
    """
    global _done
    if _done is not None:
        return _done
    opted_out = malloc_opted_out()  # (before _done: a bad value raises every time, not once)
    _done = False
    if opted_out:
        return False
    try:  # the process's own symbols: libc is loaded already (find_library would run ldconfig)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no mallopt (musl, macOS): leave the allocator alone
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # With M_MMAP_MAX = 0 the heap serves every block; a trim threshold of -1 never gives its free
    # tail back (a finite one, even 2 GB, is crossed when a step frees its activations at once).
    _done = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1))
    return _done


def build_cpu_kernels() -> bool:
    """Build (or load from the cache) the fused CPU kernels now, rather than in the first call
    that uses them; whether they are available. A training run calls it before its clock starts:
    with an empty cache the build takes 15-20 s, which counted as the first step's time and ate a
    time budget (``make demo``: 20.7 s of t2-lm-tiny's 90 s, while vanilla-lm-tiny, trained second,
    found the library built)."""
    from .ops import _native

    return _native.load() is not None


def _fresh_process_main(conn, fn, args, kwargs, threads: int | None = None) -> None:
    """The child's side of :func:`call_in_fresh_process`: sends (True, result) or (False, error, traceback)."""
    import pickle
    import traceback

    tune_allocator()
    if threads:  # the parent's (TRANSNORMER_THREADS, or its own choice): a spawned child had every core
        import torch

        torch.set_num_threads(threads)
    try:
        msg = (True, fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        msg = (False, e, traceback.format_exc())
    try:  # what the parent could not unpickle had raised there in the child error's place
        pickle.loads(pickle.dumps(msg))
    except Exception as exc:  # noqa: BLE001 - an unpicklable result or error: send its text
        what = "its result" if msg[0] else f"its error ({type(msg[1]).__name__}: {msg[1]})"
        msg = (False, RuntimeError(f"{getattr(fn, '__name__', fn)} could not send back {what}: "
                                   f"{type(exc).__name__}: {exc}"), msg[2] if len(msg) > 2 else "")
    try:
        conn.send(msg)
    finally:
        conn.close()


_INTERRUPT_GRACE_S = 120.0  # how long an interrupted call waits for its child to save and stop


def call_in_fresh_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a newly spawned process (with :func:`tune_allocator`), so that
    its peak memory and allocator state are its own; returns its result or raises its error
    (with the child's traceback as a note).

    One process and a pipe, no pool: a child that dies (killed for memory, a crash in a native
    kernel) raises RuntimeError here, where a ``multiprocessing.Pool`` would start a new worker
    and wait forever; an interrupted call terminates the child. (The pools this replaced also
    left ``make demo`` ending with a resource-tracker warning about a leaked semaphore.)
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    threads = sys.modules["torch"].get_num_threads() if "torch" in sys.modules else None
    proc = ctx.Process(target=_fresh_process_main, args=(send, fn, args, kwargs, threads), daemon=True)
    proc.start()
    send.close()  # the child holds the only writer: EOF on recv means it is gone
    msg = None
    try:
        msg = recv.recv()
    except EOFError:
        pass
    except KeyboardInterrupt:
        # A Ctrl-C reaches the child too (one process group): a training child saves its step and
        # returns (train/loop.py). Terminating it here had been its second signal, and it died
        # without saving. Wait a while for it; a second Ctrl-C here terminates it.
        proc.join(timeout=_INTERRUPT_GRACE_S)
        raise
    finally:
        recv.close()
        if msg is None and proc.is_alive():  # interrupted: do not wait for the child any longer
            proc.terminate()
        proc.join()  # after sending, the child exits at once
    if msg is None:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} died in its fresh process (exit code {proc.exitcode}) "
                           "before returning; a negative code is the signal that killed it (-9: out of memory, "
                           "most likely)")
    if msg[0]:
        return msg[1]
    err = msg[1]
    err.add_note(f"in the fresh process:\n{msg[2]}")
    raise err


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (MiB). Linux's VmHWM belongs to this process
    image alone; ru_maxrss (the fallback elsewhere) also counts the parent a spawned benchmark
    process was forked from before its exec."""
    import resource  # (POSIX only: imported where it is read)

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    # ru_maxrss is in KiB on Linux, in bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)


def reset_peak_rss() -> bool:
    """Start :func:`peak_rss_mb` again from the current resident set (Linux: ``/proc/self/clear_refs``
    "5" resets VmHWM), so that a run in a process that ran another before it (``compare`` under
    torchrun) reports its own peak. False where it cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_mb() -> float | None:
    """Resident set size of this process now (MiB); None where there is no /proc/self/statm."""
    import resource

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except (OSError, IndexError, ValueError):
        return None
