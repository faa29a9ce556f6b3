"""GAU (FLASH-Quad) and FLASH mixed-chunk attention cores (spec flash.md §1–§4).

Single head, 3-d layouts (GAU has one head of width s):

    q, k: [B, T, s]   (already scaled/offset and RoPE'd by the layer)   v: [B, T, e]
    key_padding_mask: [B, T] (True = valid)      bias: [T, T] or [B, T, T] (gau_attn; relu2_attention: broadcastable to [..., Tq, Tk])

GAU:    out_i = Σ_j allowed_ij · relu²(q_i·k_j / N_q(i) + b_ij) · v_j       (no softmax, no sum-to-1)
FLASH:  out_i = Σ_{j: c(j)=c(i)} m_j relu²(q_i·k_j / C + β(ρ_j − ρ_i)) v_j  (local, inside chunks)
              + (1/N_g) Σ_{j ∈ G(i)} m_j (q̃_i·k̃_j) v_j                       (global, linear)
with G(i) = all j (bidirectional) or the chunks before c(i) (causal: exclusive prefix).
The gate (U ⊙ ·), the projections and the output layer live in the layer (layers/gau.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native, dense
from ._checks import (
    check_bool,
    check_key_padding_mask,
    check_positive_int,
    check_probability,
    check_right_padded,
    first_order_only,
)
from ._chunked import _exclusive_scan_cumsum
from ._dtypes import autocast_enabled, autocast_off
from ._projection import fused_projection_ok, project, project_backward, projection_dtype
from .norm_linear import state_dtype_for

QUAD_NORMALIZERS = ("seq_len", "fixed", "visible", "none")  # N_q, flash.md §1.1
GLOBAL_NORMALIZERS = ("visible", "chunk", "none")  # N_g, flash.md §3.4


def check_normalizer(name: str, allowed: tuple[str, ...], what: str) -> None:
    if name not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {name!r}")


def _check_single_head(heads: tuple[str, ...], **tensors) -> None:
    """Each tensor [B, T, X] with one B and T; the query/key ``heads`` also one width X (v its own)."""
    first = None
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
        if x.dim() != 3:
            raise ValueError(f"{name} must have layout [B, T, X] (single head), got shape {tuple(x.shape)}")
        if first is None:
            first = name
        elif x.shape[:2] != tensors[first].shape[:2]:  # a batch of 1 would broadcast: a silent wrong answer
            raise ValueError(f"{name} must have {first}'s [B, T] = {tuple(tensors[first].shape[:2])}, got "
                             f"{tuple(x.shape[:2])}")
    if tensors[heads[0]].shape[-1] < 1:
        raise ValueError(f"{heads[0]} must have a width >= 1, got shape {tuple(tensors[heads[0]].shape)}")
    for name in heads[1:]:
        if tensors[name].shape[-1] != tensors[heads[0]].shape[-1]:
            raise ValueError(f"{name} must have {heads[0]}'s width {tensors[heads[0]].shape[-1]}, got "
                             f"{tensors[name].shape[-1]}")


def _check_one_dtype(**tensors: torch.Tensor) -> None:
    """Outside autocast the heads and values must share one dtype (a matmul of two would fail)."""
    dtypes = {x.dtype for x in tensors.values()}
    if len(dtypes) > 1 and not autocast_enabled(next(iter(tensors.values())).device.type):
        raise TypeError(f"{', '.join(tensors)} must share one dtype outside autocast, "
                        f"got {sorted(str(d) for d in dtypes)}")


class _MaskedRelu2(torch.autograd.Function):
    """a = relu(s)² ⊙ allowed, saving one T×T tensor (r = relu(s) ⊙ allowed): da/ds = 2r.

    The composed ops would keep three T×T tensors alive for the backward (masked scores, relu
    output, square input); at 8k tokens each is 256 MB in fp32.
    """

    @staticmethod
    def forward(ctx, s, allowed):
        r = torch.relu(s)
        if allowed is not None:
            r = r.masked_fill_(~allowed, 0.0)
        ctx.save_for_backward(r)
        return r * r

    @staticmethod
    @first_order_only  # r is saved without its graph: a second derivative would lose d(2r)/ds
    def backward(ctx, grad):
        (r,) = ctx.saved_tensors
        return grad * r * 2.0, None


def relu2_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    allowed: torch.Tensor | None,
    norm: float | torch.Tensor = 1.0,
    bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Σ_j allowed_ij relu²(q_i·k_j / norm_i + bias_ij) v_j.

    q: [..., Tq, s]; k: [..., Tk, s]; v: [..., Tk, e]; allowed: [..., Tq, Tk] bool or None (all);
    norm: a number or [..., Tq, 1]; bias: broadcastable to [..., Tq, Tk]. Returns [..., Tq, e].
    Disallowed entries are exactly 0 (relu² has no normalising sum, so masking after is exact).
    """
    s = (q / norm) @ k.transpose(-1, -2)  # dividing q (T·s) is cheaper than the scores (T²)
    if bias is not None:
        s = s + bias.to(s.dtype)
    a = _MaskedRelu2.apply(s, allowed)
    if check_probability("dropout_p", dropout_p) > 0.0:
        a = F.dropout(a, p=dropout_p, training=True)
    return a @ v


