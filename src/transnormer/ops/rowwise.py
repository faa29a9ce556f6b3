"""Row-wise ops of a block: SimpleRMSNorm and ScaleNorm, the residual add of a bf16 branch, the
GLU's SiLU gate, and GAU/FLASH's split SiLU and query-key heads.

Each has a fused CPU kernel for fp32/bf16 (``_native_norm.cpp``, ``_native_glu.cpp``,
``_native_heads.cpp``: one read and one write per direction, fp32 arithmetic) and a PyTorch form (GPU, fp64, no compiler,
``set_kernel_backend("torch")``), which is also the tests' oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native
from ._checks import first_order_only
from ._dtypes import autocast_enabled, autocast_off
from ._projection import fused_projection_ok, project, project_backward, projection_dtype
from .dense import linear
from .norm_linear import state_dtype_for


def simple_rms_norm_reference(x: torch.Tensor, eps: float, eps_inside_sqrt: bool) -> torch.Tensor:
    """x / (‖x‖·D^{-1/2} + ε) (outside), or x / √(mean(x²) + ε) (inside); fp32 math for half x."""
    if x.shape[-1] == 0:  # no features: nothing to scale (D^{-1/2} has no value)
        return x * 1
    xf = x.to(state_dtype_for(x.dtype))
    # Each row is divided by a power of two near its max first (exact, so rows of ordinary scale
    # give the same bits): in fp32 the sum of squares overflows from an RMS of about 1.8e19/√D
    # (and rsqrt's gradient, mean^(-3/2), underflows from about 1e13), and underflows below about
    # 1e-19, where only a tiny ε keeps the scale. The power is a constant to autograd, and never so
    # small that ε/p or ε/p² overflow (the rows below that are ε's anyway).
    fi = torch.finfo(xf.dtype)
    floor = max(fi.tiny, (16 * eps / fi.max) ** (0.5 if eps_inside_sqrt else 1.0))  # (p rounds down to 2^k)
    amax = xf.detach().abs().amax(-1, keepdim=True)
    p = torch.exp2(torch.floor(torch.log2(amax.clamp_min(floor))))
    p = torch.where(torch.isfinite(p), p, torch.ones_like(p))  # an inf/NaN row stays inf/NaN
    xs = xf / p
    if eps_inside_sqrt:
        y = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + eps / p / p)  # (p² may underflow)
    else:
        y = xs / (xs.norm(dim=-1, keepdim=True) * x.shape[-1] ** -0.5 + eps / p)
    return y.to(x.dtype)


class _FusedSRMS(torch.autograd.Function):
    """SimpleRMSNorm on the kernel, with ScaleNorm's scalar gain inside when given: the product
    by g and, backward, both products of g's gradient (dy·g for dx, dy·y for dg) are no separate
    passes over [N, D]. out_dtype: x's (None) or bf16, rounded once."""

    @staticmethod
    def forward(ctx, x, gain, eps: float, inside: bool, out_dtype):
        ctx.save_for_backward(x, gain)
        ctx.eps, ctx.inside = eps, inside
        return _native.srms_fwd(x, eps, inside, 1.0 if gain is None else float(gain), out_dtype)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x, gain = ctx.saved_tensors
        dy = dy.contiguous() if dy.dtype == torch.bfloat16 else dy.to(x.dtype).contiguous()
        dx, dgain = _native.srms_bwd(x, dy, ctx.eps, ctx.inside, 1.0 if gain is None else float(gain),
                                     gain_grad=gain is not None and ctx.needs_input_grad[1])
        return dx, None if dgain is None else dgain.to(gain.dtype), None, None, None


def simple_rms_norm(x: torch.Tensor, eps: float, eps_inside_sqrt: bool = False) -> torch.Tensor:
    """SimpleRMSNorm over the last dim of x [..., D] (spec §5); output in x's dtype."""
    if x.numel() and _native.rows_usable(x.dtype, x.device):
        return _FusedSRMS.apply(x.contiguous(), None, float(eps), bool(eps_inside_sqrt), None)
    return simple_rms_norm_reference(x, eps, eps_inside_sqrt)


