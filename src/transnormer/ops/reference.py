"""Slow, obviously-correct quadratic forms of the ops: the oracles of the tests and the
attention maps of the analysis tools. O(T²) time and memory; never on a training path.

Layouts as in the fast ops: q, k [B, T, H, D], v [B, T, H, E], weights [B, H, T, T].
"""

from __future__ import annotations

import torch

from ._checks import check_bool, check_key_padding_mask, check_positive_int, check_qkv, check_scale
from .block import _check_kernel


def norm_linear_attn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    initial_state: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    return_weights: bool = False,
):
    """T = (Q Kᵀ ⊙ M) V (+ Q S_init) with K, V rows multiplied by the key mask (spec §1.1(d)).

    Returns (o, final_state) or (o, final_state, scores [B, H, T, T]) with return_weights.
    The scores are the raw q̂·k̂ products (masked), the matrix the analyses row-normalise.
    """
    check_bool("causal", causal)  # (as the fast ops: "false" had run the causal form)
    check_qkv(q, k, v)
    B, T, H, D = q.shape
    mask = check_key_padding_mask(key_padding_mask, B, T)
    if mask is not None:
        m = mask[:, :, None, None].to(q.dtype)
        k, v = k * m, v * m
    s = torch.einsum("bihd,bjhd->bhij", q, k)
    if causal:
        s = s * torch.ones(T, T, dtype=q.dtype, device=q.device).tril()
    o = torch.einsum("bhij,bjhe->bihe", s, v)
    final = torch.einsum("bjhd,bjhe->bhde", k, v)
    if initial_state is not None:
        o = o + torch.einsum("bihd,bhde->bihe", q, initial_state.to(q.dtype))
        final = final + initial_state.to(q.dtype)
    if return_weights:
        return o, final, s
    return o, final


def block_allowed_mask(
    T: int, block_size: int, causal: bool, key_padding_mask: torch.Tensor | None, batch: int, device=None
) -> torch.Tensor:
    """[B, T, T] bool: may query i attend to key j under the DiagAttention rule."""
    i = torch.arange(T, device=device)
    blk = i // block_size
    allowed = blk[:, None] == blk[None, :]
    if causal:
        allowed = allowed & (i[None, :] <= i[:, None])
    allowed = allowed.expand(batch, T, T)
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask.bool()[:, None, :]
    return allowed


def block_attn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int = 64,
    causal: bool,
    kernel: str = "softmax",
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    return_weights: bool = False,
):
    """Dense T×T evaluation of DiagAttention; returns o or (o, weights [B, H, T, T])."""
    check_bool("causal", causal)  # (as the fast ops: "false" had run the causal form)
    check_qkv(q, k, v)
    _check_kernel(kernel)
    check_positive_int("block_size", block_size)
    check_scale(scale)
    B, T, H, D = q.shape
    mask = check_key_padding_mask(key_padding_mask, B, T)
    if scale is None:
        scale = D ** -0.5 if D else 1.0
    allowed = block_allowed_mask(T, block_size, causal, mask, B, q.device)[:, None]  # [B,1,T,T]
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if kernel == "softmax":
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        p = torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))
    else:
        p = torch.relu(s) * allowed.to(s.dtype)
    o = torch.einsum("bhij,bjhe->bihe", p, v)
    return (o, p) if return_weights else o
