"""NormAttention core: kernelized linear attention with no denominator and no scaling.

All functions take already-featurised ``q`` and ``k`` (the kernel and LRPE are applied by the
layer) and raw ``v``:

    q, k: [B, T, H, D]     v: [B, T, H, E]     state: [B, H, D, E]

Bidirectional:  o_i = q_i · Σ_j m_j k_jᵀ v_j
Causal:         o_i = q_i · Σ_{j≤i} m_j k_jᵀ v_j  (+ q_i · S_init)

The causal form is chunked (spec §1.1(b)): inside a chunk of ``c`` rows a masked c×c product,
across chunks an exclusive prefix sum of per-chunk states. Cost O(T·c·D + T·D·E), linear in T.
The state is accumulated in float32 when activations are bf16/fp16: with no denominator and no
decay it grows linearly in T, and the norm after the core only removes its scale through ε.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _native
from ._checks import check_bool, check_key_padding_mask, check_positive_int, check_qkv, check_step_mask
from ._chunked import ChunkedCausalLinearAttn
from ._dtypes import autocast_off, state_dtype_for


def _check_state(state: torch.Tensor, batch: int, heads: int, d: int, e: int, name: str) -> None:
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(state).__name__}")
    if not state.is_floating_point():
        raise TypeError(f"{name} must be floating point, got {state.dtype}")
    if state.shape != (batch, heads, d, e):
        raise ValueError(f"{name} must have shape [B, H, D, E] = {(batch, heads, d, e)}, got {tuple(state.shape)}")


def _apply_key_mask(k, v, key_padding_mask):
    mask = check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[1])
    if mask is None:
        return k, v
    # zeroed, not multiplied: a padded key or value holding inf/NaN would otherwise put 0·inf = NaN
    # into the state every later (or, bidirectional, every) query reads
    pad = ~mask[:, :, None, None]
    return k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)


def norm_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention without denominator, causal (chunked) or bidirectional.

    Args:
        q, k: [B, T, H, D] featurised queries and keys.
        v: [B, T, H, E] values.
        causal: lower-triangular (j ≤ i) if True, all keys otherwise.
        chunk_size: rows per chunk of the causal form (any T is accepted).
        initial_state: optional [B, H, D, E] prefix state S_init (e.g. from an earlier segment).
        output_final_state: also return S_init + Σ_j m_j k_jᵀ v_j.
        key_padding_mask: optional [B, T], True/1 = valid token; padded keys contribute nothing.

    Returns:
        (o [B, T, H, E] in the dtype of q, final_state [B, H, D, E] or None).
    """
    check_bool("causal", causal)  # (a string "false" had run the causal form, None the bidirectional one)
    check_qkv(q, k, v)
    check_positive_int("chunk_size", chunk_size)
    B, T, H, D = q.shape
    E = v.shape[-1]
    if initial_state is not None:
        _check_state(initial_state, B, H, D, E, "initial_state")
    if q.dtype == torch.float16:
        # fp16 in fp32 throughout: the state's sums grow with the keys and left fp16's range (65504)
        # when the products read it back in fp16 (inf from a few thousand tokens); the output is
        # rounded once to fp16, as the decoding step (norm_linear_attn_step) already did
        o, final = norm_linear_attn(q.float(), k.float(), v.float(), causal=causal, chunk_size=chunk_size,
                                    initial_state=initial_state, output_final_state=output_final_state,
                                    key_padding_mask=key_padding_mask)
        return o.to(q.dtype), final
    k, v = _apply_key_mask(k, v, key_padding_mask)
    sdt = state_dtype_for(q.dtype)
    init = None if initial_state is None else initial_state.to(sdt)

    kernels_apply = q.numel() > 0 and v.numel() > 0 and (init is None or init.device.type == "cpu")
    if not causal and kernels_apply and _native.backend() == "native" and _native.upcast_usable(q, k, v):
        # bf16 without a bf16 kernel where kernels are required: the fp32 kernel on copies (in
        # "auto" the PyTorch bf16 GEMMs below are faster: 3.8 vs 5.4 ms at T = 4k)
        o, final = _native.native_bidir_linear_attn(q.float(), k.float(), v.float(), init)
        return o.to(q.dtype), (final if output_final_state else None)
    if not causal and kernels_apply and _native.bidir_usable(q, k, v):
        # Fused CPU kernels: S, then O = Q S, chunk by chunk in place (bf16: ops/_native_amx.cpp)
        o, final = _native.native_bidir_linear_attn(q, k, v, init)
        return o, (final if output_final_state else None)
    if not causal:
        # The fallback and GPU path: two GEMMs per head on [B, H, T, D] views. Half-precision
        # operands are made contiguous first: oneDNN's bf16 GEMMs on the strided views ran 4.7x
        # slower (T=4096, fwd+bwd); fp32 is fastest on the views (MKL takes the strides; a copy
        # costs more than it saves).
        # Autocast off, as in the causal form and the kernels: the op computes in its inputs'
        # dtype (the layers cast them) and keeps the state in the state dtype.
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
        if q.dtype in (torch.float16, torch.bfloat16):
            qh, kh, vh = qh.contiguous(), kh.contiguous(), vh.contiguous()
        with autocast_off(q.device.type):
            state = (kh.transpose(-1, -2) @ vh).to(sdt)
            if init is not None:
                state = state + init
            o = (qh @ state.to(q.dtype)).transpose(1, 2)
        return o, (state if output_final_state else None)

    if T == 0:  # an empty segment: no output, the state passes through
        final = init if init is not None else q.new_zeros(B, H, D, E, dtype=sdt)
        # (an empty product of the inputs, so that the output stays in the graph as the other forms')
        return (q.sum() * 0 + v).to(q.dtype), (final if output_final_state else None)
    c = min(chunk_size, T)
    if kernels_apply and c > _native.MAX_KERNEL_CHUNK and _native.backend() == "native":
        raise ValueError(f"backend 'native': the causal kernels take chunk_size <= {_native.MAX_KERNEL_CHUNK} "
                         f"(their c x c tiles per thread), got {chunk_size} (T = {T})")
    if kernels_apply and c <= _native.MAX_KERNEL_CHUNK:
        # Fused CPU kernels, the same chunked math tile by tile with no layout copies: bf16 on AMX
        # tiles or AVX512-BF16 (ops/_native_amx.cpp; it zero-pads a short last chunk, so its chunk
        # is a multiple of 32 rows, at most T rounded up), fp32/fp64 on AVX-512
        # (ops/_native_linear_attn.cpp). The PyTorch form below is the fallback and the GPU path.
        bf16_chunk = min(chunk_size, -(-T // 32) * 32)
        if _native.upcast_usable(q, k, v):  # (only without a bf16 kernel: never beside it)
            # bf16 where the bf16 kernel cannot run (AVX-512 without AVX512-BF16): the fp32 kernel on
            # fp32 copies beats the PyTorch bf16 form (fp32 math, the output rounds once to bf16;
            # autograd casts the gradients back)
            o, final = _native.native_causal_linear_attn(q.float(), k.float(), v.float(), init, chunk=c)
            return o.to(q.dtype), (final if output_final_state else None)
        kernel_chunk = bf16_chunk if _native.bf16_usable(q, k, v, chunk_size) else c if _native.usable(q, k, v) else 0
        if kernel_chunk:
            o, final = _native.native_causal_linear_attn(q, k, v, init, chunk=kernel_chunk)
            return o, (final if output_final_state else None)
    G = -(-T // c)
    pad = G * c - T
    if pad:
        # F.pad pads trailing dims first: (D), (H), then T.
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))

    def to_chunks(x):  # [B, T', H, X] -> [B·H, G, c, X], contiguous
        return x.permute(0, 2, 1, 3).reshape(B * H, G, c, x.shape[-1])

    init_flat = None if init is None else init.reshape(B * H, D, E)
    o, final = ChunkedCausalLinearAttn.apply(to_chunks(q), to_chunks(k), to_chunks(v), init_flat, sdt)
    o = o.reshape(B, H, G * c, E).permute(0, 2, 1, 3)[:, :T]
    final = final.reshape(B, H, D, E) if output_final_state else None
    return o, final


def norm_linear_attn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    *,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent decoding step, inclusive of the current token (spec §1.1(c)).

        S_t = S_{t-1} + m_t k_tᵀ v_t,   o_t = q_t S_t

    Args:
        q, k: [B, H, D] the current token's featurised query and key.
        v: [B, H, E] its value.
        state: [B, H, D, E] or None (zero state).
        key_padding_mask: optional [B], True/1 = the token is real.

    Returns:
        (o [B, H, E] in q's dtype, new state [B, H, D, E] in fp32 for half inputs).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
        if x.dim() != 3:
            raise ValueError(f"{name} must have layout [B, H, D] for one step, got shape {tuple(x.shape)}")
    if q.shape != k.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [B, H, D] and v [B, H, E] with the same B, H; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:  # as norm_linear_attn: one would be rounded to another silently
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, D = q.shape
    E = v.shape[-1]
    sdt = state_dtype_for(q.dtype)
    if state is None:
        state = torch.zeros(B, H, D, E, dtype=sdt, device=q.device)
    else:
        _check_state(state, B, H, D, E, "state")
    mask = check_step_mask(key_padding_mask, B)
    kv = k.to(sdt)[..., :, None] * v.to(sdt)[..., None, :]
    if mask is not None:  # (masked_fill: a padded token's inf/NaN must not reach the state)
        kv = kv.masked_fill(~mask[:, None, None, None], 0.0)
    state = state.to(sdt) + kv
    o = torch.einsum("bhd,bhde->bhe", q.to(sdt), state).to(q.dtype)
    return o, state
