"""Speed/memory harness shared by ``benchmarks/`` and ``transnormer bench``."""

from .timing import default_dtypes, gemm_gflops, measure, peak_rss_mb

__all__ = ["default_dtypes", "gemm_gflops", "measure", "peak_rss_mb"]
