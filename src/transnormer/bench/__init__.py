"""Speed/memory harness shared by ``benchmarks/`` and ``transnormer bench``."""

from .timing import DTYPES, default_dtypes, gemm_gflops, measure, peak_rss_mb, rss_mb

__all__ = ["DTYPES", "default_dtypes", "gemm_gflops", "measure", "peak_rss_mb", "rss_mb"]
