"""Token mixers (attention layers) as nn.Modules, and the registry of layer types."""

from .base import LAYER_TYPES, TokenMixer, build_mixer, register_layer_type
from .cosformer import CosFormerAttention
from .diag_attention import DiagAttention
from .gau import FLASH, GAU, RelativePositionBias
from .linear_attention import KernelLinearAttention, LinearAttention
from .norm_attention import NormAttention
from .performer import Performer
from .softmax_attention import SoftmaxAttention

__all__ = [
    "FLASH",
    "GAU",
    "LAYER_TYPES",
    "CosFormerAttention",
    "DiagAttention",
    "KernelLinearAttention",
    "LinearAttention",
    "NormAttention",
    "Performer",
    "RelativePositionBias",
    "SoftmaxAttention",
    "TokenMixer",
    "build_mixer",
    "register_layer_type",
]
