"""nn.Linear whose fp32 CPU product may run on oneDNN (ops/dense.py says where and why)."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.dense import linear


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, state-dict keys and init) computing through ``ops.dense.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
