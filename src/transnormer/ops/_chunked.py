"""Causal chunked linear attention as one autograd Function.

Layout inside: [N, G, c, D] with N = B·H heads, G chunks of c rows. Forward and backward are
written by hand so that nothing O(T·c) or O(G·D·E) is kept between them: the intra-chunk scores
and the prefix states are recomputed in the backward from q, k, v (a few extra GEMMs, no extra
memory). On CPU the prefix scans run as in-place loops over chunks, several times faster there
than ``cumsum`` over a strided dim and its flipped backward; on other devices one ``cumsum``.

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

from ._checks import first_order_only
from ._dtypes import autocast_off


def _exclusive_scan(x: torch.Tensor, init: torch.Tensor | None, reverse: bool = False):
    """x: [N, G, D, E] (state dtype). Returns (exclusive prefix sums, total incl. init)."""
    if x.device.type != "cpu":
        return _exclusive_scan_cumsum(x, init, reverse)
    out = torch.empty_like(x)
    acc = torch.zeros_like(x[:, 0]) if init is None else init.clone()
    order = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
    for g in order:
        out[:, g] = acc
        acc += x[:, g]
    return out, acc


def _exclusive_scan_cumsum(x: torch.Tensor, init: torch.Tensor | None, reverse: bool = False):
    """The same scan as one ``cumsum``: on a GPU the loop above launches a few kernels per chunk
    (hundreds at long T), where one scan kernel does the work. Same accumulation dtype."""
    xs = x.flip(1) if reverse else x
    inclusive = xs.cumsum(1)
    if init is not None:
        inclusive = inclusive + init.unsqueeze(1)
    first = torch.zeros_like(x[:, :1]) if init is None else init.unsqueeze(1)
    out = torch.cat([first, inclusive[:, :-1]], 1)[:, :x.shape[1]]  # (G = 0: no chunk, as the loop)
    total = inclusive[:, -1] if x.shape[1] else first[:, 0].clone()
    return (out.flip(1) if reverse else out), total


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


class ChunkedCausalLinearAttn(torch.autograd.Function):
    """All matmuls run as bmm / in-place baddbmm over [N·G, ·, ·] views (no extra add passes)."""

    @staticmethod
    def forward(ctx, q, k, v, init, state_dtype):
        """q, k: [N, G, c, D]; v: [N, G, c, E]; init: [N, D, E] or None. Returns (o, final)."""
        N, G, c, D = q.shape
        with autocast_off(q.device.type):
            q3, k3, v3 = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
            E = v.shape[-1]  # explicit sizes, not -1: views of empty tensors (N = 0) need them
            kv = torch.bmm(_t(k3), v3).view(N, G, D, E).to(state_dtype)
            states, final = _exclusive_scan(kv, None if init is None else init.to(state_dtype))
            o = torch.bmm(q3, states.to(q.dtype).flatten(0, 1))  # inter-chunk: Q_g S_g
            scores = torch.bmm(q3, _t(k3)).tril_()
            o.baddbmm_(scores, v3)  # + intra-chunk (Q_g K_gᵀ ⊙ M) V_g
        ctx.save_for_backward(q, k, v, init)
        ctx.state_dtype = state_dtype
        return o.view(N, G, c, E), final

    @staticmethod
    @first_order_only
    def backward(ctx, do, dfinal):
        q, k, v, init = ctx.saved_tensors
        sdt = ctx.state_dtype
        N, G, c, D = q.shape
        with autocast_off(q.device.type):
            q3, k3, v3 = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
            do3 = do.contiguous().flatten(0, 1)
            E = v.shape[-1]
            kv = torch.bmm(_t(k3), v3).view(N, G, D, E).to(sdt)
            states, _ = _exclusive_scan(kv, None if init is None else init.to(sdt))
            ds = torch.bmm(_t(q3), do3).view(N, G, D, E).to(sdt)
            dfin = torch.zeros_like(states[:, 0]) if dfinal is None else dfinal.to(sdt)
            rev, ds0 = _exclusive_scan(ds, dfin, reverse=True)
            rev3, states3 = rev.to(q.dtype).flatten(0, 1), states.to(q.dtype).flatten(0, 1)

            dscores = torch.bmm(do3, _t(v3)).tril_()  # dA, masked
            dq = torch.bmm(do3, _t(states3)).baddbmm_(dscores, k3)
            dk = torch.bmm(v3, _t(rev3)).baddbmm_(_t(dscores), q3)
            scores = torch.bmm(q3, _t(k3)).tril_()
            dv = torch.bmm(k3, rev3).baddbmm_(_t(scores), do3)
        dinit = None if init is None else ds0.to(init.dtype)
        return dq.view(N, G, c, D), dk.view(N, G, c, D), dv.view(N, G, c, E), dinit, None
