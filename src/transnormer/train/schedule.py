"""Learning-rate schedules as multipliers of the peak lr (for ``LambdaLR``).

- ``cosine``: linear warmup from 0, cosine decay to ``min_lr_ratio`` at ``total_steps``.
- ``inverse_sqrt`` (fairseq, the paper's LM setting): linear warmup from ``warmup_init_lr``,
  then peak · √warmup / √step.
- ``polynomial`` (RoBERTa MLM): linear warmup, then linear decay to 0 at ``total_steps``.
- ``constant``: warmup, then flat.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("cosine", "inverse_sqrt", "polynomial", "constant")


def lr_multiplier(step: int, *, kind: str, warmup: int, total_steps: int, min_lr_ratio: float = 0.1,
                  warmup_init_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based, before the update)."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    s = step + 1
    if warmup > 0 and s <= warmup:
        return warmup_init_ratio + (1 - warmup_init_ratio) * s / warmup
    if kind == "constant":
        return 1.0
    if kind == "inverse_sqrt":
        return math.sqrt(max(warmup, 1)) / math.sqrt(s)
    progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
    if kind == "polynomial":
        return 1.0 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer, params: dict) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over :func:`lr_multiplier`; ``params`` is read at every step, so it may change."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, **params))
