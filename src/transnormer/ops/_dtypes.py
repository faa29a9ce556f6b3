"""The state dtype, in a module of its own so that the fused kernels' wrapper (_native.py) and
the PyTorch forms (norm_linear.py, which imports _native) share one definition."""

from __future__ import annotations

import torch


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrent state is kept in: fp32 for half types, else the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
