"""Speed/memory harness shared by ``benchmarks/`` and ``transnormer bench``."""

from .timing import gemm_gflops, measure, peak_rss_mb

__all__ = ["gemm_gflops", "measure", "peak_rss_mb"]
