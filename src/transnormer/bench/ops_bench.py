"""Op-level throughput: norm_linear_attn forward+backward as a fraction of the machine's GEMM rate.

FLOPs counted are the algorithm's (forward + a backward of twice the forward, the usual 3x
convention); the recomputation our backward does is not counted. Per head, forward:
    causal chunked (chunk c): 2T·(c·D + c·E) intra-chunk + 2·2T·D·E states and queries
    bidirectional:            2·2T·D·E  (Kᵀ V, then Q S)
The intra-chunk term is the chunked algorithm's full c×c products, as written. The fused CPU
kernel skips the zero upper triangle of the score tiles, so it also reports "useful" FLOPs,
with the intra-chunk term halved: that rate is the one to compare with the GEMM peak when
asking how busy the machine is.
The reference GEMM rates are measured in the same run: a large square matmul (the peak,
``timing.gemm_gflops``) and the op's own dominant product (``same_shape_gemm_gflops``). The backward is taken with ``autograd.grad``
on q, k, v, so no leaf-gradient accumulation (an extra pass that is not the op's) is timed.
"""

from __future__ import annotations

import torch

from ..ops import _native, dense, norm_linear_attn
from .timing import measure


def norm_attn_flops(T: int, D: int, E: int, *, causal: bool, chunk: int, batch_heads: int,
                    useful: bool = False) -> float:
    """FLOPs of ``norm_linear_attn``'s forward + backward (3x the forward) over ``batch_heads`` heads:
    per token the state products (k^T v, q S: 4 D E), and causal, per chunk of L rows the L x L
    score and output products (2 L^2 (D + E); ``useful``: their lower half, which the kernels run).
    A last chunk of T mod c rows counts its own L (it had been counted as c wide)."""
    c = min(chunk, T)
    squares = (T // c) * c * c + (T % c) ** 2  # sum of L^2 over the chunks
    intra = 2 * squares * (D + E) // (2 if useful else 1)
    fwd = 4 * T * D * E + (intra if causal else 0)
    return 3.0 * fwd * batch_heads


def same_shape_gemm_gflops(T: int, *, causal: bool, dtype: torch.dtype, B: int = 1, H: int = 8, D: int = 64,
                           chunk: int = 64, repeat: int = 5, min_time: float = 1.0) -> float:
    """GFLOP/s of the op's own dominant product, batched as the op batches it, at this T.

    causal: the chunk products [B·H·G, c, D] x [B·H·G, D, c]; bidirectional: Q S per head,
    [B·H, T, D] x [B·H, D, D]. This is the issue's "matmul of the same dtype and similar shape".
    A limit, as ``timing.gemm_gflops``: the fastest product, and in fp32 on CPU the faster of
    ``torch.bmm`` (MKL, which takes its AVX2 path on AMD CPUs) and the library's own batched GEMM
    (``ops.dense.bmm``, where it runs).
    """
    if causal:
        c = min(chunk, T)
        n = B * H * -(-T // c)
        x, y = torch.randn(n, c, D, dtype=dtype), torch.randn(n, D, c, dtype=dtype)
        flops = 2 * n * c * D * c
    else:
        x, y = torch.randn(B * H, T, D, dtype=dtype), torch.randn(B * H, D, D, dtype=dtype)
        flops = 2 * B * H * T * D * D
    t = measure(lambda: torch.bmm(x, y), warmup=2, repeat=repeat, min_time=min_time)["min_s"]
    if dense.native_bmm_for(dtype, x.device):
        t = min(t, measure(lambda: dense.bmm(x, y), warmup=2, repeat=repeat, min_time=min_time)["min_s"])
    return flops / t / 1e9


def op_throughput(T: int, *, causal: bool, dtype: torch.dtype = torch.float32, B: int = 1, H: int = 8, D: int = 64,
                  chunk: int = 64, repeat: int = 5, min_time: float = 1.0) -> dict:
    q, k, v = (torch.randn(B, T, H, D, dtype=dtype).mul_(0.1).requires_grad_() for _ in range(3))

    do = torch.randn(B, T, H, D, dtype=dtype)

    def run():
        o, _ = norm_linear_attn(q, k, v, causal=causal, chunk_size=chunk)
        torch.autograd.grad(o, (q, k, v), do)

    t = measure(run, warmup=1, repeat=repeat, min_time=min_time)["median_s"]  # ms-scale: many repeats are cheap
    flops = norm_attn_flops(T, D, D, causal=causal, chunk=chunk, batch_heads=B * H)
    useful = norm_attn_flops(T, D, D, causal=causal, chunk=chunk, batch_heads=B * H, useful=True)
    if causal and _native.upcast_usable(q, k, v):
        backend = "native-fp32"  # bf16 without a bf16 kernel: the fp32 kernel on fp32 copies (ops/norm_linear.py)
    else:
        fused = ((_native.bf16_usable(q, k, v, chunk) or _native.usable(q, k, v)) if causal
                 else _native.bidir_usable(q, k, v))
        backend = "native" if fused else "torch"
    engine = _native.bf16_engine() if backend == "native" and dtype == torch.bfloat16 else None  # amx / avx512-bf16
    return {"T": T, "causal": causal, "dtype": str(dtype).replace("torch.", ""), "seconds": t, "backend": backend,
            "engine": engine,
            "gflops": flops / t / 1e9, "useful_gflops": useful / t / 1e9}