_PREFIX_MATMUL_MAX_CHUNKS = 64
_EXPLICIT_BACKWARD = True  # _CausalFlashCore where it applies (tests switch it off to compare)
_FUSED_MIXER = True  # FLASH layers through _CausalFlashMixer where it applies (likewise)


def _exclusive_cumsum(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Sums over dim 1 (G >= 1 chunks) of the entries before each one (after it when ``reverse``)."""
    return _exclusive_scan_cumsum(x, None, reverse)[0]


def _global_branch(kg, vc, qg, valid, *, causal: bool, normalizer: str, acc=None) -> torch.Tensor:
    """FLASH's linear cross-chunk term, [B, G, C, e], from chunked heads kg, qg [B, G, C, s] and values
    vc [B, G, C, e]; ``valid`` [B, G, C] or None (every row a real token). With ``acc`` [B, G, C, e]
    (the local branch) returns acc + the term, the sum fused into the output product.

    Chunk states S_h = K_hᵀ V_h come from one batched product (in the autocast dtype under autocast,
    otherwise in fp32 for half inputs); the sums over chunks run in the state dtype (fp32 for half
    inputs: they add up to T terms, as in §1.1). The causal exclusive prefix, with N_g folded in,
    is one product of the states with a [G, G] lower-triangular weight matrix while G is small:
    cumsum over the chunk dim of [B, G, s, e] runs a slow strided loop (3.4 ms for 16 chunks of a
    128 x 1024 state here, the product well under 1 ms); beyond 64 chunks the product's G² cost
    wins and the prefix is an exclusive cumsum.
    """
    B, G, C, _ = kg.shape
    odt, sdt = vc.dtype, state_dtype_for(vc.dtype)
    amp = autocast_enabled(vc.device.type)
    if valid is not None:  # padded keys contribute nothing (zeroing K suffices: S = Σ k vᵀ)
        kg = kg.masked_fill(~valid[..., None], 0.0)
    if not amp:
        kg, vc, qg = kg.to(sdt), vc.to(sdt), qg.to(sdt)
    states = kg.transpose(-1, -2) @ vc  # [B, G, s, e]
    counts = (torch.full((B, G), float(C), dtype=sdt, device=vc.device) if valid is None
              else valid.to(sdt).sum(-1))  # real tokens per chunk
    with autocast_off(vc.device.type):
        states = states.to(sdt)
        scale = _chunk_scales(counts, causal=causal, normalizer=normalizer, C=C)
        if not causal:
            prefix = states.sum(1, keepdim=True) * scale[..., None, None]  # [B, 1, s, e]: every chunk sees all
        else:
            prefix = _prefix(states.flatten(2), scale).view(states.shape)
    if acc is not None and (amp or odt == sdt):  # autocast casts all three to its dtype
        prefix = prefix.expand(B, G, *prefix.shape[2:])
        return torch.baddbmm(acc.flatten(0, 1), qg.flatten(0, 1), prefix.flatten(0, 1)).view(acc.shape)
    glob = qg @ prefix if amp else (qg @ prefix).to(odt)
    return glob if acc is None else acc + glob.to(acc.dtype)


def _chunk_scales(counts: torch.Tensor, *, causal: bool, normalizer: str, C: int) -> torch.Tensor:
    """1/N_g from the real tokens per chunk ``counts`` [B, G]: [B, G] causal (the tokens of the
    chunks before each one; chunk 0 sees none), [B, 1] bidirectional (all of the row's)."""
    seen = _exclusive_cumsum(counts) if causal else counts.sum(1, keepdim=True)
    if normalizer == "visible":
        return 1.0 / seen.clamp_min(1)
    return torch.full_like(seen, 1.0 / C if normalizer == "chunk" else 1.0)


def _prefix(states: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """P_g = scale_g Σ_{h<g} S_h over dim 1 of states [B, G, n]; scales [G] or [B, G]."""
    G = states.shape[1]
    if G <= _PREFIX_MATMUL_MAX_CHUNKS:
        w = torch.ones(G, G, dtype=states.dtype, device=states.device).tril(-1) * scales[..., None]
        return w @ states
    return _exclusive_cumsum(states) * scales[..., None]


def _prefix_adjoint(dprefix: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """dS_h = Σ_{g>h} scale_g dP_g, the gradient of :func:`_prefix` ([B, G, n]; scales [G] or [B, G])."""
    G = dprefix.shape[1]
    if G <= _PREFIX_MATMUL_MAX_CHUNKS:
        w = torch.ones(G, G, dtype=dprefix.dtype, device=dprefix.device).tril(-1) * scales[..., None]
        return w.transpose(-1, -2) @ dprefix
    return _exclusive_cumsum(dprefix * scales[..., None], reverse=True)


def _by_chunk(C: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each [B, T, X] of ``xs`` as [B·G, C, X] (views where the rows allow it), G = T / C."""
    return tuple(x.reshape(x.shape[0] * (x.shape[1] // C), C, x.shape[-1]) for x in xs)  # (-1: not for width 0)


def _chunk_t(x: torch.Tensor, copy: bool) -> torch.Tensor:
    """x [n, R, C] transposed per chunk: a row-major copy (one native pass) with ``copy``, else a
    view. The callers copy what a product reads slowly or not at all: the right operand of the
    native fp32 GEMM (it streams rows of it; its left operand may be any view), the left operand
    of PyTorch's product (in bf16 a transposed view ran ~1.4x slower)."""
    return _native.cast_transpose(x.contiguous(), x.dtype) if copy else x.transpose(1, 2)


def _core_forward(ql, kl, qg, kg, v, bias, C: int, normalizer: str, ql_scaled: bool = False):
    """out [B, T, e] of both causal branches and what the backward keeps (see _CausalFlashCore).
    ``ql_scaled``: ql arrives divided by C already (the mixer folds 1/C into its heads)."""
    B, T, s = ql.shape
    e, G = v.shape[-1], T // C
    cdt, sdt = v.dtype, state_dtype_for(v.dtype)
    native = _native.rows_usable(cdt, v.device)
    with autocast_off(v.device.type):
        fast = dense.native_bmm_for(cdt, v.device)  # (read here: it asks whether autocast is on)
        qlc, klc, qgc, kgc, vc = _by_chunk(C, ql, kl, qg, kg, v)
        qs = qlc if ql_scaled else qlc / C
        scores = dense.bmm(qs, _chunk_t(klc, fast))  # [BG, C, C]
        if native:  # one pass (_native_flash.cpp), the same roundings
            r, a, at = _native.relu2_fwd(scores, bias, causal=True)
        else:
            if bias is not None:
                scores = scores + bias.to(cdt)
            tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
            r = torch.relu(scores).masked_fill_(~tril, 0.0)
            a = r * r
            at = a.transpose(1, 2).contiguous()  # dV's operand: a transposed view runs ~1.6x slower
        out = dense.bmm(a, vc)
        states = dense.bmm(_chunk_t(kgc, native and not fast), vc).view(B, G, s * e)
        full = torch.full((1, G), float(C), dtype=sdt, device=v.device)  # whole chunks, no padding
        scales = _chunk_scales(full, causal=True, normalizer=normalizer, C=C)[0]  # [G]
        if native:  # one pass, fp32 sums (_native_prefix.cpp)
            prefix = _native.chunk_prefix(states, scales, reverse=False).view(B * G, s, e)
        else:
            prefix = _prefix(states.to(sdt), scales).to(cdt).view(B * G, s, e)
        dense.bmm(qgc, prefix, out, accumulate=True)  # out is this function's own: no copy of it
    return out.view(B, T, e), (ql, kl, qg, kg, v, r, at, prefix, scales)


def _core_backward(saved, dout, C: int, bias_dtype, ql_scaled: bool = False):
    """(dheads [B, T, 4, s] = (dql, dkl, dqg, dkg) stored head-outer as heads_fwd stores the heads,
    dv [B, T, e], d bias [C, C] or None) from dout [B, T, e]; with ``ql_scaled``, dql is the
    gradient of ql / C (see _core_forward)."""
    ql, kl, qg, kg, v, r, at, prefix, scales = saved
    B, T, s = ql.shape
    e, G = v.shape[-1], T // C
    cdt, sdt = v.dtype, state_dtype_for(v.dtype)
    native = _native.rows_usable(cdt, v.device)
    with autocast_off(v.device.type):
        fast = dense.native_bmm_for(cdt, v.device)  # (read here: it asks whether autocast is on)
        g = dout.to(cdt).reshape(B * G, C, e)
        qlc, klc, qgc, kgc, vc = _by_chunk(C, ql, kl, qg, kg, v)
        # local branch: a = r² (r = relu(scores), 0 above the diagonal), da/dscores = 2r
        dv = dense.bmm(at, g)
        ds = dense.bmm(g, _chunk_t(vc, fast))
        ds = _native.relu2_bwd_(ds, r) if native else ds.mul_(r).mul_(2.0)
        dbias = None if bias_dtype is None else ds.sum(0).to(bias_dtype)
        # the four heads' gradients in one [4, B·T, s] block: each a contiguous product output
        dh = torch.empty(4, B * G, C, s, dtype=cdt, device=v.device)
        dql, dkl, dqg, dkg = dh.unbind(0)
        dense.bmm(ds, klc, dql)
        if not ql_scaled:
            dql.div_(C)
        dense.bmm(ds.transpose(1, 2), qlc if ql_scaled else qlc / C, dkl)
        # global branch: out += Qg P, P = prefix of the chunk states S = Kgᵀ V
        dense.bmm(g, _chunk_t(prefix, fast), dqg)
        dprefix = dense.bmm(_chunk_t(qgc, native and not fast), g).view(B, G, s * e)
        if native:
            dstates = _native.chunk_prefix(dprefix, scales, reverse=True).view(B * G, s, e)
        else:
            dstates = _prefix_adjoint(dprefix.to(sdt), scales).to(cdt).view(B * G, s, e)
        dense.bmm(vc, _chunk_t(dstates, fast), dkg)
        dense.bmm(kgc, dstates, dv, accumulate=True)
    return dh.view(4, B, T, s).permute(1, 2, 0, 3), dv.view(B, T, e), dbias


class _CausalFlashCore(torch.autograd.Function):
    """Both FLASH branches, causal, for whole chunks without padding or dropout, with the
    backward written out: the same products and roundings as the autograd form (the oracle),
    but dV gets both branches' terms from its products (dV = Aᵀ dO, then += K_g dS) where
    autograd adds two [T, e] gradients in a separate pass, and the reshaped gradients are not
    copied again. At T = 4096 (e = 1024, s = 128, C = 256, bf16) that pass and the copies were
    about a fifth of the layer's attention time.

    ql, kl, qg, kg: [B, T, s]; v: [B, T, e]; one floating dtype (the compute dtype: autocast's,
    or fp32/fp64); T a multiple of C; bias [C, C] or None. Returns [B, T, e].
    """

    @staticmethod
    def forward(ctx, ql, kl, qg, kg, v, bias, C: int, normalizer: str):
        out, saved = _core_forward(ql, kl, qg, kg, v, bias, C, normalizer)
        ctx.save_for_backward(*saved)
        ctx.C, ctx.bias_dtype = C, None if bias is None else bias.dtype
        return out

    @staticmethod
    @first_order_only
    def backward(ctx, dout):
        dheads, dv, dbias = _core_backward(ctx.saved_tensors, dout, ctx.C, ctx.bias_dtype)
        return (*dheads.unbind(2), dv, dbias, None, None)


class _CausalFlashMixer(torch.autograd.Function):
    """A causal FLASH layer from its input projection to the gated output, for the CPU kernels:
    pre = x Wᵀ, [u | v | z] = silu(pre + b), heads = RoPE(z γ_h + β_h), y = u ⊙ (both branches).

    One Function so that u is never materialised: the gate reads the pre-activation
    (``_native.silu_mul_fwd``) and, backward, writes its block of d(pre) and of d(b) itself, the
    split SiLU writing the v and z blocks beside it. The projection is inside so that those kernels
    also write d(pre)ᵀ for W's gradient: dW = d(pre)ᵀ x ran at ~1 TFLOP/s on a transposed view of
    d(pre) against ~2 on a contiguous d(pre)ᵀ (bf16, T = 4096, 512 → 2176), and the forward reads
    Wᵀ contiguous, made in the pass that casts W anyway. The composed forms (F.linear, silu_split,
    heads, _CausalFlashCore, u * o) are the oracle.

    x: [B, T, d] (fp32 or bf16); weight: [2e + s, d] (fp32 or bf16); cdt: the compute dtype
    (autocast's, or x's); bias: fp32 [2e + s]; gamma, beta: fp32 [4, s]; cos, sin: fp32 [B, T, P]
    contiguous; local_bias [C, C] or None. Returns y [B, T, e] in cdt.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, gamma, beta, cos, sin, local_bias, e: int, C: int, normalizer: str, cdt):
        B, T, d = x.shape
        W = weight.shape[0]
        s = W - 2 * e
        with autocast_off(x.device.type):
            x2, wt, pre = project(x, weight, cdt)
            pre = pre.view(B, T, W)
            pu, pvz = pre[..., :e], pre[..., e:]
            v, z = _native.silu_split_fwd(pvz, [e, s], bias[e:])
            # the local queries' 1/C folded into their scale and offset (RoPE is linear): ql / C
            # comes out of the heads kernel, rounded once, with no division pass either way
            gamma, beta = _scaled_first_head(gamma, 1.0 / C), _scaled_first_head(beta, 1.0 / C)
            heads = _native.heads_fwd(z, gamma, beta, cos, sin, cdt)  # [B, T, 4, s], head-outer
            o, saved = _core_forward(*heads.unbind(2), v, local_bias, C, normalizer, ql_scaled=True)
            y = _native.silu_mul_fwd(pu, bias[:e], o)
        ctx.save_for_backward(x2, wt, pre, bias, gamma, cos, sin, z, o, *saved)
        ctx.e, ctx.C, ctx.bias_dtype = e, C, None if local_bias is None else local_bias.dtype
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        return y

    @staticmethod
    @first_order_only
    def backward(ctx, dy):
        x2, wt, pre, bias, gamma, cos, sin, z, o, *saved = ctx.saved_tensors
        e = ctx.e
        N, W = x2.shape[0], pre.shape[-1]
        s = W - 2 * e
        dpre = torch.empty_like(pre)
        # d(pre)ᵀ [W, N], written by the same kernels from the same rounded values
        dpre_t = torch.empty(W, N, dtype=pre.dtype) if ctx.needs_input_grad[1] else None
        do, db_u = _native.silu_mul_bwd(pre[..., :e], bias[:e], o, dy.to(pre.dtype).contiguous(), dpre[..., :e],
                                        bias_grad=True, dpre_t=None if dpre_t is None else dpre_t[:e])
        dheads, dv, dlocal = _core_backward(saved, do, ctx.C, ctx.bias_dtype, ql_scaled=True)
        dz, dgamma, dbeta = _native.heads_bwd(z, gamma, cos, sin, dheads)
        dgamma, dbeta = _scaled_first_head(dgamma, 1.0 / ctx.C), _scaled_first_head(dbeta, 1.0 / ctx.C)
        _, db_vz = _native.silu_split_bwd(pre[..., e:], [dv, dz], [e, s], bias[e:], bias_grad=True,
                                          dpre=dpre[..., e:], dpre_t=None if dpre_t is None else dpre_t[e:])
        dx, dw = project_backward(dpre.view(N, W), dpre_t, x2, wt, x_shape=ctx.x_shape, x_dtype=ctx.x_dtype,
                                  w_dtype=ctx.w_dtype, need_x=ctx.needs_input_grad[0])
        return (dx, dw, torch.cat((db_u, db_vz)), dgamma, dbeta, None, None, dlocal, None, None, None, None)


def _scaled_first_head(p: torch.Tensor, c: float) -> torch.Tensor:
    """p [n, s] with its first row (the local queries' head) times c: a copy."""
    p = p.clone()
    p[0] *= c
    return p


def causal_flash_mixer(x, weight, bias, gamma, beta, cos, sin, local_bias, *, e: int, chunk_size: int,
                       normalizer: str) -> torch.Tensor:
    """u ⊙ FLASH(heads, v) for a causal layer without padding or dropout, T a multiple of the chunk
    size, from the layer input ``x`` [B, T, d], the projection's ``weight`` [2e + s, d] and its
    ``bias``; see :class:`_CausalFlashMixer` for the shapes. The caller checks
    :func:`flash_mixer_usable`."""
    return _CausalFlashMixer.apply(x, weight, bias.contiguous(), gamma.contiguous(), beta.contiguous(),
                                   cos.float().expand(x.shape[0], -1, -1).contiguous(),
                                   sin.float().expand(x.shape[0], -1, -1).contiguous(), local_bias, e, chunk_size,
                                   normalizer, projection_dtype(x))


def flash_mixer_usable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`causal_flash_mixer` can take ``x`` [B, T, d] and the projection ``weight``,
    ``bias``: the CPU kernels for the compute dtype, fp32 or bf16 operands (of one dtype without
    autocast, as F.linear needs), an fp32 bias. "auto" leaves it to the composed form on builds
    where it ran slower (_native.rows_usable, family "flash_mixer": bf16 without AVX-512, fp32
    without AVX2)."""
    return (_FUSED_MIXER and bias is not None and bias.dtype == torch.float32 and x.numel() > 0
            and _native.rows_usable(projection_dtype(x), x.device, "flash_mixer")
            and fused_projection_ok(x, weight, bias))


def quad_normalizer(mode: str, *, causal: bool, valid: torch.Tensor, fixed_len: int, dtype: torch.dtype):
    """N_q per query row (flash.md §1.1) for a batch with key validity ``valid`` [B, T].

    seq_len: T_v of the row; fixed: ``fixed_len``; visible: valid keys the row can see (causal:
    valid j ≤ i, i.e. its position + 1; bidirectional: T_v); none: 1. Returns a number, [B, T, 1]
    (causal visible) or [B, 1, 1] (seq_len, bidirectional visible).
    """
    check_normalizer(mode, QUAD_NORMALIZERS, "normalizer")
    if mode == "fixed":
        return float(fixed_len)
    if mode == "none":
        return 1.0
    counts = valid.to(dtype)
    if mode == "visible" and causal:
        return counts.cumsum(-1).clamp_min(1)[..., None]
    return counts.sum(-1).clamp_min(1)[:, None, None]


def gau_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    normalizer: str = "seq_len",
    fixed_len: int = 512,
    bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """FLASH-Quad attention A V with A = relu²(Q Kᵀ / N_q + B) (⊙ tril), padded keys removed.

    q, k: [B, T, s]; v: [B, T, e]; bias: [T, T] or [B, T, T] (b_ij, added after the division).
    O(T²) time and memory. Returns [B, T, e].
    """
    check_bool("causal", causal)  # (a string "false" had run the causal form, None the bidirectional one)
    _check_single_head(("q", "k"), q=q, k=k, v=v)
    _check_one_dtype(q=q, k=k, v=v)
    if normalizer == "fixed":  # (the divisor; other normalizers do not read it)
        check_positive_int("fixed_len", fixed_len)
    check_probability("dropout_p", dropout_p)
    B, T, _ = q.shape
    mask = check_key_padding_mask(key_padding_mask, B, T)
    if bias is not None and (bias.dim() not in (2, 3) or bias.shape[-2:] != (T, T)
                             or (bias.dim() == 3 and bias.shape[0] not in (1, B))):
        raise ValueError(f"bias must have shape [T, T] or [B, T, T] with T = {T}, B = {B}, got {tuple(bias.shape)}")
    valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask is None else mask
    allowed = None
    if mask is not None:
        allowed = mask[:, None, :].expand(B, T, T)
        v = v.masked_fill(~mask[..., None], 0.0)  # padded values could be non-finite: 0 · NaN is NaN
    if causal:
        tril = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        allowed = tril.expand(B, T, T) if allowed is None else allowed & tril
    norm = quad_normalizer(normalizer, causal=causal, valid=valid, fixed_len=fixed_len, dtype=q.dtype)
    return relu2_attention(q, k, v, allowed=allowed, norm=norm, bias=bias, dropout_p=dropout_p)


def flash_attn(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    q_global: torch.Tensor,
    k_global: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    chunk_size: int = 256,
    normalizer: str = "visible",
    local_bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    local_branch: bool = True,
    global_branch: bool = True,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """FLASH mixed chunk attention (flash.md §3.2–§3.4, §4). Linear in T for a fixed C.

    Args:
        q_local, k_local: [B, T, s] heads of the quadratic in-chunk branch.
        q_global, k_global: [B, T, s] heads of the linear cross-chunk branch.
        v: [B, T, e] values, shared by both branches.
        chunk_size: C. T is padded to a multiple of C with invalid rows (any T is accepted);
            chunks are by index, so rows must be right-padded (the model guarantees it).
        normalizer: global N_g: ``visible`` (non-causal: T_v; causal: valid tokens in the chunks
            before, chunk 0 gets no global term), ``chunk`` (C) or ``none`` (1).
        local_bias: [C, C] with entry [ρ_i, ρ_j] = β(ρ_j − ρ_i), or None.
        key_padding_mask: [B, T], True = valid; padded rows of K^l and V are zeroed before the
            chunk states are formed, and padded keys get A_ij = 0 in the local branch.

    Returns:
        [B, T, e] = local + global (before the U gate).
    """
    check_bool("causal", causal)  # (a string "false" had run the causal form, None the bidirectional one)
    _check_single_head(("q_local", "k_local", "q_global", "k_global"), q_local=q_local, k_local=k_local,
                       q_global=q_global, k_global=k_global, v=v)
    check_positive_int("chunk_size", chunk_size)
    check_normalizer(normalizer, GLOBAL_NORMALIZERS, "global normalizer")
    check_probability("dropout_p", dropout_p)
    if not (local_branch or global_branch):
        raise ValueError("flash_attn needs at least one of local_branch, global_branch")
    B, T, s = q_local.shape
    e = v.shape[-1]
    C = chunk_size
    mask = check_key_padding_mask(key_padding_mask, B, T)
    check_right_padded(mask, "FLASH")  # (§4.6: chunk boundaries would differ per row)
    valid = torch.ones(B, T, dtype=torch.bool, device=v.device) if mask is None else mask
    if local_bias is not None and local_bias.shape != (C, C):
        raise ValueError(f"local_bias must have shape [C, C] = {(C, C)}, got {tuple(local_bias.shape)}")
    G = max(1, -(-T // C))
    pad = G * C - T
    amp = autocast_enabled(v.device.type)
    # (the fused path would cast them all to v's dtype silently)
    _check_one_dtype(q_local=q_local, k_local=k_local, q_global=q_global, k_global=k_global, v=v)
    if (causal and local_branch and global_branch and mask is None and pad == 0 and dropout_p == 0.0
            and _EXPLICIT_BACKWARD and _native.backend() != "torch"
            and (amp or v.dtype in (torch.float32, torch.float64))):
        cdt = torch.get_autocast_dtype(v.device.type) if amp else v.dtype
        xs = (x.to(cdt) for x in (q_local, k_local, q_global, k_global, v))
        return _CausalFlashCore.apply(*xs, local_bias, C, normalizer).to(v.dtype)
    if pad:
        q_local, k_local, q_global, k_global, v = (F.pad(x, (0, 0, 0, pad)) for x in
                                                   (q_local, k_local, q_global, k_global, v))
        valid = F.pad(valid, (0, pad), value=False)
    if mask is not None:  # spec §4.3: padded V rows are zero too (a weight of 0 times a NaN there is NaN)
        v = v.masked_fill(~valid[..., None], 0.0)
    vc = v.reshape(B, G, C, e).contiguous()  # v is a slice of the projection: one copy here, none per product
    holes = mask is not None or pad > 0  # some rows are not real tokens
    out = None

    if local_branch:
        allowed = valid.reshape(B, G, 1, C)
        if causal:
            allowed = allowed & torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        else:
            allowed = allowed.expand(B, G, C, C)
        out = relu2_attention(q_local.reshape(B, G, C, s), k_local.reshape(B, G, C, s), vc,
                              allowed=allowed, norm=float(C), bias=local_bias, dropout_p=dropout_p)

    if global_branch:
        out = _global_branch(k_global.reshape(B, G, C, s), vc, q_global.reshape(B, G, C, s),
                             valid.reshape(B, G, C) if holes else None, causal=causal, normalizer=normalizer, acc=out)
    # under autocast the products come back in the autocast dtype: return v's dtype, as documented
    return out.reshape(B, G * C, e)[:, :T].to(v.dtype)
