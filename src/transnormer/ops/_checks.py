"""Argument validation shared by the ops: clear errors that name the argument."""

from __future__ import annotations

import functools
import math

import torch


def check_float(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_bthd(name: str, x: torch.Tensor) -> None:
    """Validate a [B, T, H, D] floating tensor."""
    check_float(name, x)
    if x.dim() != 4:
        raise ValueError(
            f"{name} must have layout [B, T, H, D] (4 dims), got shape {tuple(x.shape)}"
        )


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k: [B, T, H, D]; v: [B, T, H, E] with matching B, T, H and q/k head dims."""
    check_bthd("q", q)
    check_bthd("k", k)
    check_bthd("v", v)
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must match q in [B, T, H] (heads included), got v {tuple(v.shape)} and q {tuple(q.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def check_bool(name: str, value) -> bool:
    """A layer's on/off option: a string such as "false" had read as True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_probability(name: str, p) -> float:
    """A real number in [0, 1] (a dropout rate); bools and non-finite values refused."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1], got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:  # (NaN fails this too)
        raise ValueError(f"{name} must be in [0, 1], got {p}")
    return float(p)


def check_scale(scale) -> None:
    """None (the default 1/sqrt(D)) or a finite real number: inf or NaN made every output NaN."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")


def check_right_padded(mask: torch.Tensor | None, who: str) -> None:
    """Raise unless every row's real tokens come first (mask [B, T] bool): what cuts blocks or chunks
    by index (Diag, FLASH) would otherwise cut them at other positions than the unpadded sequence has."""
    if mask is not None and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(f"{who} cuts blocks by index and needs right-padded rows (real tokens first); "
                         "TransNormerModel moves left padding to the right before the layers")


def check_key_padding_mask(mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """Validate a [B, T] key mask (True / 1 = valid token) and return it as bool."""
    return _check_mask(mask, (batch, length), "[B, T]")


def check_step_mask(mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Validate the [B] key mask of one decoding step (True / 1 = real token) and return it as bool."""
    return _check_mask(mask, (batch,), "[B] for one step")


def _check_mask(mask, shape: tuple, layout: str) -> torch.Tensor | None:
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(f"key_padding_mask must have shape {layout} = {shape}, got {tuple(mask.shape)}")
    if mask.is_floating_point():
        raise TypeError("key_padding_mask must be bool or integer (1 = valid), got a floating-point tensor")
    # any non-zero integer means valid: a mask multiplies nothing by its values
    return mask.bool()


def first_order_only(backward):
    """Decorates the hand-written backward of an autograd Function (a kernel's, or one reading tensors
    saved without their graph): a backward run with ``create_graph=True`` raises. torch's
    ``once_differentiable`` instead returns gradients cut from the graph, which ``autograd.grad(...,
    allow_unused=True)``, ``hvp`` and ``hessian`` read as a zero second derivative."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        if torch.is_grad_enabled():  # (a plain backward runs with gradients off)
            name = type(ctx).__name__.removesuffix("Backward")
            raise RuntimeError(f"{name} has no second derivative (a backward with create_graph=True): its "
                               "gradient is written out by hand. Differentiate twice through the quadratic "
                               "references in transnormer.ops.reference instead")
        return backward(ctx, *grads)

    return wrapped

