"""The input projection x Wᵀ of the fused Functions that run it themselves (FLASH's mixer, the
GLU's input side), so that their gradient kernels can hand the weight's product a contiguous
d(y)ᵀ: oneDNN's bf16 GEMM reads a transposed operand at about half its rate.
"""

from __future__ import annotations

import torch

from . import _native
from ._dtypes import autocast_enabled
from .dense import mm_t


def projection_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer on x computes in: autocast's where it is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if autocast_enabled(dev) else x.dtype


def fused_projection_ok(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether a Function that runs x Wᵀ itself does what F.linear would: fp32 or bf16 operands,
    of one dtype unless autocast casts them, on one device (``others``, e.g. the biases, too: a
    pointer to another device's memory would reach the CPU kernels)."""
    floats = (torch.float32, torch.bfloat16)
    return (x.dtype in floats and weight.dtype in floats
            and all(t.device == x.device for t in (weight, *others) if t is not None)
            and (autocast_enabled(x.device.type) or x.dtype == weight.dtype))


def project(x: torch.Tensor, weight: torch.Tensor, cdt: torch.dtype):
    """(x2 [N, d], Wᵀ [d, out], y [N, out] = x2 Wᵀ), all in cdt, for x [..., d] and weight [out, d].
    Wᵀ is a view where W needs no cast, else one cast-and-transpose pass (a row-major operand)."""
    x2 = x.reshape(-1, x.shape[-1]).to(cdt)
    if weight.dtype == cdt:
        return x2, weight.t(), mm_t(x2, weight)  # fp32: oneDNN where MKL lags (ops/dense.py)
    wt = _native.cast_transpose(weight.contiguous(), cdt)
    return x2, wt, torch.mm(x2, wt)


def project_backward(dy: torch.Tensor, dy_t: torch.Tensor | None, x2: torch.Tensor, wt: torch.Tensor, *,
                     x_shape, x_dtype: torch.dtype, w_dtype: torch.dtype, need_x: bool):
    """(dx in x's shape and dtype or None, dW in W's dtype or None) of :func:`project` from dy [N, out]
    and its transposed copy dy_t [out, N] (None: no weight gradient)."""
    dx = mm_t(dy, wt).view(x_shape).to(x_dtype) if need_x else None  # dy W, W = wtᵀ
    dw = None if dy_t is None else mm_t(dy_t, x2.t()).to(w_dtype)  # dyᵀ x2 (oneDNN: on a copy of x2ᵀ)
    return dx, dw
