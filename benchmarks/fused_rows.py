"""Fused CPU row kernels against their PyTorch forms, forward + backward, at t2-lm / flash-lm shapes.

    python benchmarks/fused_rows.py [--tokens 4096] [--dtypes fp32 bf16] [--repeat 5]

Each row times one op both ways in the same run (``set_kernel_backend("torch")`` vs the fused
kernel) and prints the ratio torch / fused. Shapes: one 4k-token sequence, d = 512, H = 8,
e = 64 (t2-lm), GLU hidden 1365, FLASH e = 1024, s = 128, four heads, LM head 32k x 512.
"""

from __future__ import annotations

import argparse

import torch

from transnormer.bench import DTYPES, measure
from transnormer.cli import positive_int
from transnormer.modules.lm_loss import linear_cross_entropy
from transnormer.ops import _native, set_kernel_backend
from transnormer.ops.lrpe import lrpe_feature_map
from transnormer.ops.rowwise import scale_offset_rope, silu_gate, silu_split, simple_rms_norm
from transnormer.runtime import tune_allocator


def cases(N: int, dtype: torch.dtype):
    """(name, shape note, fn) with fn running forward + backward once."""
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(dtype).requires_grad_()

    x = leaf(1, N, 8, 64)
    ang = torch.arange(N, dtype=torch.float32)[None, :, None] * torch.rand(32)
    cos, sin = ang.cos(), ang.sin()
    u = torch.nn.functional.normalize(torch.randn(64), dim=0)
    h = leaf(1, N, 512)
    ab = leaf(1, N, 2 * 1365)
    pre = leaf(1, N, 2 * 1024 + 128)
    z = leaf(1, N, 128)
    gamma, beta = torch.randn(4, 128, requires_grad=True), torch.randn(4, 128, requires_grad=True)
    ang2 = torch.arange(N, dtype=torch.float32)[None, :, None] * torch.rand(64)
    hid = leaf(N, 512)
    w = (torch.randn(32768, 512) * 0.02).requires_grad_()
    labels = torch.randint(0, 32768, (N,))

    def back(out, *inputs):  # autograd.grad: no .grad accumulation is timed
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.grad(out, inputs, [torch.ones_like(o) for o in out])

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            back(linear_cross_entropy(hid, w, labels), hid, w)

    n = f"{N // 1024}k" if N % 1024 == 0 else str(N)  # the token count as the shape notes show it
    return [
        ("LRPE + 1+elu (q or k)", f"[1, {n}, 8, 64]", lambda: back(lrpe_feature_map(x, cos, sin, u, kernel="1+elu"), x)),
        ("SimpleRMSNorm", f"[1, {n}, 512]", lambda: back(simple_rms_norm(h, 1e-8), h)),
        ("GLU SiLU gate", f"[1, {n}, 2x1365]", lambda: back(silu_gate(ab), ab)),
        ("GAU/FLASH split SiLU", f"[1, {n}, 2x1024+128]", lambda: back(silu_split(pre, [1024, 1024, 128]), pre)),
        ("GAU/FLASH heads (scale, offset, RoPE)", f"[1, {n}, 128] -> 4 heads",
         lambda: back(scale_offset_rope(z, gamma, beta, ang2.cos(), ang2.sin()), z, gamma, beta)),
        ("LM head + cross-entropy", f"{n} x 512 -> 32k", loss),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=positive_int, default=4096)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    ap.add_argument("--repeat", type=positive_int, default=5)
    args = ap.parse_args()
    tune_allocator()  # as the CLI does (transnormer/runtime.py)
    if _native.load() is None:
        raise SystemExit(f"the fused CPU kernels are unavailable: {_native._error}")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.tokens} tokens, fwd+bwd, "
          f"median of {args.repeat}")
    print("| op | shape | dtype | PyTorch form (ms) | fused (ms) | PyTorch / fused |")
    print("|---|---|---|---|---|---|")
    before = _native.backend()
    try:
        for dname in args.dtypes:
            for name, shape, fn in cases(args.tokens, DTYPES[dname]):
                t = {}
                for mode in ("torch", "native"):
                    set_kernel_backend(mode)
                    t[mode] = measure(fn, warmup=2, repeat=args.repeat)["median_s"]
                print(f"| {name} | {shape} | {dname} | {t['torch'] * 1e3:.1f} | {t['native'] * 1e3:.1f} | "
                      f"{t['torch'] / t['native']:.2f}x |", flush=True)
    finally:
        set_kernel_backend(before)


if __name__ == "__main__":
    main()
