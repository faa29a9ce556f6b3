"""fp32 products where PyTorch's fp32 GEMM is slow: linear layers (y = x Wᵀ + b) on oneDNN,
batched products on the native AVX-512 GEMM.

Why: PyTorch's CPU fp32 matmul is MKL's, and on AMD CPUs MKL takes its AVX2 code path. On the
Zen 5 machine of docs/benchmarks.md (thirteenth round) it ran a 2048³ product at 208–216 GFLOP/s
and t2-lm's [4096 × 512]·[512 × 2048] at 178, where oneDNN (``torch.ops.mkldnn._linear_pointwise``,
the inner product PyTorch's compiler uses for frozen CPU models) ran them at 442 and 321: the
same fp32 arithmetic, AVX-512 code. So there all three products of a linear layer go through
oneDNN, the weight gradient on transposed copies of dy and x (oneDNN's inner product takes
row-major operands; a copy costs a few percent of the product it feeds). Everywhere else, and
for other dtypes or under autocast, this is ``F.linear``.

Batched fp32 products (:func:`bmm`, FLASH's chunk products) leave MKL on the same machines for
the register-blocked AVX-512 GEMM of the native kernels (``_native_bmm.cpp``): PyTorch exposes
no fp32 batched product of oneDNN's. MKL's AVX2 path ran FLASH's 16 chunk products of
256 x 256 x 1024 at 207 GFLOP/s on that machine, the native GEMM at 427.

``TRANSNORMER_FP32_GEMM`` = ``auto`` (default: off MKL on AMD CPUs with AVX-512, linear layers
where PyTorch has oneDNN's op; measured on Zen 5 only), ``onednn`` (off MKL wherever the
other kernel can run) or ``mkl`` (never).
A ``create_graph`` backward of the oneDNN path runs PyTorch's products on the saved inputs, so its
second derivatives are F.linear's. The path is skipped under ``torch.compile``; ``torch.jit``/``torch.fx`` tracing is not supported on it.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from . import _native

_CHOICES = ("auto", "onednn", "mkl")


def onednn_available() -> bool:
    """Whether this PyTorch has oneDNN's inner product on CPU (the op this module runs)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def _leaves_mkl(choice: str) -> bool:
    """Whether fp32 products leave MKL for ``TRANSNORMER_FP32_GEMM=choice``."""
    if choice not in _CHOICES:
        raise ValueError(f"TRANSNORMER_FP32_GEMM must be one of {_CHOICES}, got {choice!r}")
    if choice != "auto":
        return choice == "onednn"
    cpu = _native.cpu_info()
    return cpu.vendor == "AuthenticAMD" and "avx512f" in cpu.flags


def env_leaves_mkl() -> bool:
    """``_leaves_mkl`` for the environment's ``TRANSNORMER_FP32_GEMM`` (empty or unset: ``auto``)."""
    return _leaves_mkl(os.environ.get("TRANSNORMER_FP32_GEMM", "").strip() or "auto")


def _fp32_off_mkl() -> bool:
    """``TRANSNORMER_FP32_GEMM`` says fp32 products leave MKL, and the kernel backend is not
    ``"torch"`` (which runs the plain PyTorch forms everywhere: the FLOP counter of ``bench`` sees
    only those)."""
    return env_leaves_mkl() and _native.backend() != "torch"


def onednn_fp32() -> bool:
    """Whether fp32 linear layers run on oneDNN here (``TRANSNORMER_FP32_GEMM``, module docstring);
    never under ``set_kernel_backend("torch")``."""
    return _fp32_off_mkl() and onednn_available() and torch.backends.mkldnn.enabled


def dense_rows(a: torch.Tensor) -> torch.Tensor:
    """a, or a contiguous copy of it: the transposed view of a contiguous fp32 or bf16 matrix is
    copied in one pass of the native kernel (PyTorch's transposing copy ran 3.6-4.4x slower here,
    e.g. 31.8 against 8.7 ms for a [16384, 2048] fp32 gradient), anything else by ``contiguous``.
    The native copy is not differentiable: a tensor autograd tracks gets ``contiguous``."""
    if a.is_contiguous():
        return a
    if a.requires_grad and torch.is_grad_enabled():
        return a.contiguous()
    if a.dim() == 2 and a.t().is_contiguous() and _native.rows_usable(a.dtype, a.device):
        return _native.cast_transpose(a.t(), a.dtype)
    return a.contiguous()


