"""Our softmax-attention kernels against PyTorch's SDPA (and the explicit autocast form), fwd+bwd.

    python benchmarks/softmax_attn.py [--lengths 512 2048 8192 16384] [--tokens 16384] [--dtypes fp32 bf16]

Vanilla attention (causal, 8 heads of 64, batch = tokens / T, the vanilla-lm training shapes)
in one run per dtype: ``softmax_attn`` (our kernel: ``_native_softmax_amx.cpp`` in bf16,
``_native_softmax.cpp`` in fp32), PyTorch's ``scaled_dot_product_attention`` (its CPU
flash-attention kernel) and, in bf16 up to 2k, the explicit form under autocast (bf16 products,
fp32 softmax). Then, per dtype, DiagAttention's blocks (64 tokens, causal): ``block_attn`` on the
kernel against its PyTorch form. Prints times, the speed-ups and GFLOP/s (causal forward 2·B·H·T²·D,
fwd+bwd three times that) as a fraction of the 2048³ GEMM of the dtype measured in the same run.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from transnormer.bench import DTYPES, default_dtypes, gemm_gflops, measure
from transnormer.cli import positive_float, positive_int
from transnormer.ops import _native, block_attn, set_kernel_backend
from transnormer.ops.softmax import softmax_attn
from transnormer.runtime import tune_allocator


def explicit(q, k, v):
    """softmax(q kᵀ / √D) v with bf16 products and an fp32 softmax, as autocast runs it."""
    T = q.shape[1]
    s = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = torch.softmax(s.float().masked_fill(~causal, float("-inf")), -1).to(q.dtype)
    return torch.einsum("bhij,bjhe->bihe", p, v)


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def time_fwd_bwd(fn, q, k, v, go, min_time: float) -> float:
    """Median seconds of fn's forward + backward (autograd.grad: no .grad accumulation is timed)."""
    return measure(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), go), repeat=3, min_time=min_time)["median_s"]


def ours(q, k, v):
    return softmax_attn(q, k, v, causal=True)


def blocks(q, k, v):
    return block_attn(q, k, v, block_size=64, causal=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 2048, 8192, 16384])
    ap.add_argument("--tokens", type=positive_int, default=16384, help="tokens per call (batch = tokens / T)")
    ap.add_argument("--min-time", type=positive_float, default=2.0, help="seconds each op is repeated for")
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                    help="default fp32 and bf16, or fp32 alone on a CPU without bf16 products")
    args = ap.parse_args()
    tune_allocator()
    if args.dtypes is None:
        args.dtypes = default_dtypes()
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        probe = torch.zeros(1, 1, 1, 64, dtype=dtype)
        if not (_native.softmax_usable(probe, probe, probe) or _native.softmax_upcast_usable(probe, probe, probe)):
            print(f"{dname}: no softmax kernel on this machine (fp32 needs AVX-512 or AVX2 with FMA; bf16 AMX, "
                  "AVX512-BF16 or the fp32 kernel on copies; all need a C++ compiler)")
            continue
        vanilla_rows(dname, dtype, args)
        if _native.softmax_usable(probe, probe, probe, window=64):  # (bf16 blocks take no fp32 copies)
            blocks_rows(dname, dtype, args)


def vanilla_rows(dname: str, dtype: torch.dtype, args) -> None:
    gemm = gemm_gflops(dtype=dtype)
    print(f"\n{dname}, vanilla attention; GEMM (2048^3): {gemm:.0f} GFLOP/s; {torch.get_num_threads()} threads\n")
    print("| T | batch | ours ms | SDPA ms | explicit ms | SDPA / ours | ours GFLOP/s | of GEMM |")
    print("|---|---|---|---|---|---|---|---|")
    H, D = 8, 64
    for T in args.lengths:
        B = max(1, args.tokens // T)
        q, k, v, go = (torch.randn(B, T, H, D, dtype=dtype).requires_grad_() for _ in range(4))
        time = {}
        for name, fn in (("ours", ours), ("sdpa", sdpa), ("explicit", explicit)):
            if name == "explicit" and (T > 2048 or dtype != torch.bfloat16):
                continue  # [B, H, T, T] scores and their gradients: several GB from 8k on
            time[name] = time_fwd_bwd(fn, q, k, v, go, args.min_time)
        flops = 3 * 2 * B * H * T * T * D
        ex = f"{time['explicit'] * 1e3:.1f}" if "explicit" in time else "-"
        print(f"| {T} | {B} | {time['ours'] * 1e3:.1f} | {time['sdpa'] * 1e3:.1f} | {ex} | "
              f"{time['sdpa'] / time['ours']:.2f}x | {flops / time['ours'] / 1e9:.0f} | "
              f"{flops / time['ours'] / 1e9 / gemm:.0%} |", flush=True)


def blocks_rows(dname: str, dtype: torch.dtype, args) -> None:
    H, D = 8, 64
    print(f"\n{dname}, DiagAttention blocks (64 tokens, causal), block_attn fwd+bwd:\n")
    print("| T | batch | kernel ms | PyTorch form ms | speed-up |")
    print("|---|---|---|---|---|")
    for T in args.lengths:
        B = max(1, args.tokens // T)
        q, k, v, go = (torch.randn(B, T, H, D, dtype=dtype).requires_grad_() for _ in range(4))
        time = {}
        for backend in ("auto", "torch"):
            set_kernel_backend(backend)
            time[backend] = time_fwd_bwd(blocks, q, k, v, go, args.min_time / 2)
        set_kernel_backend("auto")
        print(f"| {T} | {B} | {time['auto'] * 1e3:.1f} | {time['torch'] * 1e3:.1f} | "
              f"{time['torch'] / time['auto']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
