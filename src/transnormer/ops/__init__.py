"""Pure tensor functions on [B, T, H, D] layouts: fast forms beside their references."""

from ._native import backend as kernel_backend
from ._native import set_backend as set_kernel_backend
from .block import block_attn
from .flash import flash_attn, gau_attn, relu2_attention
from .linear_baselines import cosformer_attn, favor_features, kernel_linear_attn, kernel_linear_attn_step
from .norm_linear import norm_linear_attn, norm_linear_attn_step, state_dtype_for
from .reference import block_attn_reference, norm_linear_attn_reference
from .softmax import softmax_attn

__all__ = [
    "block_attn",
    "block_attn_reference",
    "cosformer_attn",
    "favor_features",
    "flash_attn",
    "gau_attn",
    "kernel_linear_attn",
    "kernel_backend",
    "kernel_linear_attn_step",
    "norm_linear_attn",
    "norm_linear_attn_reference",
    "norm_linear_attn_step",
    "relu2_attention",
    "set_kernel_backend",
    "softmax_attn",
    "state_dtype_for",
]
