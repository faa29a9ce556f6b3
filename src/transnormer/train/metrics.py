"""Metrics: one JSON line per event (every step), TensorBoard when installed, loss-curve PNGs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .._files import atomic_savefig, atomic_write_text, read_jsonl


class MetricsLogger:
    """Append-only JSONL writer (rank 0 only) with an optional TensorBoard mirror."""

    def __init__(self, path: str | Path, *, enabled: bool = True, tensorboard: bool = True,
                 purge_step: int | None = None):
        """``purge_step``: a resumed run's first step; TensorBoard hides the abandoned run's events
        from it on (the JSONL file is cut back by ``truncate_metrics``)."""
        self.path = Path(path)
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=purge_step)
            except Exception:  # noqa: BLE001 - tensorboard is optional
                self._tb = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in record:
            kind = record.get("kind", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(f"{kind}/{k}", v, record["step"])

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                self._tb.close()


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a JSONL metrics file. A last line cut short (the process killed, or the disk
    full, mid-write) is dropped: it is the record of a step that a resumed run repeats anyway."""
    path = Path(path)
    return read_jsonl(path) if path.exists() else []


def truncate_metrics(path: str | Path, after_step: int, redo: tuple[str, ...] = ()) -> None:
    """Drop records past ``after_step`` (a resumed run rewrites the steps it repeats), and those at
    ``after_step`` of a kind in ``redo``: the resume's loop says which (an interrupted run's last
    train record off the logging grid, which the run that goes on would not have logged; an
    evaluation the resume makes up, whose record an earlier resume may have written already).
    Records before ``after_step`` are kept whatever their kind."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r.get("step", 0) < after_step or (
        r.get("step", 0) == after_step and r.get("kind") not in redo)]
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))


def plot_curves(series: dict[str, list[tuple[float, float]]], path: str | Path, *, xlabel: str = "step",
                ylabel: str = "loss", title: str = "", logy: bool = False, logx: bool = False) -> Path | None:
    """One PNG with a line per named series of (x, y) points; None when matplotlib is missing."""
    try:  # a Figure without pyplot: the caller's backend (a notebook's) is left as it is
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for name, pts in series.items():
        pts = [(x, y) for x, y in pts if y is not None and math.isfinite(y)]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, label=name, marker="o" if len(pts) < 30 else None, markersize=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log", base=2)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3, which="both" if logx or logy else "major")
    if ax.lines:  # a run with no finite point (diverged before its first evaluation) draws none
        ax.legend()
    fig.tight_layout()
    return atomic_savefig(fig, path, dpi=120)
