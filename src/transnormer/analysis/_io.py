"""Shared output helpers of the analysis tools: JSON files and headless matplotlib figures."""

from __future__ import annotations

import json
from pathlib import Path

from .._files import atomic_savefig, atomic_write_text, to_jsonable


def save_json(obj, path) -> Path:
    path = Path(path)
    atomic_write_text(path, json.dumps(to_jsonable(obj), indent=2) + "\n")
    return path


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple[float, float] = (5.0, 4.0), **kw):
    """A Figure and its axes without pyplot, so no backend is selected or changed for the caller
    (the tools run headless in CI and inside notebooks alike)."""
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as e:  # the `plot` extra
        raise ModuleNotFoundError("plotting needs matplotlib: pip install 'transnormer[plot]'") from e
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def save_figure(fig, path) -> Path:
    fig.tight_layout()
    return atomic_savefig(fig, path, dpi=120)
