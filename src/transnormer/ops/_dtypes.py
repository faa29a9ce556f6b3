"""The state dtype and a projection's compute dtype, in a module of its own so that the fused
kernels' wrapper (_native.py) and the PyTorch forms (norm_linear.py, which imports _native) share
one definition."""

from __future__ import annotations

import torch


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrent state is kept in: fp32 for half types, else the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def projection_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer on x computes in: autocast's where it is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def fused_projection_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a Function that runs x Wᵀ itself does what F.linear would: fp32 or bf16 operands,
    of one dtype unless autocast casts them, on one device."""
    floats = (torch.float32, torch.bfloat16)
    return (x.dtype in floats and weight.dtype in floats and weight.device == x.device
            and (torch.is_autocast_enabled(x.device.type) or x.dtype == weight.dtype))
