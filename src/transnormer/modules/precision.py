"""Tensors a module keeps at full precision when the model is cast down (``.half()``, ``.to(bf16)``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.nn as nn


def apply_keeping_full_precision(module: nn.Module, names: Iterable[str], apply: Callable[[], object]) -> nn.Module:
    """Run ``apply`` (the module's ``nn.Module._apply``) and give the tensors ``names`` (parameters or
    buffers; None ones skipped) and their gradients back at their old precision where it cast them
    below fp32: the same move (device) at the precision they had. Casts up and moves apply as usual."""
    # (.data: views of the storage as it is now; _apply then swaps in the converted tensors)
    before = {name: (t.data, None if t.grad is None else t.grad.data)
              for name in names if (t := getattr(module, name)) is not None}
    apply()
    for name, (data, grad) in before.items():
        t = getattr(module, name)
        if t.dtype.itemsize < 4 <= data.dtype.itemsize:
            t.grad = None
            t.data = data.to(t.device)
            if grad is not None:
                t.grad = grad.to(t.device)
    return module
