"""Token mixers (attention layers) as nn.Modules, and the registry of layer types."""

from .base import LAYER_TYPES, TokenMixer, build_mixer, register_layer_type
from .diag_attention import DiagAttention
from .norm_attention import NormAttention

__all__ = ["LAYER_TYPES", "DiagAttention", "NormAttention", "TokenMixer", "build_mixer", "register_layer_type"]
