"""Learning-rate schedules as multipliers of the peak lr (for ``LambdaLR``).

Update k (1-based) of a warm-up of W updates runs at ``init + (peak − init) · k / W`` (``init`` =
``warmup_init_lr``, default 0): the first update is not at ``init`` (a rate of 0 would waste it), so
fairseq's inverse_sqrt, whose update k runs at ``init + (peak − init) · (k − 1) / W``, is followed one
update earlier.

- ``cosine``: warmup, then cosine decay to ``min_lr_ratio`` (the only schedule that reads it) at
  ``total_steps``; update k reads the decay at k − 1, as ``polynomial``, so the last update is not at
  ``min_lr_ratio`` (at 0, the LRA default, it had changed nothing: a one-step run stayed untrained).
  Runs saved before resume with their own convention (``cosine_lag`` 0).
- ``inverse_sqrt`` (fairseq, the paper's LM setting): warmup, then peak · √warmup / √step.
- ``polynomial`` (RoBERTa MLM): linear warmup, then linear decay towards 0 at ``total_steps``;
  as fairseq's, update k reads the decay at k − 1, so the last update has a non-zero rate (it
  had run at 0, a wasted step).
- ``constant``: warmup, then flat.
"""

from __future__ import annotations

import math

import torch

SCHEDULES = ("cosine", "inverse_sqrt", "polynomial", "constant")


def decay_progress(s: int, *, warmup: int, total_steps: int, refit_step: int = 0, refit_progress: float = 0.0) -> float:
    """How far update ``s`` (1-based) is through the decay, in [0, 1]: linear from the warmup's end
    to ``total_steps``; after a refit of ``total_steps`` (a time budget's schedule, fitted again
    as its steps double), linear from ``refit_progress`` at update ``refit_step`` to 1 at the new
    ``total_steps``, so that a longer fit slows the decay but never turns it back (the lr had
    risen again when the progress was recomputed from the start)."""
    base = max(warmup, refit_step)
    return min(1.0, refit_progress + (1 - refit_progress) * max(0, s - base) / max(1, total_steps - base))


def _decay_lag(kind: str, cosine_lag: int) -> int:
    """How many updates back update k reads its decay: one for the polynomial (as fairseq) and the
    cosine (``cosine_lag``: 0 for runs saved before), none for the others (no decay progress)."""
    return 1 if kind == "polynomial" else cosine_lag if kind == "cosine" else 0


def refit(params: dict, total_steps: int, next_step: int) -> None:
    """Set a new ``total_steps`` in a schedule's ``params`` (as :func:`make_scheduler` reads them)
    from optimizer step ``next_step`` on (0-based; the scheduler has already set that step's lr,
    which is where the decay continues from: the position that step reads, one update back for the
    polynomial and the cosine, so the rate does not jump)."""
    s = next_step + 1 - _decay_lag(params.get("kind"), params.get("cosine_lag", 1))
    params["refit_progress"] = decay_progress(s, warmup=params["warmup"], total_steps=params["total_steps"],
                                              refit_step=params.get("refit_step", 0),
                                              refit_progress=params.get("refit_progress", 0.0))
    params["refit_step"] = s
    params["total_steps"] = total_steps


def lr_multiplier(step: int, *, kind: str, warmup: int, total_steps: int, min_lr_ratio: float = 0.1,
                  warmup_init_ratio: float = 0.0, refit_step: int = 0, refit_progress: float = 0.0,
                  cosine_lag: int = 1) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based, before the update);
    ``refit_step`` / ``refit_progress``: see :func:`decay_progress`; ``cosine_lag``: update k reads the
    cosine decay at k − ``cosine_lag`` (0: as runs saved before the lag was introduced)."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    s = step + 1
    if warmup > 0 and s <= warmup:
        return warmup_init_ratio + (1 - warmup_init_ratio) * s / warmup
    if kind == "constant":
        return 1.0
    if kind == "inverse_sqrt":
        return math.sqrt(max(warmup, 1)) / math.sqrt(s)
    # The polynomial as fairseq's: fairseq sets the lr after each update from the updates done, so
    # update s decays from s - 1 (the last update is not at lr 0). The warmup here reaches the peak at
    # update `warmup` and the decay starts from it, so the peak runs two updates (in fairseq the first
    # warmup value does). The cosine the same way (``cosine_lag``).
    progress = decay_progress(s - _decay_lag(kind, cosine_lag), warmup=warmup, total_steps=total_steps,
                              refit_step=refit_step, refit_progress=refit_progress)
    if kind == "polynomial":
        return 1.0 - progress
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_scheduler(optimizer, params: dict) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over :func:`lr_multiplier`; ``params`` is read at every step, so it may change."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, **params))
