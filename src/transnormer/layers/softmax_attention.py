"""Vanilla multi-head softmax attention (the quadratic baseline), optionally with RoPE.

Same projections, heads and init as NormAttention so that a comparison changes only the
attention rule: RoPE off + sinusoidal positions = the paper's "Vanilla Transformer"; RoPE on =
"Transformer+" (add ``ffn_type="glu"`` for "Transformer++").
"""

from __future__ import annotations

import math

import torch

from ..modules.positional import build_lrpe
from ..ops._checks import check_bool, check_probability
from ..ops.softmax import softmax_attn, softmax_attn_cached
from .base import MultiHeadMixer, mask_and_positions, reads_given_cache, with_cache, zero_padded


class SoftmaxAttention(MultiHeadMixer):
    """softmax(Q Kᵀ / √e) V per head through ``ops.softmax_attn`` (SDPA; on CPU the fused kernels, see
    ``ops.softmax_attn``); x: [B, T, d] → [B, T, d].

    ``rope``: rotate-half RoPE (θ_i = 10000^{-2i/e}) on q and k at the real-token positions.
    Decoding keeps a KV cache (``cache = {"k", "v", "valid"}``, keys stored after RoPE), whose
    size grows with the sequence: the cost the linear baselines avoid.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        *,
        causal: bool,
        rope: bool = False,
        attention_dropout: float = 0.0,
    ):
        super().__init__()
        check_bool("rope", rope)
        self.causal = check_bool("causal", causal)  # (a string "false" had run a causal layer)
        self.attention_dropout = check_probability("attention_dropout", attention_dropout)
        self._build_projections(hidden_size, num_heads)
        self.rope = build_lrpe("rope", self.head_dim, pairing="half") if rope else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # fairseq MultiheadAttention (the paper's vanilla baseline) and our NormAttention alike.
        self._reset_projections(qkv_gain=1 / math.sqrt(2))

    def featurize(self, x: torch.Tensor, positions: torch.Tensor):
        """q, k (RoPE'd if enabled), v: [B, T, H, e]."""
        q, k, v = self._project(x)
        if self.rope is not None:
            q, k = self.rope(q, positions), self.rope(k, positions)
        return q, k, v

    @reads_given_cache
    def forward(self, x, *, attention_mask=None, positions=None, cache=None, use_cache=False):
        mask, positions = mask_and_positions(x, attention_mask, positions, cache, hidden_size=self.hidden_size)
        B, T, _ = x.shape
        q, k, v = self.featurize(x, positions)
        if not use_cache:
            o = softmax_attn(q, k, v, causal=self.causal, key_padding_mask=mask,
                             dropout_p=self.attention_dropout if self.training else 0.0)
            return self.out_proj(o.reshape(B, T, self.hidden_size)), None
        if not self.causal:
            raise ValueError("use_cache needs a causal SoftmaxAttention (decoding is causal)")
        valid = torch.ones(B, T, dtype=torch.bool, device=x.device) if mask is None else mask
        k, v = zero_padded(mask, k, v)
        seq = with_cache(cache, k=k, v=v, valid=valid)
        k, v, valid = seq["k"], seq["v"], seq["valid"]
        o = softmax_attn_cached(q, k, v, key_valid=valid, query_offset=k.shape[1] - T)
        if mask is not None:
            o = o.masked_fill(~mask[:, :, None, None], 0.0)  # padded queries: 0, as in the full forward
        return self.out_proj(o.reshape(B, T, self.hidden_size)), {"k": k, "v": v, "valid": valid}
