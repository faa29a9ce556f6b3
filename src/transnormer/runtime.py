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

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_done: bool | None = None


def tune_allocator() -> bool:
    """Make glibc keep freed memory for reuse (no ``mmap`` per large tensor, no trimming).

    Opt out with ``TRANSNORMER_MALLOC=default``. Returns whether the setting was applied
    (False on non-glibc systems or when opted out). Idempotent.
    """
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("TRANSNORMER_MALLOC", "").lower() == "default":
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


def call_in_fresh_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a newly spawned process (with :func:`tune_allocator`), so that
    its peak memory and allocator state are its own; returns its result or raises its error.

    The pool is closed and joined before returning: a pool only terminated (``with Pool()``)
    keeps its queue semaphores until the garbage collector frees it, and after a later
    ``model.generate`` in the same process Python's resource tracker reported one as leaked at
    exit. An interrupted call terminates the child instead of waiting for it.
    """
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(1, initializer=tune_allocator)
    try:
        result = pool.apply(fn, args, kwargs)
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()
    return result
