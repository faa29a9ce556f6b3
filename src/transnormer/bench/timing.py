"""Timing helpers: median wall time over repeats, GEMM throughput, peak memory.

This machine is shared and noisy, so benchmarks compare ratios measured in one run, and take
the median of several repeats after a warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ..ops import dense
from ..runtime import cpu_has_bf16_products, peak_rss_mb, rss_mb  # noqa: F401 (the harness's names)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the benchmarks' --dtypes by name


def default_dtypes() -> list[str]:
    """The dtypes a benchmark measures unless told: fp32 and bf16, or fp32 alone (saying so) on a CPU
    without bf16 products (AVX512-BF16 or AMX), where PyTorch's bf16 matmul is a slow fallback."""
    if cpu_has_bf16_products():
        return ["fp32", "bf16"]
    print("this CPU has no bf16 products (AVX512-BF16 or AMX): measuring fp32 only (--dtypes bf16 to insist)")
    return ["fp32"]

def measure(fn: Callable[[], object], *, warmup: int = 1, repeat: int = 3, min_time: float = 0.0) -> dict:
    """Run ``fn`` ``warmup`` times, then at least ``repeat`` times (and ``min_time`` seconds).

    Returns {"median_s", "min_s", "iqr_s", "n"}.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an int >= 1, got {repeat!r}")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < repeat or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return {"median_s": statistics.median(times), "min_s": min(times), "iqr_s": q[2] - q[0], "n": len(times)}


def gemm_gflops(n: int = 2048, dtype: torch.dtype = torch.float32, repeat: int = 5, device: str = "cpu",
                min_time: float = 1.0) -> float:
    """Measured matmul throughput (GFLOP/s) of an n×n×n product in ``dtype`` on ``device``: the
    machine's limit (on the device the steps it is compared with run on).

    The rate of the fastest of at least ``repeat`` products over at least ``min_time`` seconds:
    a limit, so a slow spell of the shared machine must not lower it. With the median of five,
    one run of ``bench ops`` read bf16 at 642 GFLOP/s where runs around it read 850-905, and
    the bidirectional bf16 op's fraction of it read 92-98% instead of 66-70%.

    In fp32 on CPU this is the faster of PyTorch's matmul (MKL) and oneDNN's inner product, which
    the library's linear layers use where it is faster (ops/dense.py): on the AMD CPU of
    docs/benchmarks.md (thirteenth and fourteenth rounds) MKL takes its AVX2 path at 195-215
    GFLOP/s and oneDNN runs 449-478, so MKL alone would understate the limit by half.
    """
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else (lambda: None)

    def product():
        a @ b
        sync()

    t = measure(product, warmup=2, repeat=repeat, min_time=min_time)["min_s"]
    if dtype == torch.float32 and a.device.type == "cpu" and dense.onednn_available() and torch.backends.mkldnn.enabled:
        # a bᵀ: same FLOPs
        t = min(t, measure(lambda: dense.inner(a, b), warmup=2, repeat=repeat, min_time=min_time)["min_s"])
    return 2 * n**3 / t / 1e9


