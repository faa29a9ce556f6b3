"""Dense quadratic oracles of the baseline ops (tests and attention maps only, never training).

Each evaluates its formula entry by entry on a T×T matrix, written independently of the fast
form it checks: no chunking, no prefix states, no feature decompositions.
Layouts: multi-head q, k [B, T, H, D], v [B, T, H, E]; single-head (GAU/FLASH) q, k [B, T, s],
v [B, T, e]; key_padding_mask [B, T] (True = valid).
"""

from __future__ import annotations

import math

import torch

from ._checks import check_key_padding_mask, check_scale


def _valid(mask, B, T, device):
    mask = check_key_padding_mask(mask, B, T)
    return torch.ones(B, T, dtype=torch.bool, device=device) if mask is None else mask


def _allowed(valid: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B, T, T]: key j valid (and j ≤ i when causal)."""
    B, T = valid.shape
    allowed = valid[:, None, :].expand(B, T, T)
    if causal:
        allowed = allowed & torch.ones(T, T, dtype=torch.bool, device=valid.device).tril()
    return allowed


def ratio_attn_reference(
    weights: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None = None,
    denominator: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """o_i = Σ_j w_ij v_j / (Σ_j w_ij + eps) over allowed j; weights [B, H, T, T] → o [B, T, H, E]."""
    B, H, T, _ = weights.shape
    allowed = _allowed(_valid(key_padding_mask, B, T, v.device), causal)[:, None]
    w = weights * allowed.to(weights.dtype)
    num = torch.einsum("bhij,bjhe->bihe", w, v)
    if not denominator:
        return num
    den = w.sum(-1).transpose(1, 2)[..., None]  # [B, T, H, 1]
    return num / (den + eps) if eps > 0 else num / torch.where(den > 0, den, torch.ones_like(den))


def kernel_linear_attn_reference(qf, kf, v, *, causal, denominator=True, eps=1e-6, key_padding_mask=None):
    """Dense (φq φkᵀ ⊙ M) V / ((φq φkᵀ ⊙ M) 1 + eps); qf, kf [B, T, H, F]."""
    w = torch.einsum("bihf,bjhf->bhij", qf, kf)
    return ratio_attn_reference(w, v, causal=causal, key_padding_mask=key_padding_mask,
                                denominator=denominator, eps=eps)


def cosformer_weights_reference(q, k, positions, max_len) -> torch.Tensor:
    """w_ij = relu(q_i)·relu(k_j) · cos(π/2 · (p_i − p_j) / M), directly: [B, H, T, T]."""
    M = torch.as_tensor(max_len, dtype=torch.float64, device=q.device)
    M = M[:, None, None] if M.dim() == 1 else M
    p = positions.to(torch.float64)
    cos = torch.cos(math.pi / 2 * (p[:, :, None] - p[:, None, :]) / M).to(q.dtype)  # [B, T, T]
    return torch.einsum("bihd,bjhd->bhij", torch.relu(q), torch.relu(k)) * cos[:, None]


def favor_weights_reference(q, k, proj) -> torch.Tensor:
    """Unstabilised FAVOR+ kernel (1/m) Σ_r exp(ω_r·q̃_i − |q̃_i|²/2) exp(ω_r·k̃_j − |k̃_j|²/2).

    x̃ = x d^{-1/4}; evaluated as one [B, H, T, T, m] tensor (small shapes only). [B, H, T, T].
    """
    D = q.shape[-1]
    qs, ks = q * D ** -0.25, k * D ** -0.25
    pq = torch.exp(torch.einsum("bihd,rd->bhir", qs, proj) - 0.5 * qs.pow(2).sum(-1).transpose(1, 2)[..., None])
    pk = torch.exp(torch.einsum("bjhd,rd->bhjr", ks, proj) - 0.5 * ks.pow(2).sum(-1).transpose(1, 2)[..., None])
    return (pq[:, :, :, None, :] * pk[:, :, None, :, :]).mean(-1)


def softmax_attn_reference(q, k, v, *, causal, scale=None, key_padding_mask=None, return_weights=False):
    """Explicit masked softmax; rows with no allowed key and padded query rows output 0."""
    check_scale(scale)
    B, T, H, D = q.shape
    valid = _valid(key_padding_mask, B, T, q.device)
    allowed = _allowed(valid, causal)[:, None]  # [B, 1, T, T]
    scale = (D ** -0.5 if D else 1.0) if scale is None else scale
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    p = torch.where(allowed.any(-1, keepdim=True), p, torch.zeros_like(p))
    p = p * valid[:, None, :, None].to(p.dtype)
    o = torch.einsum("bhij,bjhe->bihe", p, v)
    return (o, p) if return_weights else o


def gau_attn_reference(q, k, v, *, causal, normalizer="seq_len", fixed_len=512, bias=None, key_padding_mask=None):
    """out_i = Σ_j allowed_ij relu²(q_i·k_j / N_i + b_ij) v_j with N_i from its definition (§1.1)."""
    B, T, _ = q.shape
    valid = _valid(key_padding_mask, B, T, q.device)
    allowed = _allowed(valid, causal)
    n_visible = allowed.sum(-1).to(q.dtype).clamp_min(1)  # keys row i can see
    n_total = valid.sum(-1).to(q.dtype).clamp_min(1)[:, None].expand(B, T)
    N = {"seq_len": n_total, "fixed": torch.full_like(n_total, float(fixed_len)),
         "visible": n_visible if causal else n_total, "none": torch.ones_like(n_total)}[normalizer]
    s = torch.einsum("bis,bjs->bij", q, k) / N[..., None]
    if bias is not None:
        s = s + bias
    a = torch.relu(s) ** 2 * allowed.to(q.dtype)
    return torch.einsum("bij,bje->bie", a, v)


def flash_attn_reference(q_local, k_local, q_global, k_global, v, *, causal, chunk_size, normalizer="visible",
                         local_bias=None, key_padding_mask=None, local_branch=True, global_branch=True):
    """flash.md §3.6, evaluated as written with c(i) = i // C and ρ(i) = i − C·c(i):

    out_i = Σ_{c(j)=c(i) [, j≤i]} m_j relu²(q_i·k_j / C + β(ρ_j − ρ_i)) v_j
          + (1/N_{c(i)}) Σ_{j: all | c(j)<c(i)} m_j (q̃_i·k̃_j) v_j
    """
    B, T, _ = q_local.shape
    C = chunk_size
    valid = _valid(key_padding_mask, B, T, v.device)
    i = torch.arange(T, device=v.device)
    c, rho = i // C, i % C
    out = torch.zeros(B, T, v.shape[-1], dtype=v.dtype, device=v.device)
    m = valid[:, None, :]
    if local_branch:
        allowed = (c[:, None] == c[None, :]) & m
        if causal:
            allowed = allowed & (i[None, :] <= i[:, None])
        s = torch.einsum("bis,bjs->bij", q_local, k_local) / C
        if local_bias is not None:
            s = s + local_bias[rho[:, None], rho[None, :]]
        out = out + torch.einsum("bij,bje->bie", torch.relu(s) ** 2 * allowed.to(v.dtype), v)
    if global_branch:
        seen = (c[None, :] < c[:, None]) if causal else torch.ones(T, T, dtype=torch.bool, device=v.device)
        allowed = seen & m  # [B, T, T]
        if normalizer == "visible":
            N = allowed.sum(-1).to(v.dtype).clamp_min(1)
        elif normalizer == "chunk":
            N = torch.full((B, T), float(C), dtype=v.dtype, device=v.device)
        else:
            N = torch.ones(B, T, dtype=v.dtype, device=v.device)
        w = torch.einsum("bis,bjs->bij", q_global, k_global) * allowed.to(v.dtype) / N[..., None]
        out = out + torch.einsum("bij,bje->bie", w, v)
    return out
