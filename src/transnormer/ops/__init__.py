"""Pure tensor functions on [B, T, H, D] layouts: fast forms beside their references."""

from .block import block_attn
from .norm_linear import norm_linear_attn, norm_linear_attn_step, state_dtype_for
from .reference import block_attn_reference, norm_linear_attn_reference

__all__ = [
    "block_attn",
    "block_attn_reference",
    "norm_linear_attn",
    "norm_linear_attn_reference",
    "norm_linear_attn_step",
    "state_dtype_for",
]
