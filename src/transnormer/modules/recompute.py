"""Whether activation checkpointing is re-running a block during the backward pass.

A module with side effects in training mode (BatchNorm's running statistics, Performer's redraw
counter) skips them while recomputing, so a checkpointed step updates them once, as a plain step
does. The model's checkpoint wrapper opens the scope for every call of a block after its first.

A module whose forward reads state that a later forward may change (Performer's random features,
redrawn every so many calls) :func:`remember` s what the first call used, and the recomputation
gets it back with :func:`replayed`: a loss of two forwards with a redraw between them had had the
first one's gradient computed with the second one's features.

Such a module sets the class attribute ``has_call_state = True``: the checkpoint wrapper opens
the scopes only for blocks that hold one (a block without is a pure function, which
torch.compile traces into the checkpoint).
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def recomputing() -> bool:
    """True inside :func:`recompute_scope` (on this thread)."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def recompute_scope(replay: dict | None = None):
    """Recomputing a block; ``replay``: what its first call :func:`remember` ed."""
    previous = recomputing(), getattr(_state, "replay", None)
    _state.on, _state.replay = True, replay
    try:
        yield
    finally:
        _state.on, _state.replay = previous


@contextlib.contextmanager
def record_scope(store: dict):
    """The first call of a checkpointed block: :func:`remember` writes into ``store``."""
    previous = getattr(_state, "record", None)
    _state.record = store
    try:
        yield
    finally:
        _state.record = previous


def remember(module, value) -> None:
    """Keep ``value`` for ``module``'s recomputation (when a checkpointed block's first call runs)."""
    store = getattr(_state, "record", None)
    if store is not None:
        store[module] = value


def replayed(module):
    """What ``module``'s first call remembered, while recomputing; else None."""
    replay = getattr(_state, "replay", None) if recomputing() else None
    return None if replay is None else replay.get(module)
