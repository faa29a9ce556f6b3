"""Feed-forward sub-layers: GLU (TransNormer, spec §4) and a plain two-layer MLP (LRA)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops._checks import check_positive_int
from ..ops.rowwise import projected_silu_gate
from .linear import Linear

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "identity": lambda x: x,  # "bilinear" GLU, what fairseq-evo HEAD trains (spec §12 item 5)
}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


class GLU(nn.Module):
    """FFN(x) = W₃(act(W₁x + b₁) ⊙ (W₂x + b₂)) + b₃; hidden ⌊8d/3⌋ by default. x: [..., d]."""

    def __init__(self, dim: int, hidden: int | None = None, act: str = "silu", dropout: float = 0.0):
        super().__init__()
        hidden = int(8 * dim / 3) if hidden is None else hidden
        check_positive_int("hidden", hidden)
        self.act_name, self.act = act, get_activation(act)
        self.l1 = Linear(dim, hidden)
        self.l2 = Linear(dim, hidden)
        self.l3 = Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_name == "silu":
            # one GEMM for both input projections and the fused gate (ops/rowwise.py): x is cast
            # and read once, and backward has no sum of two input gradients
            h = projected_silu_gate(x, self.l1.weight, self.l2.weight, self.l1.bias, self.l2.bias)
            return self.l3(self.dropout(h))
        return self.l3(self.dropout(self.act(self.l1(x)) * self.l2(x)))


class FFN(nn.Module):
    """Plain MLP: Linear(d → hidden), act, dropout, Linear(hidden → d). x: [..., d]."""

    def __init__(self, dim: int, hidden: int | None = None, act: str = "gelu", dropout: float = 0.0):
        super().__init__()
        hidden = 4 * dim if hidden is None else hidden
        check_positive_int("hidden", hidden)
        self.act_name, self.act = act, get_activation(act)
        self.l1 = Linear(dim, hidden)
        self.l2 = Linear(hidden, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.dropout(self.act(self.l1(x))))


FFN_TYPES = ("glu", "ffn")


def build_ffn(ffn_type: str, dim: int, hidden: int | None, act: str, dropout: float = 0.0) -> nn.Module:
    if ffn_type == "glu":
        return GLU(dim, hidden, act, dropout)
    if ffn_type == "ffn":
        return FFN(dim, hidden, act, dropout)
    raise ValueError(f"ffn_type must be one of {FFN_TYPES}, got {ffn_type!r}")
