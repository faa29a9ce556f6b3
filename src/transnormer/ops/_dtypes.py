"""The state dtype, in a module of its own so that the fused kernels' wrapper (_native.py) and
the PyTorch forms (norm_linear.py, which imports _native) share one definition."""

from __future__ import annotations

import contextlib

import torch


def state_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrent state is kept in: fp32 for half types, else the input dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# Autocast exists for some device types only: asking about another (a "meta" tensor's, in shape-only
# calls) raises inside PyTorch.
def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (False where the device type has no autocast)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A context with autocast off for ``device_type`` (nothing to turn off where it has none)."""
    return torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) \
        else contextlib.nullcontext()

