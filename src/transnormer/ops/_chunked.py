"""Causal chunked linear attention as one autograd Function.

Layout inside: [N, G, c, D] with N = B·H heads, G chunks of c rows. Forward and backward are
written by hand so that nothing O(T·c) or O(G·D·E) is kept between them: the intra-chunk scores
and the prefix states are recomputed in the backward from q, k, v (a few extra GEMMs, no extra
memory). The prefix scans run as in-place loops over chunks: on CPU that is several times
faster than ``cumsum`` over a strided dim and its flipped backward.

Math (spec §1.1(b)), per head, M the c×c lower-triangular mask:
    S_g = S_0 + Σ_{h<g} K_hᵀV_h,    O_g = (Q_g K_gᵀ ⊙ M) V_g + Q_g S_g,   S_final = S_G
Backward, with dS_g = Q_gᵀ dO_g and R_h = dS_final + Σ_{g>h} dS_g:
    dQ_g = (dO_g V_gᵀ ⊙ M) K_g + dO_g S_gᵀ
    dK_h = (dO_h V_hᵀ ⊙ M)ᵀ Q_h + V_h R_hᵀ
    dV_h = (Q_h K_hᵀ ⊙ M)ᵀ dO_h + K_h R_h
    dS_0 = dS_final + Σ_g dS_g
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _exclusive_scan(x: torch.Tensor, init: torch.Tensor | None, reverse: bool = False):
    """x: [N, G, D, E] (state dtype). Returns (exclusive prefix sums, total incl. init)."""
    out = torch.empty_like(x)
    acc = torch.zeros_like(x[:, 0]) if init is None else init.clone()
    order = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
    for g in order:
        out[:, g] = acc
        acc += x[:, g]
    return out, acc


class ChunkedCausalLinearAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, init, state_dtype):
        """q, k: [N, G, c, D]; v: [N, G, c, E]; init: [N, D, E] or None. Returns (o, final)."""
        with torch.autocast(q.device.type, enabled=False):
            kv = (k.transpose(-1, -2) @ v).to(state_dtype)
            states, final = _exclusive_scan(kv, None if init is None else init.to(state_dtype))
            scores = (q @ k.transpose(-1, -2)).tril_()
            o = scores @ v
            o.add_(q @ states.to(q.dtype))
        ctx.save_for_backward(q, k, v, init)
        ctx.state_dtype = state_dtype
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dfinal):
        q, k, v, init = ctx.saved_tensors
        sdt = ctx.state_dtype
        with torch.autocast(q.device.type, enabled=False):
            do = do.contiguous()
            kv = (k.transpose(-1, -2) @ v).to(sdt)
            states, _ = _exclusive_scan(kv, None if init is None else init.to(sdt))
            ds = (q.transpose(-1, -2) @ do).to(sdt)  # [N, G, D, E]
            dfin = torch.zeros_like(states[:, 0]) if dfinal is None else dfinal.to(sdt)
            rev, ds0 = _exclusive_scan(ds, dfin, reverse=True)
            rev = rev.to(q.dtype)

            dscores = (do @ v.transpose(-1, -2)).tril_()  # dA, masked
            dq = dscores @ k
            dq.add_(do @ states.to(q.dtype).transpose(-1, -2))
            dk = dscores.transpose(-1, -2) @ q
            dk.add_(v @ rev.transpose(-1, -2))
            scores = (q @ k.transpose(-1, -2)).tril_()
            dv = scores.transpose(-1, -2) @ do
            dv.add_(k @ rev)
        dinit = None if init is None else ds0.to(init.dtype)
        return dq, dk, dv, dinit, None