def _inner(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, add: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [N, in] Wᵀ (+ b) (+ add [N, out]) on oneDNN; w [out, in]. All contiguous fp32."""
    if add is None:
        return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "")
    binary = _linear_binary()
    if binary is None:  # an older PyTorch without the fused sum
        return torch.ops.mkldnn._linear_pointwise(x2, w, b, "none", [], "").add_(add)
    return binary(x2, add, w, b, "add")


def _linear_binary():
    """oneDNN's inner product with a fused binary post-op, or None where this PyTorch lacks it."""
    return getattr(torch.ops.mkldnn._linear_pointwise, "binary", None)


def inner(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a wᵀ on oneDNN whatever ``TRANSNORMER_FP32_GEMM`` says (a [N, in], w [out, in], contiguous
    fp32 CPU tensors; needs :func:`onednn_available`): for the benchmarks' GEMM probe."""
    return _inner(a, w, None)


class _OneDNNLinear(torch.autograd.Function):
    """x [..., in], w [out, in], b [out] or None, fp32 on CPU → [..., out]."""

    @staticmethod
    def forward(ctx, x, w, b):
        need_x, need_w = ctx.needs_input_grad[:2]
        # the inputs themselves (no copy kept): saved inputs keep their graph for a create_graph backward
        ctx.save_for_backward(x if need_w else None, w if need_x else None)  # only what a gradient reads
        ctx.x_shape, ctx.w_shape, ctx.has_bias = x.shape, w.shape, b is not None
        return _inner(x.reshape(-1, x.shape[-1]).contiguous(), dense_rows(w), b).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dy2 = dy.reshape(-1, ctx.w_shape[0]).contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: PyTorch's products, which are differentiable again
            dx = (dy2 @ w).view(ctx.x_shape) if need_x else None
            dw = dy2.t() @ x.reshape(-1, ctx.x_shape[-1]) if need_w else None
            return dx, dw, dy2.sum(0) if need_b and ctx.has_bias else None
        x2 = x.reshape(-1, ctx.x_shape[-1]) if need_w else None
        dx = _inner(dy2, dense_rows(w.t()), None).view(ctx.x_shape) if need_x else None  # dy W
        dw = _inner(dense_rows(dy2.t()), dense_rows(x2.t()), None) if need_w else None  # dyᵀ x, on copies
        db = dy2.sum(0) if need_b and ctx.has_bias else None
        return dx, dw, db


def _eager_fp32_cpu(dtype: torch.dtype, device: torch.device) -> bool:
    """fp32 on a CPU, outside autocast and torch.compile: where products may leave MKL."""
    return (dtype == torch.float32 and device.type == "cpu" and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def onednn_for(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether products in ``dtype`` on ``device`` run on oneDNN here and now (fp32 on CPU, no
    autocast, not compiled, :func:`onednn_fp32`)."""
    return _eager_fp32_cpu(dtype, device) and onednn_fp32()


def takes_onednn(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a product of a and w (non-empty fp32 CPU tensors, no autocast, not compiled) runs on oneDNN."""
    return (a.dtype == w.dtype and w.device.type == "cpu" and a.numel() > 0 and w.numel() > 0
            and onednn_for(a.dtype, a.device))


def mm_t(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [N, in] wᵀ for w [out, in]: ``torch.mm(a, w.t())``, on oneDNN where fp32 linear layers run
    there (for Functions that do their own products: ops/_projection.py)."""
    if takes_onednn(a, w):
        return _inner(dense_rows(a), dense_rows(w), None)
    return torch.mm(a, w.t())


def mm_t_add(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """c + a wᵀ as a new tensor (a [N, in], w [out, in], c [N, out], all contiguous fp32), the sum
    fused into oneDNN's product: for accumulating a product over chunks where :func:`takes_onednn`
    holds (modules/lm_loss.py's weight gradient)."""
    return _inner(a, w, None, c)


def native_bmm_for(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether :func:`bmm` runs products in ``dtype`` on ``device`` on the native AVX-512 GEMM: fp32
    on a CPU where fp32 products leave MKL (``TRANSNORMER_FP32_GEMM``), no autocast, not compiled
    (PyTorch exposes no fp32 batched product of oneDNN's, hence ``_native_bmm.cpp``)."""
    return (_eager_fp32_cpu(dtype, device) and _fp32_off_mkl() and _native.rows_usable(dtype, device)
            and _native.bmm_ready())


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, accumulate: bool = False) -> torch.Tensor:
    """a @ b for a [n, M, K], b [n, K, N] (one dtype), into ``out`` [n, M, N] if given, added to it
    with ``accumulate``: ``torch.bmm``/``baddbmm_``, or the native GEMM where
    :func:`native_bmm_for` holds and b and out have unit column stride (a may be any view).
    Not differentiable on the native path: for Functions that do their own products (ops/flash.py)."""
    if (native_bmm_for(a.dtype, a.device) and a.dtype == b.dtype and b.stride(-1) == 1
            and (out is None or out.stride(-1) == 1 and out.dtype == a.dtype)
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))):
        return _native.bmm(a, b, out, accumulate=accumulate)
    if accumulate:
        if out is None:
            raise ValueError("bmm: accumulate=True needs out")
        return out.baddbmm_(a, b)
    return torch.bmm(a, b) if out is None else torch.bmm(a, b, out=out)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; fp32 on a CPU where :func:`onednn_fp32` holds runs on oneDNN
    (same fp32 arithmetic, another summation order)."""
    if x.dim() > 0 and (bias is None or bias.dtype == torch.float32) and takes_onednn(x, weight):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)
