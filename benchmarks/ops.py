"""Causal norm_linear_attn (chunked, linear in T) vs softmax SDPA (is_causal=True), fwd+bwd.

    python benchmarks/ops.py [--lengths 1024 4096 16384] [--dtypes fp32 bf16]

B=1, H=8, D=64. Prints times and the ratio SDPA / ours; the ratio should grow about linearly
with T, with at least 8x at T = 16k (the issue's target).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from transnormer.bench import DTYPES, default_dtypes, measure
from transnormer.cli import positive_int
from transnormer.ops import norm_linear_attn
from transnormer.runtime import tune_allocator


def fwd_bwd_ours(q, k, v, chunk):
    o, _ = norm_linear_attn(q, k, v, causal=True, chunk_size=chunk)
    o.sum().backward()


def fwd_bwd_sdpa(q, k, v):
    # SDPA wants [B, H, T, D]
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    o.sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                    help="default fp32 bf16, or fp32 alone on a CPU without bf16 products (AVX512-BF16 or AMX), "
                         "where PyTorch's bf16 matmul is a slow fallback")
    ap.add_argument("--chunk", type=positive_int, default=64)
    ap.add_argument("--repeat", type=positive_int, default=3)
    args = ap.parse_args()
    if args.dtypes is None:
        args.dtypes = default_dtypes()
    tune_allocator()  # as the CLI does: no page faults per step (transnormer/runtime.py)
    B, H, D = 1, 8, 64
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, B={B} H={H} D={D} chunk={args.chunk}")
    print("| dtype | T | ours fwd+bwd (ms) | SDPA causal fwd+bwd (ms) | SDPA/ours |")
    print("|---|---|---|---|---|")
    results = {}
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        for T in args.lengths:
            q, k, v = (torch.randn(B, T, H, D, dtype=dtype, requires_grad=True) for _ in range(3))
            with torch.no_grad():
                q.mul_(0.1), k.mul_(0.1)
            ours = measure(lambda q=q, k=k, v=v: fwd_bwd_ours(q, k, v, args.chunk), repeat=args.repeat)["median_s"]
            sdpa = measure(lambda q=q, k=k, v=v: fwd_bwd_sdpa(q, k, v), repeat=args.repeat)["median_s"]
            results[(dname, T)] = sdpa / ours
            print(f"| {dname} | {T} | {ours * 1e3:.1f} | {sdpa * 1e3:.1f} | {sdpa / ours:.2f}x |", flush=True)
    for dname in args.dtypes:
        longest = max(args.lengths)
        if longest >= 16384:
            r = results[(dname, longest)]
            print(f"{dname}: ratio at T={longest} is {r:.1f}x (target >= 8x): {'PASS' if r >= 8 else 'FAIL'}")


if __name__ == "__main__":
    main()
