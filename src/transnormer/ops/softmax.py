"""Vanilla softmax attention through ``F.scaled_dot_product_attention`` (the quadratic baseline).

    q, k: [B, Tq|Tk, H, D]    v: [B, Tk, H, E]    key_padding_mask: [B, Tk] (True = valid)

Padding is honoured explicitly rather than through SDPA corner cases (peers.md §3.1): a query
row with no allowed key outputs exactly 0 (never NaN), and padded query rows are zeroed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native
from ._checks import check_bool, check_key_padding_mask, check_probability, check_qkv, check_scale


def _sdpa_masked(q, k, v, allowed, *, scale, dropout_p):
    """q: [B, H, Tq, D]; allowed: [B, 1, Tq, Tk] bool. Rows with no allowed key → 0."""
    has_any = allowed.any(-1, keepdim=True)
    # An empty row would be 0/0 inside the softmax: let it see every key, then zero it.
    safe = allowed | ~has_any
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=safe, dropout_p=dropout_p, scale=scale)
    return o.masked_fill(~has_any, 0.0)


def softmax_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Self-attention softmax(q kᵀ · scale + mask) v, q/k/v of one sequence.

    ``scale`` defaults to D^{-1/2}. With a mask, padded queries output 0. Returns [B, T, H, E].
    Memory: the SDPA kernels never build the T×T matrix without a mask; with a mask a [B, 1, T, T]
    bool mask is built (8k tokens: 64 MB). On CPU, without a mask or dropout and with scale > 0,
    bf16 (on a CPU with AMX or AVX512-BF16) and fp32 inputs run the fused kernels
    (``_native_softmax_amx.cpp``, ``_native_softmax.cpp``; see ``_native.softmax_usable``) instead
    of SDPA: 2.3–3.4x (bf16) and ~1.2x (fp32) its speed fwd+bwd on an AMX machine, 3.5–6.3x (bf16)
    on AVX512-BF16 (Zen 5), 1.14–1.32x (fp32) on AVX2 (Zen 3); bf16 on a CPU with neither bf16
    engine runs the fp32 kernel on fp32 copies (1.7–3.5x SDPA's bf16 on AVX-512, ~11x on AVX2).
    Under CPU autocast fp32 inputs are cast first, as for SDPA.
    """
    check_bool("causal", causal)  # (a string "false" had run the causal form, None the bidirectional one)
    check_qkv(q, k, v)
    check_scale(scale)
    check_probability("dropout_p", dropout_p)
    B, T = q.shape[:2]
    mask = check_key_padding_mask(key_padding_mask, B, T)
    if scale is None:
        scale = q.shape[-1] ** -0.5 if q.shape[-1] else 1.0  # D = 0: every score is 0 whatever the scale
    if mask is None and dropout_p == 0.0:
        o = _native.fused_softmax_attn(q, k, v, causal=causal, scale=scale)
        if o is not None:
            return o
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    if mask is None and (not causal or scale > 0):
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, dropout_p=dropout_p, scale=scale)
        return o.transpose(1, 2)
    if mask is None:  # SDPA's is_causal path returned NaN rows for scale <= 0 (torch 2.13, CPU)
        mask = torch.ones(B, T, dtype=torch.bool, device=q.device)
    else:  # a padded key or value holding inf/NaN: weight 0 times it would be NaN; a padded query's
        # NaN scores, times its zero output gradient, had put NaN into every real key's and value's
        qh, kh, vh = (x.masked_fill(~mask[:, None, :, None], 0.0) for x in (qh, kh, vh))
    allowed = mask[:, None, None, :].expand(B, 1, T, T)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    o = _sdpa_masked(qh, kh, vh, allowed, scale=scale, dropout_p=dropout_p).transpose(1, 2)
    return o.masked_fill(~mask[:, :, None, None], 0.0)  # padded queries: 0, even from a NaN query


def softmax_attn_cached(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_valid: torch.Tensor,
    query_offset: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of the last Tq tokens to all Tk cached + new keys (decoding).

    q: [B, Tq, H, D]; k: [B, Tk, H, D]; v: [B, Tk, H, E]; key_valid: [B, Tk] bool. Query t sits at
    index ``query_offset + t`` of the key sequence and sees keys at indices ≤ its own. Rows may
    hold padding holes anywhere; only ``key_valid`` decides. A padded key or value must be finite
    (weight 0 times inf/NaN is NaN): the layer zeroes them before they enter its cache, once, where
    a fill here would copy the whole cache every step. Returns [B, Tq, H, E].
    """
    Tq, Tk = q.shape[1], k.shape[1]
    idx = torch.arange(Tk, device=q.device)
    causal = idx[None, :] <= (query_offset + torch.arange(Tq, device=q.device))[:, None]  # [Tq, Tk]
    allowed = (key_valid[:, None, None, :] & causal).reshape(q.shape[0], 1, Tq, Tk)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    return _sdpa_masked(qh, kh, vh, allowed, scale=scale, dropout_p=0.0).transpose(1, 2)
