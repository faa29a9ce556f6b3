"""LRPE feature map (spec §3): y = R_m · s(I − 2uuᵀ) · φ(x) per head row, on [B, T, H, D].

φ is the attention kernel (NormAttention's ``1+elu`` / ``elu`` / ``relu`` / ``silu``, or the
identity), u the frozen unit Householder vector (or None: plain rotary), s a scale and R_m the
rotation of the interleaved channel pairs (2i, 2i+1) by the angles of token m. Three forms:

* fused CPU kernel (``_native_lrpe.cpp``) for fp32/bf16: one read and one write of the row per
  direction, fp32 arithmetic; gradients for x and for the cos/sin tables (learnable angles);
* the PyTorch form, everywhere else (GPU, fp64, ``silu``, ``set_kernel_backend("torch")``);
* :func:`lrpe_feature_map_reference`, the formula written out pair by pair (the tests' oracle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native
from ._checks import check_scale, first_order_only


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def one_plus_elu(x: torch.Tensor) -> torch.Tensor:
    return 1.0 + F.elu(x)


# Named functions, not lambdas: a layer keeps its kernel, and a lambda made every T2 and 1+elu
# model impossible to pickle (torch.save(model), spawned workers).
FEATURE_KERNELS = {
    "identity": identity,
    "elu": F.elu,  # T1: may be negative
    "1+elu": one_plus_elu,  # T2
    "relu": F.relu,
    "silu": F.silu,
}


def _check(x, cos, sin, u, kernel, scale):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():  # the output is in x's dtype
        raise TypeError(f"x must be a floating-point torch.Tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"x must be [B, T, H, D] with D even, got {tuple(x.shape)}")
    want = (x.shape[0], x.shape[1], x.shape[-1] // 2)
    for name, t in (("cos", cos), ("sin", sin), ("u", u)):
        if (t is not None or name != "u") and (not isinstance(t, torch.Tensor) or not t.is_floating_point()):
            raise TypeError(f"{name} must be a floating-point torch.Tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[1:] != want[1:] or t.shape[0] not in (1, want[0]):
            raise ValueError(f"{name} must be [B or 1, T, D/2] = [{want[0]}, {want[1]}, {want[2]}], got {tuple(t.shape)}")
    if u is not None and u.shape != (x.shape[-1],):
        raise ValueError(f"u must be [D] = [{x.shape[-1]}], got {tuple(u.shape)}")
    if kernel not in FEATURE_KERNELS:
        raise ValueError(f"kernel must be one of {tuple(FEATURE_KERNELS)}, got {kernel!r}")
    check_scale(scale)


class _FusedLRPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, u, scale: float, kernel: str):
        ctx.save_for_backward(x, cos, sin, u)
        ctx.scale, ctx.kernel = scale, kernel
        return _native.lrpe_fwd(x, cos, sin, u, scale, kernel)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x, cos, sin, u = ctx.saved_tensors
        dx, dcos, dsin = _native.lrpe_bwd(x, dy.to(x.dtype).contiguous(), cos, sin, u, ctx.scale, ctx.kernel)
        return dx, dcos, dsin, None, None, None


def _torch_form(x, cos, sin, u, scale, kernel):
    cos, sin = torch.broadcast_tensors(cos, sin)  # each [B or 1, T, D/2]: [B, ...] beside [1, ...] had failed here
    x = FEATURE_KERNELS[kernel](x)
    e = x.shape[-1]
    cs = torch.stack((torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)), -2)
    if u is None:
        swapped = x.unflatten(-1, (e // 2, 2)).flip(-1).flatten(-2)  # (a, b) -> (b, a)
        y = torch.stack((x, swapped), -2) * scale
    else:
        # R_m P x = (xP)·cos + swap(xP)·sin, and swap(xP) = x(PS) with S the pair swap, so one
        # [e, 2e] matmul gives both terms: 3 full-size passes instead of 5 (matmul, flip, 2 mul, add).
        u = u.to(x.dtype)
        P = (torch.eye(e, dtype=x.dtype, device=x.device) - 2.0 * torch.outer(u, u)) * scale
        swap = torch.arange(e, device=x.device).view(-1, 2).flip(-1).flatten()
        y = (x @ torch.cat((P, P[:, swap]), dim=1)).unflatten(-1, (2, e))  # [B, T, H, 2, e]
    return (y * cs[:, :, None].to(x.dtype)).sum(-2)


def lrpe_feature_map(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, u: torch.Tensor | None = None, *,
                     scale: float = 1.0, kernel: str = "identity") -> torch.Tensor:
    """R_m · scale·(I − 2uuᵀ) · kernel(x) for every head row of x.

    Args:
        x: [B, T, H, D], D even.
        cos, sin: [B or 1, T, D/2] cosines and sines of each token's pair angles (fp32; they may
            require grad, e.g. from learnable frequencies).
        u: [D] unit Householder vector, or None for a plain rotation.
        kernel: "identity", "elu", "1+elu", "relu" or "silu", applied before the reflection.

    Returns [B, T, H, D] in x's dtype.
    """
    _check(x, cos, sin, u, kernel, scale)
    others = (cos, sin) if u is None else (cos, sin, u)
    if (x.numel() and _native.rows_usable(x.dtype, x.device) and kernel in _native.LRPE_KERNELS
            and all(t.device == x.device for t in others) and not (u is not None and u.requires_grad)):
        shape = (x.shape[0], x.shape[1], x.shape[-1] // 2)
        cos, sin = (t.float().expand(shape).contiguous() for t in (cos, sin))
        u = None if u is None else u.float().contiguous()
        x = x if _native.token_rows_ok(x) else x.contiguous()  # q, k views of a fused qkv: read in place
        return _FusedLRPE.apply(x, cos, sin, u, float(scale), kernel)
    return _torch_form(x, cos, sin, u, scale, kernel)


def lrpe_feature_map_reference(x, cos, sin, u=None, *, scale=1.0, kernel="identity"):
    """The map written out: z = scale·(f − 2(f·u)u), f = kernel(x); pairs rotated one by one."""
    _check(x, cos, sin, u, kernel, scale)
    f = FEATURE_KERNELS[kernel](x)
    z = f if u is None else f - 2.0 * (f @ u.to(f.dtype))[..., None] * u.to(f.dtype)
    z = z * scale
    c, s = cos[:, :, None].to(z.dtype), sin[:, :, None].to(z.dtype)
    even, odd = z[..., 0::2], z[..., 1::2]
    return torch.stack((even * c - odd * s, odd * c + even * s), -1).flatten(-2)
