"""cosFormer attention (Qin et al., ICLR 2022): ReLU features with a cos re-weighting.

    w_ij = relu(q_i)·relu(k_j) · cos(π/2 · (p_i − p_j) / M),   o_i = Σ_j w_ij v_j / (Σ_j w_ij + eps)

decomposed as cos(θ_i − θ_j) = cos θ_i cos θ_j + sin θ_i sin θ_j, θ_p = π/2 · p / M, so the
features [relu(x) cos θ_p, relu(x) sin θ_p] (width 2e) run through the linear-time core.
Positions p are real-token positions (padding does not shift them).

M ("max_len"): a fixed number, or ``None`` = the row's own number of real tokens (the
paper's M = sequence length, made padding-invariant). Causal layers need a fixed M (the row
length is unknown while decoding and would make outputs depend on the future); the builder
uses ``max_position_embeddings``. Positions must stay below M: beyond, |p_i − p_j| could exceed
M, the weights turn negative and the denominator can vanish, so the layer raises instead.
"""

from __future__ import annotations

import torch

from ..ops.linear_baselines import DEFAULT_EPS, check_cosformer_positions, cosformer_features
from .linear_attention import KernelLinearAttention


class CosFormerAttention(KernelLinearAttention):
    """cosFormer with denominator; x: [B, T, d] → [B, T, d]. Decoding: one [B, H, 2e, e+1] state."""

    def __init__(self, hidden_size: int, num_heads: int, *, causal: bool, max_len: int | None = None,
                 eps: float = DEFAULT_EPS, chunk_size: int = 64):
        super().__init__(hidden_size, num_heads, causal=causal, denominator=True, eps=eps, chunk_size=chunk_size)
        if max_len is None and causal:
            raise ValueError("a causal cosFormer needs a fixed max_len M (the sequence length is unknown while decoding)")
        if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"max_len must be None or an int >= 1, got {max_len!r}")
        self.max_len = max_len
        self.reset_parameters()

    def feature_map(self, q, k, positions, mask):
        if self.max_len is None:
            B, T = q.shape[:2]
            # (a row of padding alone, length 0, gets M = 1 in cosformer_angles)
            M = torch.full((B,), T, device=q.device) if mask is None else mask.sum(-1)
        else:
            M = self.max_len
            check_cosformer_positions(positions, M, mask, q.shape[0], q.shape[1], from_zero=True,
                                      hint="; raise layer_options['cosformer']['max_len']")
        return cosformer_features(q, positions, M), cosformer_features(k, positions, M)

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, causal={self.causal}"
