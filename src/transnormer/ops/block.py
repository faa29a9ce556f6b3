"""DiagAttention core: attention inside non-overlapping blocks of ``block_size`` tokens.

    q, k: [B, T, H, D]    v: [B, T, H, E]    key_padding_mask: [B, T] (True = valid)

Allowed keys for query i: same block, valid (not user padding, not block-fill padding), and
j ≤ i when causal. Softmax (T2) gives disallowed keys −∞ logits; ReLU (T1, "ReLA") gives them
weight 0 and has no denominator. A query row with no allowed key outputs 0 (spec §2).
Cost O(T·w·D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native
from ._checks import check_bool, check_key_padding_mask, check_positive_int, check_probability, check_qkv, check_scale
from ._dtypes import autocast_enabled, autocast_off

KERNELS = ("softmax", "relu")


# Dtypes whose CPU softmax blocks go through SDPA; the others (bf16/fp16) use explicit matmuls.
_SDPA_CPU_DTYPES = (torch.float32, torch.float64)


def _check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def block_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int = 64,
    causal: bool,
    kernel: str = "softmax",
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Block-diagonal attention. Returns o: [B, T, H, E] in q's dtype.

    ``scale`` multiplies the scores (default D^-1/2). ``dropout_p`` drops attention weights
    (pass 0 at evaluation).
    """
    check_bool("causal", causal)  # (a string "false" had run the causal form, None the bidirectional one)
    check_qkv(q, k, v)
    check_positive_int("block_size", block_size)
    _check_kernel(kernel)
    check_scale(scale)
    check_probability("dropout_p", dropout_p)
    B, T, H, D = q.shape
    E = v.shape[-1]
    mask = check_key_padding_mask(key_padding_mask, B, T)
    if scale is None:
        scale = D ** -0.5 if D else 1.0  # D = 0: every score is 0 whatever the scale
    w = min(block_size, T) if T > 0 else block_size
    dev = q.device.type
    fp16 = q.dtype == torch.float16 or (dev in ("cpu", "cuda") and autocast_enabled(dev)
                                        and torch.get_autocast_dtype(dev) == torch.float16)
    if fp16 and (kernel == "relu" or dev == "cpu"):
        # the explicit forms below scale q kᵀ after the product: in fp16 the raw product leaves the
        # range (|q·k| > 65504) where the scaled score fits, and read inf (softmax NaN); fp32 inside,
        # the output rounded once (SDPA, fp16's path on GPUs, scales inside and needs none of it)
        with autocast_off(dev):  # (fp16 autocast would cast the products back)
            o = block_attn(q.float(), k.float(), v.float(), block_size=block_size, causal=causal, kernel=kernel,
                           scale=scale, key_padding_mask=key_padding_mask, dropout_p=dropout_p)
        return o.to(torch.float16)  # (what fp16 autocast's products would have returned)
    if kernel == "softmax" and mask is None and dropout_p == 0.0:
        # one block (T <= block_size) is plain attention over the sequence: window 0
        o = _native.fused_softmax_attn(q, k, v, causal=causal, scale=scale, window=0 if w == T else w)
        if o is not None:
            return o
    nb = -(-T // w)
    pad = nb * w - T
    if mask is not None:  # a padded key or value holding inf/NaN: weight 0 times it would be NaN
        k, v = (x.masked_fill(~mask[:, :, None, None], 0.0) for x in (k, v))
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
    # [B, H, nb, w, D] -> [B, H*nb, w, D] so that SDPA sees 4-d tensors
    qb = q.reshape(B, nb, w, H, D).permute(0, 3, 1, 2, 4).reshape(B, H * nb, w, D)
    kb = k.reshape(B, nb, w, H, D).permute(0, 3, 1, 2, 4).reshape(B, H * nb, w, D)
    vb = v.reshape(B, nb, w, H, E).permute(0, 3, 1, 2, 4).reshape(B, H * nb, w, E)

    # Only the block-fill padding of a non-causal call, or user padding, needs an explicit mask:
    # under the causal mask the fill keys sit after every real query.
    need_mask = mask is not None or (pad > 0 and not causal) or kernel == "relu"
    allowed = None
    if need_mask:
        valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask is None else mask
        valid = F.pad(valid, (0, pad), value=False).reshape(B, 1, nb, 1, w)
        allowed = valid.expand(B, 1, nb, w, w)
        if causal:
            tril = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
            allowed = allowed & tril
        allowed = allowed.expand(B, H, nb, w, w).reshape(B, H * nb, w, w)

    if kernel == "softmax":
        has_any = safe = None
        if allowed is not None:
            # Rows with no allowed key would be 0/0: let them see their own slot, then zero them.
            has_any = allowed.any(-1, keepdim=True)
            eye = torch.eye(w, dtype=torch.bool, device=q.device)
            safe = allowed | (~has_any & eye)
        if q.device.type == "cpu" and q.dtype not in _SDPA_CPU_DTYPES:
            # PyTorch's CPU flash-attention kernel is slow on many small bf16 blocks (w=64, fwd+bwd:
            # 46 ms vs 15 ms for the explicit form below); fp32 runs equally fast either way.
            if safe is None and causal:
                safe = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
            s = (qb @ kb.transpose(-1, -2)) * scale
            if safe is not None:
                s = s.masked_fill(~safe, float("-inf"))
            # softmax in fp32 for half inputs, as autocast would (fp64 stays fp64)
            a = torch.softmax(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1).to(vb.dtype)
            if dropout_p > 0.0:
                a = F.dropout(a, p=dropout_p, training=True)
            o = a @ vb
        elif safe is None and (not causal or scale > 0):
            o = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=dropout_p, is_causal=causal, scale=scale)
        elif safe is None:  # SDPA's is_causal path returns NaN rows for scale <= 0 (torch 2.13, CPU)
            tril = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=tril, dropout_p=dropout_p, scale=scale)
        else:
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=safe, dropout_p=dropout_p, scale=scale)
        if has_any is not None:
            o = o.masked_fill(~has_any, 0.0)
    else:
        a = torch.relu((qb @ kb.transpose(-1, -2)) * scale) * allowed.to(qb.dtype)
        if dropout_p > 0.0:
            a = F.dropout(a, p=dropout_p, training=True)
        o = a @ vb
    o = o.reshape(B, H, nb, w, E).permute(0, 2, 3, 1, 4).reshape(B, nb * w, H, E)
    return o[:, :T]
