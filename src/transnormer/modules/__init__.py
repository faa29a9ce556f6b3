"""Building blocks shared by the layers: norms, feed-forward nets, positional encodings."""

from .ffn import FFN, GLU, build_ffn
from .norms import LayerNorm, MaskedBatchNorm, RMSNorm, ScaleNorm, SimpleRMSNorm, build_norm
from .positional import LRPE, LearnedPositions, SinusoidalPositions, build_lrpe, rotate, sinusoidal_table

__all__ = [
    "FFN", "GLU", "LRPE", "LayerNorm", "LearnedPositions", "MaskedBatchNorm", "RMSNorm", "ScaleNorm",
    "SimpleRMSNorm", "SinusoidalPositions", "build_ffn", "build_lrpe", "build_norm", "rotate", "sinusoidal_table",
]
