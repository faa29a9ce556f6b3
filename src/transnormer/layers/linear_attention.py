"""Kernelized linear attention with the row-sum denominator (the "1+elu" baseline) and the
shared machinery of every "features, then ratio" baseline (Performer, cosFormer).

    o_i = Σ_{j∈V(i)} (φq_i·φk_j) v_j / (Σ_{j∈V(i)} φq_i·φk_j + eps),   then W_o

No norm after the core: the denominator IS the normalisation that TransNormer replaces with a
norm. ``denominator=False`` removes it and leaves nothing in its place (spec §9, Table 1: the
"1+elu without scaling" model whose training diverges); reach it through
``layer_options={"linear_elu": {"denominator": False}}`` or the ``linear-elu-noscale-*`` presets.
"""

from __future__ import annotations

import math

import torch

from ..ops._checks import check_bool, check_positive_int
from ..ops.linear_baselines import DEFAULT_EPS, kernel_linear_attn, kernel_linear_attn_step
from .base import MultiHeadMixer, mask_and_positions
from .norm_attention import get_kernel


class KernelLinearAttention(MultiHeadMixer):
    """Base of the linear baselines: projections, heads, the ratio core and the decoding state.

    Subclasses implement :meth:`feature_map`. Causal forward is chunked (linear in T);
    decoding carries one [B, H, F, e + 1] state per layer (Σ φk vᵀ beside Σ φk; [B, H, F, e]
    without the denominator), constant in T.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        causal: bool,
        denominator: bool = True,
        eps: float = DEFAULT_EPS,
        chunk_size: int = 64,
    ):
        super().__init__()
        check_bool("denominator", denominator)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            # > 0 keeps rows with no visible key at 0 instead of 0/0; 0 divides exactly (ops.linear_baselines)
            raise ValueError(f"eps must be a number >= 0, got {eps!r}")
        check_positive_int("chunk_size", chunk_size)
        self.causal = check_bool("causal", causal)  # (a string "false" had run a causal layer)
        self.denominator, self.eps, self.chunk_size = denominator, eps, chunk_size
        self._build_projections(hidden_size, num_heads)

    def reset_parameters(self) -> None:
        # As NormAttention (spec §1 init), so the baselines differ only in the attention rule.
        self._reset_projections(qkv_gain=1 / math.sqrt(2))

    def feature_map(self, q, k, positions, mask):
        """q, k: [B, T, H, e] → (φq, φk): [B, T, H, F]."""
        raise NotImplementedError

    def featurize(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None):
        """(φq, φk) [B, T, H, F] and v [B, T, H, e] (cast to the features' dtype)."""
        q, k, v = self._project(x)
        qf, kf = self.feature_map(q, k, positions, mask)
        return qf, kf, v.to(qf.dtype)

    def forward(self, x, *, attention_mask=None, positions=None, cache=None, use_cache=False):
        mask, positions = mask_and_positions(x, attention_mask, positions, cache, hidden_size=self.hidden_size)
        B, T, _ = x.shape
        if use_cache and not self.causal:
            raise ValueError(f"use_cache needs a causal {type(self).__name__} (decoding is causal)")
        qf, kf, v = self.featurize(x, positions, mask)
        state = None if cache is None else cache.get("state")
        kw = {"denominator": self.denominator, "eps": self.eps}
        if use_cache and T == 1 and state is not None:
            o, state = kernel_linear_attn_step(qf[:, 0], kf[:, 0], v[:, 0], state,
                                               key_padding_mask=None if mask is None else mask[:, 0], **kw)
            o = o[:, None]
        else:
            o, state = kernel_linear_attn(qf, kf, v, causal=self.causal, chunk_size=self.chunk_size,
                                          key_padding_mask=mask, initial_state=state,
                                          output_final_state=use_cache, **kw)
        o = o.to(x.dtype).reshape(B, T, self.hidden_size)
        return self.out_proj(o), ({"state": state} if use_cache else None)


class LinearAttention(KernelLinearAttention):
    """Katharopoulos et al. (2020) linear attention, φ = 1 + elu by default; x: [B, T, d].

    ``kernel``: any NormAttention kernel (``1+elu``, ``relu``, ``elu``, ``silu``); the ratio is
    a weighted mean only for non-negative kernels (1+elu, relu). No positional encoding inside
    (the paper's baseline relies on the absolute positions of the embedding); RoPE on the
    features is deliberately not offered: it makes φq·φk signed, and the denominator can then
    cross zero.
    """

    def __init__(self, hidden_size: int, num_heads: int, *, causal: bool, kernel: str = "1+elu", **kw):
        super().__init__(hidden_size, num_heads, causal=causal, **kw)
        self.kernel_name, self.kernel = kernel, get_kernel(kernel)
        self.reset_parameters()

    def feature_map(self, q, k, positions, mask):
        return self.kernel(q), self.kernel(k)
