"""Row-wise ops of a block: SimpleRMSNorm and the GLU's SiLU gate.

Each has a fused CPU kernel for fp32/bf16 (``_native_norm.cpp``, ``_native_glu.cpp``: one read
and one write per direction, fp32 arithmetic) and a PyTorch form (GPU, fp64, no compiler,
``set_kernel_backend("torch")``), which is also the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import _native


def simple_rms_norm_reference(x: torch.Tensor, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """x / (‖x‖·D^{-1/2} + ε) (outside), or x / √(mean(x²) + ε) (inside); fp32 math for half x."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if eps_inside_sqrt:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = xf / (xf.norm(dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + eps)
    return y.to(x.dtype)


class _FusedSRMS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps: float, inside: bool):
        ctx.save_for_backward(x)
        ctx.eps, ctx.inside = eps, inside
        return _native.srms_fwd(x, eps, inside)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _native.srms_bwd(x, dy.to(x.dtype).contiguous(), ctx.eps, ctx.inside), None, None


def simple_rms_norm(x: torch.Tensor, eps: float, eps_inside_sqrt: bool = False) -> torch.Tensor:
    """SimpleRMSNorm over the last dim of x [..., D] (spec §5); output in x's dtype."""
    if x.numel() and _native.rows_usable(x.dtype, x.device):
        return _FusedSRMS.apply(x.contiguous(), float(eps), bool(eps_inside_sqrt))
    return simple_rms_norm_reference(x, eps, eps_inside_sqrt)


def silu_gate_reference(ab: torch.Tensor) -> torch.Tensor:
    """silu(a) * b for ab = [..., 2F] = [a | b]."""
    a, b = ab.chunk(2, dim=-1)
    return F.silu(a) * b


class _FusedSiluGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ab):
        ctx.save_for_backward(ab)
        return _native.silu_gate_fwd(ab)

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):
        (ab,) = ctx.saved_tensors
        return _native.silu_gate_bwd(ab, dh.to(ab.dtype).contiguous())


def silu_gate(ab: torch.Tensor) -> torch.Tensor:
    """The GLU gate silu(a) * b of ab [..., 2F] = [a | b] (the two input projections side by side)."""
    if ab.shape[-1] % 2:
        raise ValueError(f"ab must have an even last dim [a | b], got {tuple(ab.shape)}")
    if ab.numel() and _native.rows_usable(ab.dtype, ab.device):
        return _FusedSiluGate.apply(ab.contiguous())
    return silu_gate_reference(ab)