def scale_norm_reference(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """ScaleNorm g·x / √(mean(x²) + ε) of x [..., D], scalar g; fp32 math for half x, one rounding."""
    return (simple_rms_norm_reference(x.to(state_dtype_for(x.dtype)), eps, True) * gain).to(x.dtype)


def scale_norm(x: torch.Tensor, gain: torch.Tensor, eps: float, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """ScaleNorm over the last dim of x [..., D] with the 0-d gain g (FLASH); output in x's dtype,
    or in ``out_dtype`` (computed in fp32 and rounded once: bf16 for a norm that feeds bf16
    autocast products, which would cast it anyway)."""
    if (x.numel() and gain.dim() == 0 and _native.rows_usable(x.dtype, x.device)
            and out_dtype in (None, x.dtype, torch.bfloat16)):
        return _FusedSRMS.apply(x.contiguous(), gain, float(eps), True, out_dtype)
    y = scale_norm_reference(x, gain, eps)
    return y if out_dtype is None else y.to(out_dtype)


class _ResidualAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, h):
        ctx.h_dtype = h.dtype
        return _native.add_upcast(x, h)

    @staticmethod
    def backward(ctx, g):  # (PyTorch ops: differentiable again)
        return g, g.to(ctx.h_dtype)  # as autograd's add: the stream's gradient, and it rounded for h


def residual_add(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``x + h``: an fp32 residual stream plus a bf16 branch output (under autocast) is added by a
    kernel reading h as it is, where PyTorch first writes an fp32 copy of h; same values."""
    if (x.dtype == torch.float32 and h.dtype == torch.bfloat16 and x.shape == h.shape and x.numel()
            and x.is_contiguous() and h.is_contiguous() and _native.rows_usable(x.dtype, x.device)
            and h.device == x.device):
        return _ResidualAdd.apply(x, h)
    return x + h


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
    @first_order_only
    def backward(ctx, dh):
        (ab,) = ctx.saved_tensors
        return _native.silu_gate_bwd(ab, dh.to(ab.dtype).contiguous())[0]


def silu_gate(ab: torch.Tensor) -> torch.Tensor:
    """The GLU gate silu(a) * b of ab [..., 2F] = [a | b] (the two input projections side by side)."""
    if ab.shape[-1] % 2:
        raise ValueError(f"ab must have an even last dim [a | b], got {tuple(ab.shape)}")
    if ab.numel() and _native.rows_usable(ab.dtype, ab.device):
        return _FusedSiluGate.apply(ab.contiguous())
    return silu_gate_reference(ab)


class _ProjectedSiluGate(torch.autograd.Function):
    """The GLU's input side as one Function: h = silu(x W₁ᵀ + b₁) ⊙ (x W₂ᵀ + b₂).

    The two projections run as one product on [W₁ | W₂]ᵀ, made contiguous in the pass that casts
    the weights anyway. The gate kernel adds the biases in fp32 (an addmm first copies them into
    every output row) and sums their gradient. Its backward also writes d(ab)ᵀ beside d(ab), so the
    weights' gradient reads a contiguous operand: oneDNN's bf16 GEMM reads a transposed one at
    about half its rate. At T = 4096, d = 512, F = 1365 in bf16, this input side ran in ~17 ms
    fwd+bwd against ~26 ms for F.linear on the concatenated weights plus the gate. The composed
    form (that F.linear, then :func:`silu_gate`) is the oracle.

    x: [..., d] (fp32 or bf16); w1, w2: [F, d] (fp32 or bf16); b1, b2: fp32 [F]; cdt: the compute
    dtype (autocast's, or x's). Returns [..., F] in cdt.
    """

    @staticmethod
    def forward(ctx, x, w1, w2, b1, b2, cdt):
        F_ = w1.shape[0]
        with autocast_off(x.device.type):
            x2, wt, ab = project(x, torch.cat((w1, w2)), cdt)
            bias = torch.cat((b1, b2))
            h = _native.silu_gate_fwd(ab, bias)
        ctx.save_for_backward(x2, wt, ab, bias)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, w1.dtype
        return h.view(*x.shape[:-1], F_)

    @staticmethod
    @first_order_only
    def backward(ctx, dh):
        x2, wt, ab, bias = ctx.saved_tensors
        N, F2 = ab.shape
        F_ = F2 // 2
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dab_t = torch.empty(F2, N, dtype=ab.dtype) if need_w else None  # d(ab)ᵀ, from the same kernel
        dab, db = _native.silu_gate_bwd(ab, dh.reshape(N, F_).to(ab.dtype).contiguous(), bias,
                                        bias_grad=ctx.needs_input_grad[3] or ctx.needs_input_grad[4], dab_t=dab_t)
        dx, dw = project_backward(dab, dab_t, x2, wt, x_shape=ctx.x_shape, x_dtype=ctx.x_dtype, w_dtype=ctx.w_dtype,
                                  need_x=ctx.needs_input_grad[0])
        dw1, dw2 = (None, None) if dw is None else (dw[:F_], dw[F_:])
        db1 = db2 = None
        if db is not None:
            db1, db2 = db[:F_], db[F_:]
        return dx, dw1, dw2, db1, db2, None


def projected_silu_gate(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor | None,
                        b2: torch.Tensor | None) -> torch.Tensor:
    """silu(x W₁ᵀ + b₁) ⊙ (x W₂ᵀ + b₂), the GLU's input side; x [..., d], w1, w2 [F, d], b1, b2
    [F] or None. On the CPU kernels one Function (:class:`_ProjectedSiluGate`), else F.linear on
    the concatenated weights and :func:`silu_gate`."""
    if w1.dim() != 2 or w1.shape != w2.shape or w1.shape[1] != x.shape[-1]:
        raise ValueError(f"w1 and w2 must both be [F, d] with d = x.shape[-1] = {x.shape[-1]}, got "
                         f"{tuple(w1.shape)} and {tuple(w2.shape)}")
    for name, b in (("b1", b1), ("b2", b2)):
        if b is not None and b.shape != (w1.shape[0],):
            raise ValueError(f"{name} must be [F] = [{w1.shape[0]}] or None, got {tuple(b.shape)}")
    if (b1 is None) != (b2 is None):
        raise ValueError("b1 and b2 must both be given or both be None")
    if (b1 is not None and b1.dtype == b2.dtype == torch.float32 and x.numel()
            and w1.dtype == w2.dtype and _native.rows_usable(projection_dtype(x), x.device)
            and fused_projection_ok(x, w1, w2, b1, b2)):
        return _ProjectedSiluGate.apply(x, w1, w2, b1, b2, projection_dtype(x))
    bias = None if b1 is None else torch.cat((b1, b2))
    if bias is not None and bias.dtype != w1.dtype and not autocast_enabled(x.device.type):
        bias = bias.to(w1.dtype)  # F.linear takes one dtype (the fused path adds an fp32 bias itself)
    return silu_gate(linear(x, torch.cat((w1, w2)), bias))


class _FusedSiluSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre, bias, widths):
        ctx.save_for_backward(pre, bias)
        ctx.widths = widths
        ctx.set_materialize_grads(False)  # an unused group needs no zero gradient
        return tuple(_native.silu_split_fwd(pre, widths, bias))

    @staticmethod
    @first_order_only
    def backward(ctx, *grads):
        pre, bias = ctx.saved_tensors
        grads = [None if g is None else g.to(pre.dtype).contiguous() for g in grads]
        dpre, dbias = _native.silu_split_bwd(pre, grads, ctx.widths, bias,
                                             bias_grad=bias is not None and ctx.needs_input_grad[1])
        return dpre, dbias, None


def silu_split_reference(pre: torch.Tensor, widths: list[int], bias: torch.Tensor | None = None):
    """``F.silu(pre + bias).split(widths, -1)``; with a bias, in fp32 (at least) and rounded once to
    pre's dtype, as the fused form."""
    if bias is None:
        return F.silu(pre).split(widths, dim=-1)
    x = pre.to(torch.promote_types(pre.dtype, torch.float32)) + bias
    return F.silu(x).to(pre.dtype).split(widths, dim=-1)


def silu_split(pre: torch.Tensor, widths: list[int], bias: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``F.silu(pre + bias).split(widths, -1)`` as contiguous tensors (GAU/FLASH's [u | v | z]).

    The fused CPU form writes each group once and, backward, d(pre) in one pass from the groups'
    gradients, without concatenating them first. ``bias`` [W] (the projection's, which then runs
    without it) is added in fp32, and its gradient is summed in the same pass.
    """
    widths = [int(w) for w in widths]
    if sum(widths) != pre.shape[-1] or min(widths, default=0) < 1:
        raise ValueError(f"widths must be positive and sum to pre's last dim {pre.shape[-1]}, got {widths}")
    if bias is not None and bias.shape != (pre.shape[-1],):
        raise ValueError(f"bias must have shape [{pre.shape[-1]}], got {tuple(bias.shape)}")
    if (pre.numel() and _native.rows_usable(pre.dtype, pre.device)
            and (bias is None or (bias.dtype == torch.float32 and bias.device == pre.device))):
        return _FusedSiluSplit.apply(pre.contiguous(), None if bias is None else bias.contiguous(), widths)
    return silu_split_reference(pre, widths, bias)


def scale_offset_rope_reference(z, gamma, beta, cos, sin):
    """heads_h = RoPE(z ⊙ γ_h + β_h), rotate-half pairs (i, i + P) of the first 2P channels."""
    x = z[:, :, None, :] * gamma + beta  # [B, T, n, s]
    P = cos.shape[-1]
    c, s_ = cos[:, :, None].to(x.dtype), sin[:, :, None].to(x.dtype)
    lo, hi = x[..., :P], x[..., P:2 * P]
    return torch.cat((lo * c - hi * s_, hi * c + lo * s_, x[..., 2 * P:]), -1)


class _FusedHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, gamma, beta, cos, sin, out_dtype):
        ctx.save_for_backward(z, gamma, cos, sin)
        ctx.out_dtype = out_dtype
        return _native.heads_fwd(z, gamma, beta, cos, sin, out_dtype)

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        z, gamma, cos, sin = ctx.saved_tensors
        dz, dgamma, dbeta = _native.heads_bwd(z, gamma, cos, sin, dy.to(ctx.out_dtype).contiguous())
        return dz, dgamma, dbeta, None, None, None


def scale_offset_rope(z: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """GAU/FLASH query-key heads: RoPE(z ⊙ γ_h + β_h) for every head h.

    Args:
        z: [B, T, s] shared projection (its rows may be strided: a slice of the layer's projection).
        gamma, beta: [n, s] per-head scale and offset.
        cos, sin: [B or 1, T, P] rotary tables; pairs (i, i + P) of the first 2P ≤ s channels
            rotate (rotate-half), the other channels pass through. Tables that require grad get
            it through the PyTorch form (the fused kernel runs only where they do not).
        out_dtype: the heads' dtype, computed in the promoted dtype and rounded once (a layer
            whose attention runs under bf16 autocast asks for bf16: the same values its products'
            casts would make, without the fp32 copy). None: the promoted dtype of z and γ.

    Returns [B, T, n, s]. On the CPU kernels it is stored head-outer (an [n, B, T, s] tensor
    seen as [B, T, n, s]: each head contiguous, the whole not), so reshape it rather than view.
    """
    B, T, s = z.shape
    P = cos.shape[-1]
    if gamma.dim() != 2 or gamma.shape[1] != s or beta.shape != gamma.shape:
        raise ValueError(f"gamma and beta must be [n, s = {s}], got {tuple(gamma.shape)} and {tuple(beta.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1] != T or t.shape[2] != P or 2 * P > s:
            raise ValueError(f"{name} must be [B or 1, T = {T}, P = {P}] with 2P <= {s}, got {tuple(t.shape)}")
    if (z.numel() and _native.rows_usable(z.dtype, z.device) and gamma.dtype == beta.dtype == torch.float32
            and all(t.device == z.device for t in (gamma, beta, cos, sin))
            and not (cos.requires_grad or sin.requires_grad)):
        z = z if _native.token_rows_ok(z) else z.contiguous()
        cos, sin = (t.float().expand(B, T, P).contiguous() for t in (cos, sin))
        if out_dtype in (None, torch.float32, torch.bfloat16):
            return _FusedHeads.apply(z, gamma.contiguous(), beta.contiguous(), cos, sin, out_dtype or torch.float32)
    heads = scale_offset_rope_reference(z, gamma, beta, cos, sin)
    return heads if out_dtype is None else heads.to(out_dtype)
