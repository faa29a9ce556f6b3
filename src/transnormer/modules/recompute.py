"""Whether activation checkpointing is re-running a block during the backward pass.

A module with side effects in training mode (BatchNorm's running statistics, Performer's redraw
counter) skips them while recomputing, so a checkpointed step updates them once, as a plain step
does. The model's checkpoint wrapper opens the scope for every call of a block after its first.
"""

from __future__ import annotations

import contextlib
import threading

_state = threading.local()


def recomputing() -> bool:
    """True inside :func:`recompute_scope` (on this thread)."""
    return getattr(_state, "on", False)


@contextlib.contextmanager
def recompute_scope():
    previous = recomputing()
    _state.on = True
    try:
        yield
    finally:
        _state.on = previous
